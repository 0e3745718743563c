"""Input validation of ``InklingMTP.forward`` and ``Drafter.draft``: every bad id, shape, dtype, device, position,
batch, depth or cache is refused with a ValueError that names the problem, before anything is computed or written."""

from __future__ import annotations

import re

import pytest
import torch

from inkling_compiled.arguments import ArgumentError
from inkling_compiled.runtime.drafter import Drafter
from tests.helpers import random_mtp

B, T, MAX_LEN = 2, 3, 8


@pytest.fixture(scope="module")
def model():
    return random_mtp()  # H 64, vocab 256 (250 unpadded), 2 depths, fp32


@pytest.fixture
def drafter(model):
    return Drafter(model, max_batch_size=B, max_length=MAX_LEN, compile=False, num_speculative_tokens=1)


@pytest.fixture
def inputs(model):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.logits_vocab_size, (B, T), generator=gen)
    positions = torch.arange(T).expand(B, T).clone()
    hidden = torch.randn(B, T, model.config.hidden_size, generator=gen)
    return ids, positions, hidden


def _run(kind, model, drafter, ids, positions, hidden, **kwargs):
    if kind == "forward":
        cache = kwargs.pop("cache", model.new_cache(B, MAX_LEN))
        return model(ids, positions, hidden, cache=cache, **kwargs)
    return drafter.draft(ids, positions, hidden)


BOTH = pytest.mark.parametrize("kind", ["forward", "drafter"])


def test_sizes(model):
    assert (model.config.vocab_size, model.config.logits_vocab_size, model.config.hidden_size) == (256, 250, 64)


@BOTH
def test_valid_inputs_pass(kind, model, drafter, inputs):
    _run(kind, model, drafter, *inputs)


# ------------------------------------------------------------------------------------------------ token ids


@BOTH
@pytest.mark.parametrize("bad", [-1, -100, 256, 10_000])  # negative, or past the padded vocab (the table's rows)
def test_token_id_out_of_range(kind, model, drafter, inputs, bad):
    ids, positions, hidden = inputs
    ids = ids.clone()
    ids[1, 2] = bad
    with pytest.raises(ArgumentError, match=rf"token id {bad} out of range: ids must be in \[0, 256\)"):
        _run(kind, model, drafter, ids, positions, hidden)


@BOTH
@pytest.mark.parametrize("token", [250, 255])
def test_token_id_between_unpadded_and_padded_vocab_is_valid(kind, model, drafter, inputs, token):
    ids, positions, hidden = inputs
    out = _run(kind, model, drafter, torch.full_like(ids, token), positions, hidden)
    if kind == "drafter":
        assert (out.tokens < model.config.logits_vocab_size).all()  # drafts stay in the unpadded vocab
    else:
        assert torch.isfinite(out).all()


@BOTH
def test_int32_ids_are_accepted(kind, model, drafter, inputs):
    ids, positions, hidden = inputs
    _run(kind, model, drafter, ids.int(), positions.int(), hidden)


# ------------------------------------------------------------------------------------------------ shapes


@BOTH
def test_one_dimensional_ids(kind, model, drafter, inputs):
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match=r"input_ids must have 2 dims, got shape \(3,\)"):
        _run(kind, model, drafter, ids[0], positions, hidden)


def test_one_dimensional_positions_forward(model, inputs):
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match=r"positions must have 2 dims, got shape \(3,\)"):
        model(ids, positions[0], hidden)


def test_one_dimensional_positions_drafter(drafter, inputs):
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match=r"positions must be a \[batch, rows\] tensor, got \(3,\)"):
        drafter.draft(ids, positions[0], hidden)


@pytest.mark.parametrize("temperature", [-0.5, float("nan"), float("inf")])
def test_drafter_temperature_must_be_finite_and_non_negative(drafter, inputs, temperature):
    with pytest.raises(ArgumentError, match=r"temperature must be 0 \(greedy\) or a finite number >= 1e-06"):
        drafter.draft(*inputs, temperature=temperature)


def test_positions_not_a_tensor_drafter(drafter, inputs):
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match=r"positions must be a \[batch, rows\] tensor, got list"):
        drafter.draft(ids, positions.tolist(), hidden)


def test_hidden_not_a_tensor(model, inputs):
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match=r"previous_hidden must be a torch\.Tensor, got list"):
        model(ids, positions, hidden.tolist())


@BOTH
def test_hidden_wrong_width(kind, model, drafter, inputs):
    ids, positions, _ = inputs
    with pytest.raises(ArgumentError, match=r"previous_hidden has shape \(2, 3, 65\), expected \(2, 3, 64\)"):
        _run(kind, model, drafter, ids, positions, torch.randn(B, T, 65))


@BOTH
def test_hidden_two_dimensional(kind, model, drafter, inputs):
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match=r"previous_hidden must have 3 dims, got shape \(2, 64\)"):
        _run(kind, model, drafter, ids, positions, hidden[:, 0])


@BOTH
def test_ids_rows_mismatch(kind, model, drafter, inputs):
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match=r"input_ids has shape \(2, 2\), expected \(2, 3\)"):
        _run(kind, model, drafter, ids[:, :2], positions, hidden)


@BOTH
def test_hidden_rows_mismatch(kind, model, drafter, inputs):
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match=r"previous_hidden has shape \(2, 4, 64\), expected \(2, 3, 64\)"):
        _run(kind, model, drafter, ids, positions, torch.randn(B, T + 1, 64))


@BOTH
def test_batch_mismatch(kind, model, drafter, inputs):
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match=r"previous_hidden has shape \(1, 3, 64\), expected \(2, 3, 64\)"):
        _run(kind, model, drafter, ids, positions, hidden[:1])


@BOTH
@pytest.mark.parametrize("shape", [(2, 0), (0, 3)])
def test_no_rows(kind, model, drafter, shape):
    ids = torch.zeros(shape, dtype=torch.long)
    with pytest.raises(ArgumentError, match=rf"positions has no rows \(shape \({shape[0]}, {shape[1]}\)\)"):
        _run(kind, model, drafter, ids, ids.clone(), torch.zeros(*shape, 64))


# ------------------------------------------------------------------------------------------------ dtypes, devices


@BOTH
def test_float_ids(kind, model, drafter, inputs):
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match=r"input_ids must be an integer tensor, got torch\.float32"):
        _run(kind, model, drafter, ids.float(), positions, hidden)


@BOTH
def test_bool_ids(kind, model, drafter, inputs):
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match=r"input_ids must be an integer tensor, got torch\.bool"):
        _run(kind, model, drafter, ids.bool(), positions, hidden)


@BOTH
def test_float_positions(kind, model, drafter, inputs):
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match=r"positions must be an integer tensor, got torch\.float32"):
        _run(kind, model, drafter, ids, positions.float(), hidden)


@BOTH
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_hidden_wrong_dtype(kind, model, drafter, inputs, dtype):
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match=rf"previous_hidden has dtype {dtype}, the model runs in torch\.float32"):
        _run(kind, model, drafter, ids, positions, hidden.to(dtype))


@BOTH
@pytest.mark.parametrize("which", ["input_ids", "positions", "previous_hidden"])
def test_meta_tensor(kind, model, drafter, inputs, which):
    args = dict(zip(["input_ids", "positions", "previous_hidden"], inputs))
    args[which] = torch.empty(args[which].shape, dtype=args[which].dtype, device="meta")
    with pytest.raises(ArgumentError, match=rf"{which} is on meta, the model on cpu"):
        _run(kind, model, drafter, *args.values())


# ------------------------------------------------------------------------------------------------ positions, batch


def test_position_past_cache_forward(model, inputs):
    ids, positions, hidden = inputs
    cache = model.new_cache(B, MAX_LEN)
    model(ids, positions + MAX_LEN - T, hidden, cache=cache)  # last real slot
    model(ids, torch.full_like(positions, cache.pad_position), hidden, cache=cache)  # padding rows
    ragged = positions + MAX_LEN - T  # sequence 0 ends at the last slot and is padded after it: a valid batch
    ragged[0] = torch.tensor([MAX_LEN - 2, MAX_LEN - 1, cache.pad_position])
    model(ids, ragged, hidden, cache=cache)
    with pytest.raises(ArgumentError, match=rf"position {MAX_LEN + 1} is past the cache capacity: max_length is "
                                         rf"{MAX_LEN} \(positions 0\.\.{MAX_LEN - 1}; {MAX_LEN} marks padding rows\)"):
        model(ids, positions + MAX_LEN - 1, hidden, cache=cache)


def test_position_past_cache_drafter(drafter, inputs):
    ids, positions, hidden = inputs
    ids, hidden = ids.repeat(1, 3)[:, :MAX_LEN], hidden.repeat(1, 3, 1)[:, :MAX_LEN]
    drafter.draft(ids, torch.arange(MAX_LEN).expand(B, MAX_LEN), hidden)  # up to the last position
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match=rf"position {MAX_LEN} is past the cache capacity: max_length is {MAX_LEN} "
                                         rf"\(positions 0\.\.{MAX_LEN - 1}; negative positions mark padding rows\)"):
        drafter.draft(ids, positions + MAX_LEN - T + 1, hidden)


def test_positions_are_unbounded_without_cache(model, inputs):
    ids, positions, hidden = inputs
    model(ids, positions + 10_000, hidden)


@pytest.mark.parametrize("cached", [False, True])
def test_negative_position_forward(model, inputs, cached):
    ids, positions, hidden = inputs
    positions = positions.clone()
    positions[0, 0] = -1
    cache = model.new_cache(B, MAX_LEN) if cached else None
    with pytest.raises(ArgumentError, match=r"position -1 is negative"):
        model(ids, positions, hidden, cache=cache)


def test_negative_position_is_padding_for_drafter(drafter, inputs):
    ids, positions, hidden = inputs
    padded = positions.clone()
    padded[0, 0] = -1
    drafter.draft(ids[:, :1], positions[:, :1], hidden[:, :1])  # position 0 first: the calls below continue it
    assert torch.equal(drafter.draft(ids, padded, hidden).tokens[0], drafter.draft(ids[:, 1:], positions[:, 1:],
                                                                                   hidden[:, 1:]).tokens[0])


def test_batch_larger_than_cache_forward(model):
    ids = torch.zeros(B + 1, T, dtype=torch.long)
    positions = torch.arange(T).expand(B + 1, T)
    with pytest.raises(ArgumentError, match=rf"batch of {B + 1} sequences exceeds the cache's batch_size {B}"):
        model(ids, positions, torch.zeros(B + 1, T, 64), cache=model.new_cache(B, MAX_LEN))


def test_batch_larger_than_drafter(drafter):
    ids = torch.zeros(B + 1, T, dtype=torch.long)
    positions = torch.arange(T).expand(B + 1, T)
    with pytest.raises(ArgumentError, match=rf"batch of {B + 1} sequences exceeds the drafter's max_batch_size {B}"):
        drafter.draft(ids, positions, torch.zeros(B + 1, T, 64))


# ----------------------------------------------------------------------------------------------- forward-only arguments


@pytest.mark.parametrize("depth", [2, -1, 100])
def test_depth_out_of_range(model, inputs, depth):
    with pytest.raises(ArgumentError, match=rf"depth {depth} out of range: this model has 2 MTP depth\(s\)"):
        model(*inputs, depth=depth)


def test_both_ids_and_embeds(model, inputs):
    ids, positions, hidden = inputs
    with pytest.raises(ArgumentError, match="pass exactly one of input_ids and inputs_embeds"):
        model(ids, positions, hidden, inputs_embeds=hidden)


def test_neither_ids_nor_embeds(model, inputs):
    _, positions, hidden = inputs
    with pytest.raises(ArgumentError, match="pass exactly one of input_ids and inputs_embeds"):
        model(None, positions, hidden)


def test_inputs_embeds_checked(model, inputs):
    _, positions, hidden = inputs
    model(None, positions, hidden, inputs_embeds=hidden)
    with pytest.raises(ArgumentError, match=r"inputs_embeds has shape \(2, 3, 32\), expected \(2, 3, 64\)"):
        model(None, positions, hidden, inputs_embeds=hidden[..., :32])
    with pytest.raises(ArgumentError,
                       match=r"inputs_embeds has dtype torch\.float64, the model runs in torch\.float32"):
        model(None, positions, hidden, inputs_embeds=hidden.double())


def test_cache_of_another_dtype(model, inputs):
    cache = random_mtp(dtype=torch.bfloat16).new_cache(B, MAX_LEN)
    with pytest.raises(ArgumentError, match=r"cache is torch\.bfloat16 on cpu, the model torch\.float32 on cpu"):
        model(*inputs, cache=cache)


def test_cache_with_other_depth_count(model, inputs):
    from tests.helpers import tiny_text_config

    cache = random_mtp(tiny_text_config(num_mtp_layers=1)).new_cache(B, MAX_LEN)
    with pytest.raises(ArgumentError, match=r"cache has 1 depth\(s\), the model 2"):
        model(*inputs, cache=cache)


# ------------------------------------------------------------------------------------------------ nothing written


def test_refused_call_leaves_the_cache_untouched(model, drafter, inputs):
    ids, positions, hidden = inputs
    bad = ids.clone()
    bad[0, 0] = 256
    cache = model.new_cache(B, MAX_LEN)
    with pytest.raises(ArgumentError):
        model(bad, positions, hidden, cache=cache)
    with pytest.raises(ArgumentError):
        drafter.draft(bad, positions, hidden)
    for c in (cache, drafter.cache):
        assert not any(t.any() for d in c.depths for t in d.tensors())


# ------------------------------------------------------------------------------------------------ hostile arguments


@BOTH
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_hidden_in_a_real_row(kind, model, drafter, inputs, value):
    ids, positions, hidden = inputs
    hidden = hidden.clone()
    hidden[1, 2, 5] = value
    with pytest.raises(ArgumentError, match=r"previous_hidden holds a NaN or inf at sequence 1, row 2 \(position 2\): "
                                         r"the inputs of real rows must be finite"):
        _run(kind, model, drafter, ids, positions, hidden)


def test_non_finite_inputs_embeds_in_a_real_row(model, inputs):
    _, positions, hidden = inputs
    embeds = hidden.clone()
    embeds[0, 1, 0] = float("nan")
    with pytest.raises(ArgumentError, match=r"inputs_embeds holds a NaN or inf at sequence 0, row 1 \(position 1\)"):
        model(None, positions, hidden, inputs_embeds=embeds)


@BOTH
def test_non_finite_hidden_in_padding_rows_is_accepted(kind, model, drafter, inputs):
    ids, positions, hidden = inputs
    positions, hidden = positions.clone(), hidden.clone()
    positions[0, -1] = -1 if kind == "drafter" else MAX_LEN  # each entry point's padding convention
    hidden[0, -1] = float("nan")
    out = _run(kind, model, drafter, ids, positions, hidden)
    assert torch.isfinite(out.hidden if kind == "drafter" else out[1]).all()


@pytest.mark.parametrize("depth", [True, False, 1.0, torch.tensor(1), "0", None])
def test_depth_must_be_an_int(model, inputs, depth):
    with pytest.raises(ArgumentError, match=r"depth must be an int in \[0, 2\), got " + re.escape(repr(depth))):
        model(*inputs, depth=depth)


@BOTH
def test_right_padded_and_gapped_positions(kind, model, drafter, inputs):
    """Padding may sit anywhere, but a sequence's real rows must still be consecutive positions."""
    ids, positions, hidden = inputs
    pad = -1 if kind == "drafter" else MAX_LEN
    _run(kind, model, drafter, ids, torch.tensor([[0, pad, 1], [0, 1, pad]]), hidden)
    with pytest.raises(ArgumentError, match=r"sequence 0: positions \[4, 6\] are not consecutive"):
        _run(kind, model, drafter, ids, torch.tensor([[4, pad, 6], [2, 3, pad]]), hidden)
    with pytest.raises(ArgumentError, match=r"sequence 1: positions \[3, 2\] are not consecutive"):
        _run(kind, model, drafter, ids, torch.tensor([[0, 1, 2], [pad, 3, 2]]), hidden)


def test_positions_without_a_cache_are_consecutive_too(model, inputs):
    """The short convolutions read the rows as consecutive positions: repeated, reversed or gapped positions gave
    other hidden states without an error when no cache was given."""
    ids, _, hidden = inputs
    for bad in ([[0, 0, 1], [0, 1, 2]], [[2, 1, 0], [0, 1, 2]], [[0, 1, 2], [0, 2, 3]]):
        row = 0 if bad[0] != [0, 1, 2] else 1
        with pytest.raises(ArgumentError, match=rf"sequence {row}: positions {re.escape(str(bad[row]))} are not "
                                                r"consecutive; the real rows of a sequence are consecutive positions$"):
            model(ids, torch.tensor(bad), hidden)


def test_a_sequence_without_real_rows_has_nothing_to_draft_from(model, drafter, inputs):
    ids, positions, hidden = inputs
    positions = positions.clone()
    positions[1] = -1
    with pytest.raises(ArgumentError, match=r"sequence 1 has no real row \(all its positions are negative\): nothing "
                                         r"to draft from"):
        drafter.draft(ids, positions, hidden)
    positions[1] = MAX_LEN  # the forward's padding convention: an all-padding sequence is fine there
    model(ids, positions, hidden, cache=model.new_cache(B, MAX_LEN))


def test_cache_must_be_an_mtp_cache(model, inputs):
    with pytest.raises(ArgumentError, match=r"cache must be an MTPCache \(from new_cache\), got dict"):
        model(*inputs, cache={})


def test_cache_of_another_geometry(model, inputs):
    from tests.helpers import tiny_text_config

    other = random_mtp(tiny_text_config(head_dim=8)).new_cache(B, MAX_LEN)
    with pytest.raises(ArgumentError, match=r"cache depth 1 holds \(kv heads, head dim, hidden\) \(2, 8, 64\), the "
                                         r"model's depth 1 needs \(2, 16, 64\): the cache was built for another model"):
        model(*inputs, cache=other)


@pytest.mark.parametrize("field", ["batch_size", "max_length"])
@pytest.mark.parametrize("value", [0, -2, True, 2.0, "4", None])
def test_cache_sizes_must_be_positive_ints(model, field, value):
    sizes = dict(batch_size=B, max_length=MAX_LEN)
    sizes[field] = value
    with pytest.raises(ArgumentError, match=rf"{field} must be an int >= 1, got " + re.escape(repr(value))):
        model.new_cache(**sizes)


def test_cache_sizes_accept_integer_like_values(model):
    import numpy as np

    cache = model.new_cache(np.int64(2), torch.tensor(8))
    assert (cache.batch_size, cache.max_length) == (2, 8) and type(cache.max_length) is int


@pytest.mark.parametrize("temperature", [True, "0.5", None, torch.tensor(0.5)])
def test_drafter_temperature_must_be_a_number(drafter, inputs, temperature):
    with pytest.raises(ArgumentError, match=r"temperature must be 0 \(greedy\) or a finite number >= 1e-06"):
        drafter.draft(*inputs, temperature=temperature)


@pytest.mark.parametrize("generator", [0, "cpu", torch.device("cpu")])
def test_drafter_generator_must_be_a_generator(drafter, inputs, generator):
    with pytest.raises(ArgumentError, match=r"generator must be a torch\.Generator \(or None\), got"):
        drafter.draft(*inputs, temperature=0.5, generator=generator)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_drafter_generator_on_another_device():
    model = random_mtp().cuda()
    drafter = Drafter(model, max_batch_size=1, max_length=MAX_LEN, compile=False, num_speculative_tokens=1)
    ids, positions = torch.zeros(1, 1, dtype=torch.long, device="cuda"), torch.zeros(1, 1, dtype=torch.long,
                                                                                     device="cuda")
    with pytest.raises(ArgumentError, match=r"generator is on cpu, the model on cuda:0"):
        drafter.draft(ids, positions, torch.zeros(1, 1, 64, device="cuda"), temperature=0.5,
                      generator=torch.Generator())


def test_a_drafter_whose_model_moved_after_construction(inputs):
    model = random_mtp()
    drafter = Drafter(model, max_batch_size=B, max_length=MAX_LEN, compile=False, num_speculative_tokens=1)
    model.to(torch.bfloat16)
    ids, positions, hidden = inputs
    with pytest.raises(ValueError, match=r"the model is now torch\.bfloat16 on cpu, but this Drafter was built for "
                                         r"it as torch\.float32 on cpu: build a new Drafter after moving the model"):
        drafter.draft(ids, positions, hidden.bfloat16())


@pytest.mark.parametrize("layout", ["expanded", "transposed"])
def test_non_contiguous_and_expanded_inputs(model, drafter, inputs, layout):
    ids, positions, hidden = inputs
    if layout == "expanded":  # one sequence broadcast over the batch (stride 0)
        ids, positions, hidden = ids[:1].expand(B, T), positions[:1].expand(B, T), hidden[:1].expand(B, T, 64)
    else:
        ids, hidden = ids.t().contiguous().t(), hidden.transpose(0, 1).contiguous().transpose(0, 1)
    assert not hidden.is_contiguous()
    cache = model.new_cache(B, MAX_LEN)
    got = model(ids, positions, hidden, cache=cache)
    assert torch.equal(got, model(ids.contiguous(), positions.contiguous(), hidden.contiguous(),
                                  cache=model.new_cache(B, MAX_LEN)))
    assert torch.equal(drafter.draft(ids, positions, hidden).tokens, model.get_top_tokens(got[:, -1]))
