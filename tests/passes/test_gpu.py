"""The pass checks on CUDA in bf16, where a kernel is a Triton kernel (run with ``pytest -m gpu``).

Counts are ``async_compile.triton(`` definitions in the generated wrapper. ``coordinate_descent_tuning`` is
pinned off: with it Inductor turns an M==1 ``mm`` into a reduction before the post-grad passes, and there is then
no GEMM left to put the scale into.
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
    with inductor_config.patch(coordinate_descent_tuning=False, max_autotune=False, max_autotune_gemm=False):
        yield


def _cuda(*tensors):
    return tuple(t.cuda() for t in tensors)


@pytest.mark.parametrize("hidden_first", [True, False])
def test_fuse_draft_input_ids_path_one_triton_kernel(hidden_first):
    hidden, table, ids, w_pre, w_h, w_e, _ = _inputs(torch.bfloat16, (4, 7))
    args = _cuda(hidden, table, ids, w_pre, w_h, w_e)
    block = _depth_input(hidden_first)
    stock = compile_fresh(block, *args, passes=False)
    fused = compile_fresh(block, *args, passes=True)
    assert fused.matches["fuse_draft_input_embed"] == 1
    assert stock.stats.triton_kernels == 2 and fused.stats.triton_kernels == 1
    assert torch.equal(fused.output, stock.output)


def test_fuse_draft_input_inputs_embeds_one_triton_kernel():
    from inkling_compiled.model.depth_input import concat_normed

    hidden, _, _, _, w_h, w_e, embeds = _inputs(torch.bfloat16, (4, 7))

    def block(hidden, embeds, w_h, w_e):
        return concat_normed(hidden, embeds, w_h, w_e, EPS, True)

    args = _cuda(hidden, embeds, w_h, w_e)
    stock = compile_fresh(block, *args, passes=False)
    fused = compile_fresh(block, *args, passes=True)
    assert fused.matches["fuse_draft_input"] == 1
    assert stock.stats.triton_kernels == 2 and fused.stats.triton_kernels == 1
    assert torch.equal(fused.output, stock.output)


@pytest.mark.parametrize("lead", [(1, 1), (4, 7)])  # (1, 1): the decode step, M == 1
def test_fold_mup_scale_leaves_no_pointwise_kernel(lead, ulps):
    hidden, weight = _cuda(*_head_inputs(torch.bfloat16, lead))
    stock = compile_fresh(compute_logits, hidden, weight, passes=False)
    fused = compile_fresh(compute_logits, hidden, weight, passes=True)
    assert fused.matches["fold_mup_scale"] == 1
    assert stock.stats.extern_calls == ["mm"] and stock.stats.triton_kernels == 1
    assert fused.stats.extern_calls == ["addmm"] and fused.stats.triton_kernels == 0
    exact = (hidden.double() @ weight.double().T / MUP)[..., :VOCAB]
    assert ulps(fused.output, exact.to(torch.bfloat16)).max().item() <= 1
    assert (fused.output.double() - exact).abs().max() <= (stock.output.double() - exact).abs().max()


def test_top_tokens_keep_only_the_argmax_kernel():
    hidden, weight = _cuda(*_head_inputs(torch.bfloat16, (1, 1)))
    fused = compile_fresh(get_top_tokens, hidden, weight, passes=True)
    assert fused.matches["fold_mup_scale"] == 1
    assert fused.stats.extern_calls == ["addmm"] and fused.stats.triton_kernels == 1


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
    assert fused.stats.triton_kernels <= stock.stats.triton_kernels - 1
    assert fused.stats.extern_calls.count("addmm") >= 1
    assert torch.equal(fused.output[0], stock.output[0])
