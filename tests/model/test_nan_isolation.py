"""NaN isolation: a cache slot that no real row may see contributes exactly nothing, whatever it holds.

A non-finite row written and then overwritten, sitting in padding, or sitting at a later position that is re-run
(the free rollback) must leave every later output of the real rows finite and bit-identical to a clean run, on
sliding and full depths, and through a reused Drafter (eager and compiled). Rows are written through
``forward_unchecked``: the validated forward refuses non-finite inputs in real rows.
"""

import pytest
import torch

from inkling_compiled.runtime import Drafter
from tests.helpers import random_mtp, tiny_text_config

T, MAX_LEN = 22, 32
DEPTHS = pytest.mark.parametrize("depth", [0, 1], ids=["sliding", "full"])


def sequence(batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 250, (batch, T), generator=gen), torch.arange(T)[None].expand(batch, T).contiguous(),
            torch.randn(batch, T, 64, generator=gen))


def run(model, cache, depth, ids, pos, hidden, columns):
    return model.forward_unchecked(ids[:, columns], pos[:, columns], hidden[:, columns], cache=cache, depth=depth)


def same_real_rows(model, depth, caches, ids, positions, hiddens):
    """One call on the clean and on the poisoned cache: the real rows' outputs are finite and bit-identical."""
    want, got = (model.forward_unchecked(ids, positions, h, cache=c, depth=depth) for c, h in zip(caches, hiddens))
    real = positions != caches[0].pad_position
    return bool(torch.isfinite(got[real]).all()) and torch.equal(got[real], want[real])


def poisoned(hidden, rows):
    """``hidden`` with NaN in the first and inf in the other ``rows`` columns (both kinds of non-finite)."""
    bad = hidden.clone()
    bad[:, rows[0]] = float("nan")
    bad[:, rows[1:]] = float("inf")
    return bad


@DEPTHS
@torch.no_grad()
def test_rejected_non_finite_rows_at_later_positions_leave_no_trace(depth):
    """Rows 10..13 written with NaN/inf at 12 and 13 (a rejected draft chain), then 10..11 re-run while 12, 13 still
    hold them (future slots; the call is right-padded so that a sliding window reaches them too), then 12.. re-run
    (overwritten): every real output equals the clean run's, bit for bit."""
    model = random_mtp()
    ids, pos, hidden = sequence()
    caches = model.new_cache(2, MAX_LEN), model.new_cache(2, MAX_LEN)
    for c in caches:
        run(model, c, depth, ids, pos, hidden, slice(0, 10))
    run(model, caches[1], depth, ids, pos, poisoned(hidden, [12, 13]), slice(10, 14))
    P = caches[0].pad_position
    rerun = torch.tensor([[10, 11, P, P]] * 2)
    assert same_real_rows(model, depth, caches, ids[:, 10:14], rerun, [hidden[:, 10:14]] * 2)
    for columns in (slice(12, 13), slice(13, T)):
        assert same_real_rows(model, depth, caches, ids[:, columns], pos[:, columns], [hidden[:, columns]] * 2)


@DEPTHS
@torch.no_grad()
def test_non_finite_padding_rows_leave_no_trace(depth):
    """Padding rows (at cache.pad_position, left and right of the real rows) holding NaN/inf, in the same calls as
    real rows: the real rows' outputs equal those of a run whose padding rows hold zeros."""
    model = random_mtp()
    ids, _, hidden = sequence()
    clean, cache = model.new_cache(2, MAX_LEN), model.new_cache(2, MAX_LEN)
    P = cache.pad_position
    calls = [(slice(0, 10), [list(range(10)), [0, 1, 2, 3, 4, 5, P, P, P, P]]),
             (slice(10, 13), [[10, 11, P], [P, 6, 7]]),
             (slice(13, 22), [list(range(12, 21)), [8, 9] + [P] * 7])]
    for columns, positions in calls:
        positions = torch.tensor(positions)
        padding = (positions == P)[..., None]
        bad = hidden[:, columns].masked_fill(padding, float("nan"))
        bad[0, -1] = float("inf") if positions[0, -1] == P else bad[0, -1]
        clean_hidden = hidden[:, columns].masked_fill(padding, 0.0)
        assert same_real_rows(model, depth, (clean, cache), ids[:, columns], positions, [clean_hidden, bad]), columns


@DEPTHS
@torch.no_grad()
def test_slots_holding_anything_beyond_the_written_rows_are_ignored(depth):
    """Every slot a real row may not see (later positions, the scratch slot, unused cache sequences) set to NaN."""
    model = random_mtp()
    ids, pos, hidden = sequence()
    clean, cache = model.new_cache(2, MAX_LEN), model.new_cache(3, MAX_LEN)
    for c in (clean, cache):
        run(model, c, depth, ids, pos, hidden, slice(0, 10))
    for d in cache.depths:
        for t in d.tensors():
            t[:, 10:] = float("nan")
            t[2] = float("nan")
    P = cache.pad_position
    calls = [(slice(10, 13), [[10, P, P], [10, 11, P]]), (slice(13, 14), [[11], [12]]),
             (slice(14, 22), [list(range(12, 20)), list(range(13, 21))])]
    for columns, positions in calls:
        positions = torch.tensor(positions)
        assert same_real_rows(model, depth, (clean, cache), ids[:, columns], positions, [hidden[:, columns]] * 2)


@pytest.mark.parametrize("compile,first_depth", [(False, "sliding"), (False, "full"), (True, "full")])
@torch.no_grad()
def test_a_reused_drafter_inherits_nothing(compile, first_depth):
    """A Drafter whose first sequences had NaN/inf rows drafts the next ones exactly like a fresh one: the stale
    non-finite slots sit at later positions of the new sequences, and their own padding holds NaN too."""
    local = [0] if first_depth == "sliding" else [1]
    model = random_mtp(tiny_text_config(mtp_local_layer_ids=local))
    ids, pos, hidden = sequence()
    used = Drafter(model, max_batch_size=2, max_length=MAX_LEN, compile=compile, batch_buckets=(2,),
                   num_speculative_tokens=1)
    fresh = Drafter(model, max_batch_size=2, max_length=MAX_LEN, compile=compile, batch_buckets=(2,),
                    num_speculative_tokens=1)
    used.draft(ids[:, :16], pos[:, :16], poisoned(hidden[:, :16], [9, 14, 15]), validate=False)
    # new sequences: 6 real rows, right-padded to 16 (NaN in the padding), then one-row steps
    prompt = pos[:, :16].masked_fill(pos[:, :16] >= 6, -1)
    prompt_hidden = hidden[:, :16].masked_fill(prompt[..., None] < 0, float("nan"))
    results = []
    for drafter in (used, fresh):
        steps = [drafter.draft(ids[:, :16], prompt, prompt_hidden)]
        steps += [drafter.draft(ids[:, t:t + 1], pos[:, t:t + 1], hidden[:, t:t + 1]) for t in (6, 7, 8)]
        results.append(steps)
    for got, want in zip(*results):
        assert torch.isfinite(got.hidden).all()
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.hidden, want.hidden)
