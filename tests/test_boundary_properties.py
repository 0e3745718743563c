"""Property-based sweeps of the public boundaries: over every torch dtype, small shapes and hostile values,
``InklingMTP.forward`` and ``Drafter.draft`` either give the answer of the same call in int64, or raise a ValueError
naming the argument; over arbitrary Python values, every scalar argument of ``speculative_generate`` is accepted or
refused by name before any model call. Never an error from inside torch.

Eager, tiny model, derandomized (the same examples on every run), a few seconds in all.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inkling_compiled.runtime import Drafter, speculative
from inkling_compiled.runtime.speculative import speculative_generate
from tests.helpers import random_mtp
from tests.runtime.test_speculative import StandInDrafter, make_target

pytestmark = pytest.mark.floor  # make test-floor: exercises a dependency (hypothesis) at its lowest version
SWEEP = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.complex64]
INTEGER = {torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64}
ARGUMENT_NAMES = ("input_ids", "positions", "previous_hidden", "token id", "position ", "sequence ")

MODEL = random_mtp()  # H 64, vocab 256, 2 depths
B, T, MAX_LEN = 2, 3, 8


def _tensor(values: list[int], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``values`` cast the way a user's tensor would hold them (wrapping where the dtype is narrow)."""
    numel = math.prod(shape)
    data = torch.tensor((values * numel)[:numel] if values else [0] * numel, dtype=torch.long).reshape(shape)
    return data.to(dtype)


rows = st.fixed_dictionaries({
    "ids_dtype": st.sampled_from(DTYPES), "pos_dtype": st.sampled_from(DTYPES),
    "ids_shape": st.sampled_from([(B, T), (B, T), (B,), (B, T, 1), (0, T), (B, 0), (1, T)]),
    "pos_shape": st.sampled_from([(B, T), (B, T), (T,), (B, T + 1)]),
    "ids": st.lists(st.integers(-300, 600), max_size=6),
    "start": st.integers(-3, MAX_LEN + 2),
    "cached": st.booleans(),
})


@SWEEP
@given(case=rows)
def test_forward_answers_as_int64_or_names_the_argument(case):
    ids = _tensor(case["ids"], case["ids_shape"], case["ids_dtype"])
    positions = (torch.arange(math.prod(case["pos_shape"])).reshape(case["pos_shape"]) % T + case["start"]).to(
        case["pos_dtype"])
    hidden = torch.randn(B, T, MODEL.config.hidden_size, generator=torch.Generator().manual_seed(0))
    cache = MODEL.new_cache(B, MAX_LEN) if case["cached"] else None
    try:
        got = MODEL(ids, positions, hidden, cache=cache)
    except ValueError as e:
        assert any(name in str(e) for name in ARGUMENT_NAMES), str(e)
        return
    assert case["ids_dtype"] in INTEGER and case["pos_dtype"] in INTEGER  # nothing else may pass
    expected = MODEL(ids.long(), positions.long(), hidden, cache=MODEL.new_cache(B, MAX_LEN) if cache else None)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@SWEEP
@given(case=rows)
def test_draft_answers_as_int64_or_names_the_argument(case):
    drafter = Drafter(MODEL, B, MAX_LEN, compile=False, num_speculative_tokens=2)
    ids = _tensor(case["ids"], case["ids_shape"], case["ids_dtype"])
    positions = (torch.arange(math.prod(case["pos_shape"])).reshape(case["pos_shape"]) % T + case["start"]).to(
        case["pos_dtype"])
    hidden = torch.randn(B, T, MODEL.config.hidden_size, generator=torch.Generator().manual_seed(0))
    try:
        got = drafter.draft(ids, positions, hidden).drafts
    except ValueError as e:
        assert any(name in str(e) for name in ARGUMENT_NAMES), str(e)
        return
    reference = Drafter(MODEL, B, MAX_LEN, compile=False, num_speculative_tokens=2)
    assert torch.equal(got, reference.draft(ids.long(), positions.long(), hidden).drafts)


# ------------------------------------------------------------------------------------------------ the loop's scalars

hostile = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.floats(min_value=0, max_value=1e-5), st.text(max_size=3), st.lists(st.integers(-3, 200),
                                                                                          max_size=3))
SCALARS = {"max_new_tokens": 3, "temperature": 0.0, "top_p": 1.0, "eos_token_id": None, "pad_token_id": None,
           "lockstep": False}


class _Reached(Exception):
    """speculative_generate handed its arguments to the loop: every one was accepted (the loop itself is not run: a
    stand-in drafter of max_length 2**80 takes any max_new_tokens, whose output buffer the loop would allocate)."""


def _reached(*args, **kwargs):
    raise _Reached


@pytest.fixture(scope="module")
def target():
    return make_target()  # vocab 128


@settings(SWEEP, max_examples=150, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(SCALARS)), value=hostile)
def test_every_scalar_of_the_loop_is_accepted_or_refused_by_name(target, monkeypatch, name, value):
    monkeypatch.setattr(speculative, "run_loop", _reached)
    drafter = StandInDrafter(128, max_batch_size=2, max_length=2**80)
    kwargs = {**SCALARS, name: value}
    try:
        speculative_generate(target, drafter, torch.randint(1, 100, (1, 4)), **kwargs)
    except _Reached:
        return
    except ValueError as e:
        assert re.match(rf"^(each of )?{name} must be", str(e)), str(e)
        return
    pytest.fail(f"{name}={value!r} neither accepted nor refused")


@pytest.mark.parametrize("name", ["max_new_tokens", "eos_token_id", "pad_token_id"])
@pytest.mark.parametrize("value", [torch.tensor(3.0), torch.tensor([[1, 2]]), np.array([1, 2]), np.array(2.5)],
                         ids=repr)
def test_array_likes_that_are_no_integer_are_refused_by_name(target, monkeypatch, name, value):
    """They have ``__index__`` and raise in it: a TypeError that named no argument."""
    monkeypatch.setattr(speculative, "_target_step", lambda *args, **kwargs: pytest.fail("target called"))
    with pytest.raises(ValueError, match=rf"^(each of )?{name} must be"):
        speculative_generate(target, StandInDrafter(128), torch.randint(1, 100, (1, 4)), **{**SCALARS, name: value})


@pytest.mark.parametrize("name, value", [("temperature", np.float32(0.5)), ("top_p", np.float32(0.9)),
                                         ("max_new_tokens", np.int64(3))], ids=repr)
def test_numpy_scalars_are_accepted_like_python_numbers(target, monkeypatch, name, value):
    monkeypatch.setattr(speculative, "run_loop", _reached)
    with pytest.raises(_Reached):
        speculative_generate(target, StandInDrafter(128), torch.randint(1, 100, (1, 4)), **{**SCALARS, name: value})
