"""fold_mup_scale (muP head -> one GEMM with alpha): what fires, that no pointwise kernel is left around the GEMM,
numerics against the unfused compile and eager, and what must not fire."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config

from inkling_compiled.model.head import mup_logits
from inkling_compiled.passes import fold_mup_scale
from inkling_compiled.passes.fusion import trace
from inkling_compiled.testing.kernel_stats import compile_fresh

H, V, VOCAB, MUP = 64, 96, 90, 24.0  # V rows in the table, VOCAB kept (padded vocab, as on Inkling)


def _inputs(dtype, lead, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (4 * torch.randn(*lead, H, generator=g)).to(dtype)
    weight = torch.randn(V, H, generator=g).to(dtype)
    return hidden, weight


def compute_logits(hidden, weight):  # InklingMTP.compute_logits
    return mup_logits(hidden, weight, MUP, VOCAB)


def get_top_tokens(hidden, weight):  # InklingMTP.get_top_tokens
    return compute_logits(hidden, weight).argmax(-1)


def softmax_probs(hidden, weight):  # a sampling consumer
    return compute_logits(hidden, weight).float().softmax(-1)


@pytest.mark.parametrize("dtype, lead", [(torch.float32, (2, 5)), (torch.bfloat16, (5,)), (torch.bfloat16, (2, 5))])
def test_logits_become_one_gemm(dtype, lead, ulps):
    hidden, weight = _inputs(dtype, lead)
    stock = compile_fresh(compute_logits, hidden, weight, passes=False)
    fused = compile_fresh(compute_logits, hidden, weight, passes=True)
    assert fused.matches["fold_mup_scale"] == 1
    assert (stock.stats.kernels, stock.stats.extern_calls) == (1, ["mm"])  # the division, then mm
    assert (fused.stats.kernels, fused.stats.extern_calls) == (0, ["addmm"])  # the slice is a view: nothing else
    assert fused.output.shape == (*lead, VOCAB)
    if dtype == torch.float32:
        torch.testing.assert_close(fused.output, stock.output, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused.output, compute_logits(hidden, weight), rtol=1e-5, atol=1e-5)
    else:
        # alpha in the fp32 epilogue means one rounding: the fused logits are the correctly rounded ones (the
        # unfused compile rounds hidden/mup to bf16 first, and measured up to 4 bf16 steps off on these inputs)
        exact = (hidden.double() @ weight.double().T / MUP)[..., :VOCAB]
        assert ulps(fused.output, exact.to(dtype)).max().item() <= 1
        assert (fused.output.double() - exact).abs().max() <= (stock.output.double() - exact).abs().max()


def test_argmax_consumer_keeps_only_its_reduction():
    hidden, weight = _inputs(torch.bfloat16, (2, 5))
    stock = compile_fresh(get_top_tokens, hidden, weight, passes=False)
    fused = compile_fresh(get_top_tokens, hidden, weight, passes=True)
    assert fused.matches["fold_mup_scale"] == 1
    assert stock.stats.extern_calls == ["mm"] and fused.stats.extern_calls == ["addmm"]
    assert stock.stats.loop_nests == 2 and fused.stats.loop_nests == 1  # division gone, argmax stays
    logits = compute_logits(hidden, weight).float()
    picked = logits.gather(-1, fused.output.unsqueeze(-1)).squeeze(-1)
    assert torch.all(picked >= logits.max(-1).values - 0.25)  # a near-tie may flip with one ulp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_consumer(dtype):
    hidden, weight = _inputs(dtype, (2, 5))
    fused = compile_fresh(softmax_probs, hidden, weight, passes=True)
    assert fused.matches["fold_mup_scale"] == 1
    assert "addmm" in fused.stats.extern_calls and "mm" not in fused.stats.extern_calls
    torch.testing.assert_close(fused.output, softmax_probs(hidden, weight), rtol=1e-2, atol=1e-3)


@pytest.mark.usefixtures("tests_count_as_model")
def test_spellings_the_model_does_not_emit_are_left_stock():
    # only (hidden / mup) @ U^T is registered: even counted as the model's code, other scaled linears stay stock
    hidden, weight = _inputs(torch.float32, (2, 5))

    def spellings(hidden, weight):
        return (
            F.linear(hidden * (1 / MUP), weight),
            hidden @ weight.T / MUP,
            F.linear(hidden[0], weight) * 0.5,
        )

    run = compile_fresh(spellings, hidden, weight, passes=True)
    assert run.matches["fold_mup_scale"] == 0
    assert run.stats.extern_calls == ["mm"] * 3
    for got, want in zip(run.output, spellings(hidden, weight)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("tests_count_as_model")
@pytest.mark.parametrize("scale", ["0-d", "vector"])
def test_tensor_scale_does_not_fire(scale):
    hidden, weight = _inputs(torch.float32, (2, 5))
    s = torch.tensor(MUP) if scale == "0-d" else torch.full((H,), MUP)

    def head(hidden, weight, s):
        return F.linear(hidden / s, weight)[..., :VOCAB]

    run = compile_fresh(head, hidden, weight, s, passes=True)
    assert run.matches["fold_mup_scale"] == 0
    assert run.stats.extern_calls == ["mm"]


def test_symbolic_row_count_still_fires():
    # A recompile for a new length makes T symbolic: the reshapes around the mm then carry size expressions.
    hidden, weight = _inputs(torch.float32, (2, 5))
    torch._dynamo.mark_dynamic(hidden, 1)
    fused = compile_fresh(compute_logits, hidden, weight, passes=True)
    assert fused.matches["fold_mup_scale"] == 1 and fused.stats.extern_calls == ["addmm"]
    torch.testing.assert_close(fused.output, compute_logits(hidden, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("tests_count_as_model")
def test_gemms_that_are_not_rows_times_weight_t_do_not_fire():
    hidden, _ = _inputs(torch.float32, (2, 5))
    square = torch.randn(H, H)

    def not_linear(hidden, square):
        # (distinct scales: each division has its one reader, as in the pattern)
        untransposed = (hidden / 2.0).reshape(-1, H) @ square.permute(0, 1)  # x @ W, not x @ W.T
        regrouped = F.linear((hidden / 3.0).reshape(-1, H), square).reshape(5, 2, H)  # rows into other dims
        control = F.linear(hidden / 4.0, square)  # the real thing, in the same graph
        return untransposed, regrouped, control

    run = compile_fresh(not_linear, hidden, square, passes=True)
    assert run.matches["fold_mup_scale"] == 1  # the control only
    for got, want in zip(run.output, not_linear(hidden, square)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_unused_bias_is_free_unless_gemm_templates_read_it():
    x, w = torch.randn(3, 8), torch.randn(5, 8)

    def targets(max_autotune):
        with inductor_config.patch(max_autotune=max_autotune):
            gm = trace(fold_mup_scale.mup_logits_alpha, [x, w, MUP])
        return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}

    assert "aten.empty.memory_format" in targets(False)  # a bare allocation: no kernel
    assert "aten.full.default" in targets(True)  # templates compute bias * 0: real zeros (NaN * 0 is NaN)


def test_registered_patterns():
    (fusion,) = fold_mup_scale.FUSIONS
    fusion.ensure_registered()
    n = sum(len(v) for v in fusion.patterns.patterns.values())
    assert n == len(fold_mup_scale._RANKS)  # the model's one spelling; dtypes trace to the same GEMM graph
