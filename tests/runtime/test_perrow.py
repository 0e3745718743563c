"""Per-row acceptance (docs/protocol.md §6.9): every row of a batch advances by its own accepted length, lossless, and
the target cache rolled back per row equals running each row alone, conv states and sliding layers included.

Scripted drafters (the stand-ins of ``test_speculative*``) decide per row: row 0 always proposes the target's own
greedy tokens, row 1 never does, the other rows are right at some positions only; the tiny target has a sliding
window of 8, which the prompts and continuations cross.
"""

from __future__ import annotations

import random

import pytest
import torch

from inkling_compiled.runtime import speculative, target_cache
from inkling_compiled.runtime.speculative import speculative_generate
from tests.runtime.test_speculative import left_pad, make_target, oracle_from, random_prompts
from tests.runtime.test_speculative_depths import KStandInDrafter, check_statistics

pytestmark = pytest.mark.floor  # make test-floor: exercises a dependency at its lowest version


def per_row_wrong(b, p):
    """Row 0: every draft right; row 1: every draft wrong; others: wrong at a row-dependent share of positions."""
    return b == 1 or (b > 1 and (3 * p + 5 * b) % (b + 3) == 0)


def _run(target, k, prompts, max_new, lockstep=False, wrong=per_row_wrong):
    ids, mask = left_pad(prompts)
    reference = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new)
    drafter = KStandInDrafter(k, 120, max_length=96, oracle=oracle_from(reference, mask), wrong=wrong)
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=max_new, lockstep=lockstep)
    assert torch.equal(out.sequences, reference), (k, len(prompts), lockstep)
    assert drafter.check_rows(out.sequences, mask, target) > 0
    check_statistics(out, k, ids.shape[1], len(prompts), lockstep=lockstep)
    return out


@pytest.mark.parametrize("k", [1, 3])
def test_rows_advance_by_their_own_accepted_length_and_match_generate(target, k):
    rng = random.Random(30 + k)
    for batch in (2, 3, 5, 8):
        prompts = random_prompts(rng, batch, 1, 18)
        out = _run(target, k, prompts, 20)
        first = out.accepted_per_position_per_round[0]
        # row 0 accepted all K drafts and row 1 none: the round emitted K + 1 and 1 tokens for them
        assert first[-1] >= 1 and first[0] < batch and out.emitted_per_round[0] == batch + out.accepted_per_round[0]
        # lockstep would hold every row to row 1's single token per round
        lockstep = _run(target, k, prompts, 20, lockstep=True)
        assert lockstep.mean_accepted_length == 1.0 < out.mean_accepted_length
        # row 1 sets the number of rounds either way; per row, the rows that are done stop drafting meanwhile
        assert out.num_rounds == lockstep.num_rounds == 19 and out.num_drafted < lockstep.num_drafted
    # finished rows drop out: once row 0 is done, later rounds draft for the others only
    assert out.drafted_per_round[-1] < out.drafted_per_round[0]


def snapshot(cache) -> list[tuple[bool, list[torch.Tensor]]]:
    """Per layer: (sliding?, [keys, values, conv states...]) cloned."""
    return [(layer.is_sliding, [t.clone() for t in (layer.keys, layer.values, *(layer.conv_states[i] for i in
                                                                               sorted(layer.conv_states)))])
            for layer in cache.layers]


def row_states(layers, row: int, real: torch.Tensor | None) -> list[torch.Tensor]:
    """One row's states: a full layer's slots where ``real`` [N] (all of them for None), a sliding layer's working
    slots, every conv state."""
    states = []
    for sliding, (keys, values, *convs) in layers:
        keys, values = keys[row], values[row]
        if real is not None and not sliding:
            keys, values = keys[:, real], values[:, real]
        states += [keys, values, *(conv[row] for conv in convs)]
    return states


@pytest.fixture(scope="module")
def dense_target():
    """The tiny target with dense MLPs: its batched and single-row forwards differ only by GEMM rounding (a MoE layer
    groups a batch's tokens per expert, which adds its own)."""
    return make_target(mlp=("dense", "dense"))


@pytest.mark.parametrize("k", [1, 3])
def test_each_rows_cache_equals_running_that_row_alone(dense_target, monkeypatch, k):
    """After every round, ragged ones included (rows kept different numbers of tokens), each row's target cache —
    full layers' real slots, sliding layers' working window, the four conv states of every layer — equals the cache
    of the same row run alone with the same drafts (its rounds are the same ones, per row), fp32, within 1e-5 of each
    state tensor's own scale (max |value|, at least 1): the rounding difference between a batched and a single-row
    GEMM grows with the magnitudes summed. Conv inputs reach ~15, where float32's ulp is ~1e-6, and an AVX-512
    machine's GEMMs were seen 1.1e-6 of that scale apart (11 ulps); a wrong slot is off by O(1)."""
    target = dense_target
    snapshots, alive = [], []  # alive: the batch rows the target cache holds, in its order
    original_rollback, original_select = target_cache.rollback_rows, target_cache.select_rows

    def rollback(cache, attention_mask, rejected):
        mask = original_rollback(cache, attention_mask, rejected)
        snapshots.append((len(set(rejected)) > 1, mask.clone(), snapshot(cache), alive[:]))
        return mask

    def select(cache, index):  # finished rows drop out of the target's batch
        original_select(cache, index)
        alive[:] = [alive[i] for i in index.tolist()]

    monkeypatch.setattr(speculative, "rollback_rows", rollback)
    monkeypatch.setattr(speculative, "select_rows", select)
    prompts = [list(range(10, 21)), list(range(30, 44)), list(range(50, 59)), list(range(60, 77))]  # > the window 8
    alive[:] = range(len(prompts))
    _run(target, k, prompts, 16)
    batched = snapshots[:]
    assert sum(ragged for ragged, *_ in batched) >= 2 and len(batched[-1][-1]) < len(prompts)  # rows dropped out
    compared = 0
    for b, prompt in enumerate(prompts):
        snapshots.clear()
        alive[:] = [0]
        _run(target, k, [prompt], 16, wrong=lambda _, p, b=b: per_row_wrong(b, p))
        assert snapshots and len(snapshots) <= len(batched)
        for (_, mask, layers, rows), (_, _, alone, _) in zip(batched, snapshots):  # the rounds the row went on
            row = rows.index(b)
            got, want = row_states(layers, row, mask[row].bool()), row_states(alone, 0, None)
            assert [t.shape for t in got] == [t.shape for t in want]
            for ours, expected in zip(got, want):
                scale = max(1.0, expected.abs().max().item())
                torch.testing.assert_close(ours, expected, atol=1e-5 * scale, rtol=0)
            compared += 1
    assert compared >= 2 * len(prompts)


def test_masking_rejected_slots_in_place_is_not_enough(target, monkeypatch):
    """Why the rollback rolls: leaving each row's extra rejected slots in place as masked holes (conv states still
    gathered per row) puts the row's earlier tokens one storage slot further from every later query, which
    Inkling's relative bias and window read; the output then leaves the target's greedy continuation."""
    original = target_cache.rollback_rows

    def holes(cache, attention_mask, rejected):
        original(_ConvOnly(cache), attention_mask, rejected)  # conv states per row, as the real rollback does
        conv_states = [layer.conv_states for layer in cache.layers]
        for layer in cache.layers:
            layer.conv_states = {}
        common = min(rejected)
        mask = original(cache, attention_mask, [common] * len(rejected))  # K/V: the batch-wide crop only
        for layer, states in zip(cache.layers, conv_states):
            layer.conv_states = states
        extra = torch.tensor(rejected)[:, None] - common  # each row's rejected slots left in place, masked
        return mask.masked_fill(torch.arange(mask.shape[1])[None, :] >= mask.shape[1] - extra, 0)

    prompts = [list(range(10, 21)), list(range(30, 44)), list(range(50, 59))]
    ids, mask = left_pad(prompts)
    reference = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    monkeypatch.setattr(speculative, "rollback_rows", holes)
    drafter = KStandInDrafter(3, 120, max_length=96, oracle=oracle_from(reference, mask), wrong=per_row_wrong)
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=16)
    assert not torch.equal(out.sequences, reference)


class _ConvOnly:
    """A cache's conv states alone (the same dicts), so that a rollback of it touches nothing else."""

    def __init__(self, cache):
        self.layers = [type("ConvStates", (), {"conv_states": layer.conv_states,
                                              "conv_kernel_size": layer.conv_kernel_size})() for layer in cache.layers]


@pytest.fixture(scope="module")
def log_scaled_target():
    """The tiny target with full layers' log scaling from position 4 on (``log_scaling_n_floor``), strong enough
    that the query's storage index changes the greedy tokens."""
    target = make_target(mlp=("dense", "dense"), seed=1)
    target.config.log_scaling_n_floor, target.config.log_scaling_alpha = 4, 2.0
    return target


def test_log_scaling_keeps_lockstep_and_stays_lossless(log_scaled_target, monkeypatch):
    """Log scaling reads the query's storage index, which the slots a per-row rollback shifts in would move: with
    a floor the storage can reach, the loop keeps lockstep and still gives ``generate``'s tokens; rolling anyway
    would not."""
    prompts = [list(range(10, 21)), list(range(30, 34)), list(range(50, 59))]
    out = _run(log_scaled_target, 3, prompts, 16, lockstep=True)
    ids, mask = left_pad(prompts)
    reference = log_scaled_target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    drafter = KStandInDrafter(3, 120, max_length=96, oracle=oracle_from(reference, mask), wrong=per_row_wrong)
    assert torch.equal(speculative_generate(log_scaled_target, drafter, ids, mask, max_new_tokens=16).sequences,
                       out.sequences)
    monkeypatch.setattr(speculative, "_storage_may_reach_log_scaling", lambda *args: False)
    drafter = KStandInDrafter(3, 120, max_length=96, oracle=oracle_from(reference, mask), wrong=per_row_wrong)
    rolled = speculative_generate(log_scaled_target, drafter, ids, mask, max_new_tokens=16)
    assert not torch.equal(rolled.sequences, reference)
