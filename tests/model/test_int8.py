"""Int8 weight-only quantization (``inkling_compiled.model.int8``, ``InklingMTP.quantize_``): the per-channel math,
what is quantized and what is left alone (the target's shared head above all), the compiled kernels (no weight
cast, muP folded into the head's scales, the draft-input fusion intact), save/load, and every bad argument."""

import re

import pytest
import torch
from torch import nn

from inkling_compiled import CheckpointError, InklingMTP
from inkling_compiled.arguments import ArgumentError
from inkling_compiled.model.int8 import Int8Linear, int8_linear, quantize_rows
from inkling_compiled.testing.kernel_stats import compile_fresh
from inkling_compiled.testing.synthetic import cached_checkpoint, load_hf_target
from tests.helpers import draft_rows, hidden_and_logits_step, random_mtp

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def checkpoint():
    return cached_checkpoint("tiny")


# ------------------------------------------------------------------------------------------------ the math


def test_quantize_rows_is_symmetric_per_output_channel():
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * torch.arange(1, 7)[:, None]
    w[4] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == BF16 and scale.shape == (6,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127  # symmetric range, no -128
    assert torch.equal(q.abs().amax(dim=1)[[0, 1, 2, 3, 5]], torch.full((5,), 127, dtype=torch.int8))
    assert torch.equal(q[4], torch.zeros(40, dtype=torch.int8)) and scale[4] == 1  # an all-zero row
    # q is rounded against the bf16 scale itself: within half a step of the weight, whatever the scale rounding
    err = (q.float() * scale.float()[:, None] - w).abs()
    assert bool((err <= scale.float()[:, None] * 0.5 * (1 + 2**-7)).all())


def test_quantize_rows_folds_a_multiplier_into_the_scale():
    w = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_rows(w, 1 / 24)
    q1, scale1 = quantize_rows(w / 24)
    assert torch.equal(q, q1) and torch.equal(scale, scale1)


def test_int8_linear_equals_its_dequantized_linear():
    w = torch.randn(7, 16, generator=torch.Generator().manual_seed(2))
    layer = Int8Linear.quantize(w)
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(3)).to(BF16)
    dequantized = layer.weight.float() * layer.scale.float()[:, None]
    assert layer(x).shape == (2, 3, 7)
    torch.testing.assert_close(layer(x).float(), x.float() @ dequantized.t(), rtol=2**-7, atol=2**-7)
    assert layer.nbytes == 7 * 16 + 7 * 2 and not layer.weight.requires_grad and not layer.scale.requires_grad


# ------------------------------------------------------------------------------------------------ what is quantized


def test_quantize_replaces_the_depth_linears_and_nothing_else():
    mtp = random_mtp(dtype=BF16)
    linears = {n: m.weight.nbytes for n, m in mtp.layers.named_modules() if isinstance(m, nn.Linear)}
    kept = {n: p for n, p in mtp.named_parameters() if n.removeprefix("layers.").removesuffix(".weight") not in linears}
    assert len(linears) == 8 * mtp.config.num_depths
    assert mtp.quantize_("int8", head=False) is mtp

    assert not [n for n, m in mtp.named_modules() if isinstance(m, nn.Linear)]
    assert {n for n, m in mtp.layers.named_modules() if isinstance(m, Int8Linear)} == set(linears)
    after = dict(mtp.named_parameters())
    for name, param in kept.items():  # norms, short convs, relative-bias tables, global scale, embedding, head
        assert after[name] is param and param.dtype == BF16, name
    assert mtp.quantized_head is None
    q = mtp.quantization
    assert (q.scheme, q.head, q.depth_bytes_before, q.head_copy_bytes) == ("int8", False, sum(linears.values()), 0)
    out_features = sum(m.weight.shape[0] for m in mtp.layers.modules() if isinstance(m, Int8Linear))
    assert q.depth_bytes == sum(linears.values()) // 2 + 2 * out_features  # int8 weights + bf16 scales


def test_head_copy_leaves_the_targets_head_alone(checkpoint):
    target = load_hf_target(checkpoint, dtype=BF16)
    head = target.get_output_embeddings().weight
    embed = target.get_input_embeddings().weight
    head_before, embed_before = head.detach().clone(), embed.detach().clone()
    mtp = InklingMTP.from_pretrained(checkpoint, target=target, quantize="int8")

    assert mtp.lm_head_weight is head and mtp.embed_weight is embed  # still shared, never replaced
    assert target.get_output_embeddings().weight is head and head.dtype == BF16
    assert torch.equal(head, head_before) and torch.equal(embed, embed_before)
    c = mtp.config
    assert mtp.quantized_head.weight.shape == (c.logits_vocab_size, c.hidden_size)  # the unpadded rows only
    assert mtp.quantization.head_copy_bytes == c.logits_vocab_size * (c.hidden_size + 2)  # int8 rows + bf16 scales


def test_int8_head_matches_the_bf16_head():
    mtp = random_mtp(dtype=BF16)
    hidden = torch.randn(4, mtp.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(BF16)
    want = mtp.compute_logits(hidden).float()
    mtp.quantize_("int8")
    got = mtp.compute_logits(hidden).float()
    assert got.shape == want.shape == (4, mtp.config.logits_vocab_size)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


# ------------------------------------------------------------------------------------------------ compiled kernels


def _bf16_copies_of_weights(code: list[str], mtp: InklingMTP) -> list[str]:
    """Allocations in the generated code of a bf16 buffer shaped like one of the int8 weights."""
    shapes = {tuple(m.weight.shape) for m in mtp.modules() if isinstance(m, Int8Linear)}
    found = re.findall(r"empty_strided_\w+\(\((\d+), (\d+)\), \(\d+, \d+\), torch\.bfloat16\)", "\n".join(code))
    return [f"{n}x{k}" for n, k in found if (int(n), int(k)) in shapes]


@pytest.mark.parametrize("rank", [2, 3])
def test_int8_linear_compiles_to_the_weight_only_kernel(rank):
    layer = Int8Linear.quantize(torch.randn(24, 16, generator=torch.Generator().manual_seed(5)))
    x = torch.randn(*(2, 3)[:rank - 1], 16, generator=torch.Generator().manual_seed(6)).to(BF16)
    run = compile_fresh(int8_linear, x, layer.weight, layer.scale, passes=True)
    assert run.stats.extern_calls == ["_weight_int8pack_mm"] and run.stats.kernels == 0  # no cast, no scale pass
    torch.testing.assert_close(run.output, layer(x), rtol=2**-7, atol=2**-7)


def test_int8_head_folds_mup_into_the_gemm_no_pass_over_the_logits():
    mtp = random_mtp(dtype=BF16)
    hidden = torch.randn(2, 3, mtp.config.hidden_size, generator=torch.Generator().manual_seed(7)).to(BF16)
    bf16 = compile_fresh(mtp.get_top_tokens, hidden, passes=True)
    mtp.quantize_("int8")
    int8 = compile_fresh(mtp.get_top_tokens, hidden, passes=True)
    assert bf16.stats.extern_calls == ["addmm"] and bf16.matches["fold_mup_scale"] == 1  # bf16: muP in the GEMM alpha
    assert int8.stats.extern_calls == ["_weight_int8pack_mm"] and int8.matches["fold_mup_scale"] == 0  # int8: in scales
    assert int8.stats.loop_nests == bf16.stats.loop_nests == 1  # the argmax alone: no division, no slice pass
    assert not _bf16_copies_of_weights(int8.code, mtp)


def test_compiled_int8_step_keeps_the_draft_input_fusion(checkpoint):
    bf16 = InklingMTP.from_pretrained(checkpoint, dtype=BF16)
    int8 = InklingMTP.from_pretrained(checkpoint, quantize="int8")
    ids, positions, previous = draft_rows(int8)
    want = compile_fresh(hidden_and_logits_step(bf16), ids, positions, previous, passes=True)
    got = compile_fresh(hidden_and_logits_step(int8), ids, positions, previous, passes=True)

    assert want.matches == {"fuse_draft_input_embed": 1, "fuse_draft_input": 0, "fold_mup_scale": 1}
    # muP lives in the int8 head's scales
    assert got.matches == {"fuse_draft_input_embed": 1, "fuse_draft_input": 0, "fold_mup_scale": 0}
    calls, bf16_calls = got.stats.extern_calls, want.stats.extern_calls
    assert calls.count("_weight_int8pack_mm") == 9 and "addmm" not in calls  # 8 depth linears + the head
    assert calls.count("mm") == bf16_calls.count("mm") - 8 and len(calls) == len(bf16_calls)  # the rel-bias mm stays
    assert got.stats.loop_nests == want.stats.loop_nests and got.stats.kernels == want.stats.kernels
    assert not _bf16_copies_of_weights(got.code, int8)
    eager = hidden_and_logits_step(int8)(ids, positions, previous)
    for compiled, reference in zip(got.output, eager):
        assert (compiled.float() - reference.float()).abs().max() <= 0.02 * reference.float().abs().max()


# ------------------------------------------------------------------------------------------------ save / load


def test_from_pretrained_quantize_equals_quantizing_after_loading(checkpoint):
    loaded = InklingMTP.from_pretrained(checkpoint, quantize="int8")
    by_hand = InklingMTP.from_pretrained(checkpoint, dtype=BF16).quantize_("int8")
    assert loaded.quantization == by_hand.quantization
    mine, theirs = dict(loaded.named_parameters()), dict(by_hand.named_parameters())
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)
    depths_only = InklingMTP.from_pretrained(checkpoint, quantize="int8", quantize_head=False)
    assert depths_only.quantized_head is None and depths_only.quantization.head is False


def test_a_quantized_model_is_not_saved(tmp_path):
    mtp = random_mtp(dtype=BF16).quantize_("int8")
    with pytest.raises(CheckpointError, match=r"cannot save a quantized model.*quantize='int8'"):
        mtp.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize(("scheme", "error", "message"), [
    (8, TypeError, r"quantize must be a scheme name \['int8'\], a torchao config instance, or None, got int 8"),
    ("int4", ValueError, r"^quantize: unknown quantization scheme 'int4': choose from \['int8'\] or pass a torchao"),
    ("float8", ValueError, r"^quantize: the scheme 'float8' is not offered: float8 weight-only has no GEMM kernel"),
])
def test_bad_schemes(scheme, error, message, checkpoint):
    with pytest.raises(error, match=message):
        random_mtp(dtype=BF16).quantize_(scheme)
    with pytest.raises(error, match=message):  # before reading any file
        InklingMTP.from_pretrained(checkpoint.parent / "does-not-exist", quantize=scheme)


def test_head_must_be_a_bool(checkpoint):
    with pytest.raises(ArgumentError, match="head must be a bool, got 'yes'"):
        random_mtp(dtype=BF16).quantize_("int8", head="yes")
    with pytest.raises(ArgumentError, match="quantize_head must be a bool, got 1"):
        InklingMTP.from_pretrained(checkpoint, quantize="int8", quantize_head=1)


def test_float32_activations_are_refused_not_converted(checkpoint):
    mtp = random_mtp(dtype=torch.float32)
    with pytest.raises(ArgumentError, match=r"bfloat16 activations, this model runs in torch.float32.*over 10x slower"):
        mtp.quantize_("int8")
    assert mtp.quantization is None and not any(isinstance(m, Int8Linear) for m in mtp.modules())
    with pytest.raises(ArgumentError, match=r"bfloat16 activations, this model runs in torch.float32"):
        InklingMTP.from_pretrained(checkpoint, dtype=torch.float32, quantize="int8")
    target = load_hf_target(checkpoint)  # float32: the shared tensors decide the dtype
    with pytest.raises(ArgumentError, match=r"runs in torch.float32.*the target must be bfloat16"):
        InklingMTP.from_pretrained(checkpoint, target=target, quantize="int8")


def test_float16_activations_are_refused_naming_float16():
    with pytest.raises(ArgumentError, match=r"runs in torch.float16, for which no int8 kernel applies"):
        random_mtp(dtype=torch.float16).quantize_("int8")


def test_converting_a_quantized_model_to_float32_fails_at_the_next_call():
    mtp = random_mtp(dtype=BF16).quantize_("int8").to(torch.float32)
    with pytest.raises(ValueError, match=r"bfloat16 activations, this model runs in torch.float32") as refused:
        mtp(*draft_rows(mtp))
    assert not isinstance(refused.value, ArgumentError)  # the model's state, not an argument of the call


def test_device_without_an_int8_kernel():
    mtp = random_mtp(dtype=BF16).to("meta")
    with pytest.raises(ArgumentError, match="int8 weight-only drafting has kernels on cpu and cuda, not on meta"):
        mtp.quantize_("int8")


def test_quantizing_twice():
    mtp = random_mtp(dtype=BF16).quantize_("int8", head=False)
    with pytest.raises(ValueError, match=r"already quantized \(int8, head=False\)"):
        mtp.quantize_("int8")
