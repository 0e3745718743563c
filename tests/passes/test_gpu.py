"""The pass checks on CUDA in bf16, where a kernel is a Triton kernel (run with ``pytest -m gpu``).

Counts are Triton *launches* (``<kernel>.run(`` in the wrapper), not definitions: Inductor emits identical kernel
sources once, so stock Inductor's two identical RMSNorms are one definition launched twice. Stock and fused outputs
are compared in bf16 ulps, not bitwise: the two compiles' kernels differ and are autotuned independently (another
persistent-reduction block size or warp count is another summation order), which may flip a bf16 rounding.
``coordinate_descent_tuning`` is pinned off: with it Inductor turns an M==1 ``mm`` into a reduction before the
post-grad passes, and there is then no GEMM left to put the scale into.
"""

import pytest
import torch
from torch._inductor import config as inductor_config

from inkling_compiled.testing.kernel_stats import compile_fresh
from tests.helpers import hidden_and_logits_step

from .test_fold_mup_scale import MUP, VOCAB, compute_logits, get_top_tokens
from .test_fold_mup_scale import _inputs as _head_inputs
from .test_fuse_draft_input import EPS, _depth_input, _inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def _extern_gemms():
    """Extern cuBLAS GEMMs, accumulating in fp32 throughout: with bf16 reductions allowed (torch's default) a split-K
    GEMM may round partial sums to bf16, and "alpha in the fp32 epilogue is one rounding" would no longer hold."""
    matmul = torch.backends.cuda.matmul
    reduced = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        with inductor_config.patch(coordinate_descent_tuning=False, max_autotune=False, max_autotune_gemm=False):
            yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = reduced


def _cuda(*tensors):
    return tuple(t.cuda() for t in tensors)


@pytest.mark.parametrize("hidden_first", [True, False])
def test_fuse_draft_input_ids_path_one_triton_kernel(hidden_first, ulps):
    hidden, table, ids, w_pre, w_h, w_e, _ = _inputs(torch.bfloat16, (4, 7))
    args = _cuda(hidden, table, ids, w_pre, w_h, w_e)
    block = _depth_input(hidden_first)
    stock = compile_fresh(block, *args, passes=False)
    fused = compile_fresh(block, *args, passes=True)
    assert fused.matches["fuse_draft_input_embed"] == 1
    assert stock.stats.triton_launches == 2 and fused.stats.triton_launches == 1
    assert ulps(fused.output, stock.output).max().item() <= 1


def test_fuse_draft_input_inputs_embeds_one_triton_kernel(ulps):
    from inkling_compiled.model.depth_input import concat_normed

    hidden, _, _, _, w_h, w_e, embeds = _inputs(torch.bfloat16, (4, 7))

    def block(hidden, embeds, w_h, w_e):
        return concat_normed(hidden, embeds, w_h, w_e, EPS, True)

    args = _cuda(hidden, embeds, w_h, w_e)
    stock = compile_fresh(block, *args, passes=False)
    fused = compile_fresh(block, *args, passes=True)
    assert fused.matches["fuse_draft_input"] == 1
    # stock: the two RMSNorms are one kernel source, defined once and launched twice
    assert (stock.stats.triton_kernels, stock.stats.triton_launches) == (1, 2)
    assert (fused.stats.triton_kernels, fused.stats.triton_launches) == (1, 1)
    assert ulps(fused.output, stock.output).max().item() <= 1


@pytest.mark.parametrize("lead", [(1, 1), (4, 7)])  # (1, 1): the decode step, M == 1
def test_fold_mup_scale_leaves_no_pointwise_kernel(lead, ulps):
    hidden, weight = _cuda(*_head_inputs(torch.bfloat16, lead))
    stock = compile_fresh(compute_logits, hidden, weight, passes=False)
    fused = compile_fresh(compute_logits, hidden, weight, passes=True)
    assert fused.matches["fold_mup_scale"] == 1
    assert stock.stats.extern_calls == ["mm"] and stock.stats.triton_launches == 1
    assert fused.stats.extern_calls == ["addmm"] and fused.stats.triton_launches == 0
    exact = (hidden.double() @ weight.double().T / MUP)[..., :VOCAB]
    assert ulps(fused.output, exact.to(torch.bfloat16)).max().item() <= 1
    assert (fused.output.double() - exact).abs().max() <= (stock.output.double() - exact).abs().max()


def test_top_tokens_keep_only_the_argmax_kernel():
    hidden, weight = _cuda(*_head_inputs(torch.bfloat16, (1, 1)))
    fused = compile_fresh(get_top_tokens, hidden, weight, passes=True)
    assert fused.matches["fold_mup_scale"] == 1
    assert fused.stats.extern_calls == ["addmm"] and fused.stats.triton_launches == 1


def test_real_model_step_cuda_bf16():
    from inkling_compiled import InklingMTP
    from inkling_compiled.testing.synthetic import cached_checkpoint

    mtp = InklingMTP.from_pretrained(cached_checkpoint("tiny"), dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, mtp.config.vocab_size, (2, 5), generator=g).cuda()
    positions = torch.arange(5).expand(2, 5).cuda()
    previous = torch.randn(2, 5, mtp.config.hidden_size, generator=g).to(torch.bfloat16).cuda()

    step = hidden_and_logits_step(mtp)

    stock = compile_fresh(step, ids, positions, previous, passes=False)
    fused = compile_fresh(step, ids, positions, previous, passes=True)
    assert fused.matches == {"fuse_draft_input_embed": 1, "fuse_draft_input": 0, "fold_mup_scale": 1}
    assert fused.stats.triton_launches == stock.stats.triton_launches - 1  # the input block: 2 launches -> 1
    assert stock.stats.extern_calls.count("addmm") == 0 and fused.stats.extern_calls.count("addmm") == 1
    assert len(fused.stats.extern_calls) == len(stock.stats.extern_calls)  # mm -> addmm, nothing added
    # a bf16 rounding flipped in the input block travels through the depth, so the hidden is compared with an fp32
    # run of the same weights: what the fusion changes stays within what bf16 itself changes
    reference = hidden_and_logits_step(mtp.float())(ids, positions, previous.float())[0]
    fusion_change = (fused.output[0].float() - stock.output[0].float()).abs().max()
    assert fusion_change <= (stock.output[0].float() - reference).abs().max()
