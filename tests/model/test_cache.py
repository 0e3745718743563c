"""Position-addressed caches: incremental == full-sequence for every depth type, free rollback, padding rows."""

import pytest
import torch

from inkling_compiled.arguments import ArgumentError
from tests.helpers import random_mtp

T = 22  # longer than the sliding window (8) and the full depth's bias extent (16)


def sequence(batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (batch, T), generator=gen), torch.arange(T)[None].expand(batch, T),
            torch.randn(batch, T, 64, generator=gen))


@pytest.mark.parametrize("depth", [0, 1], ids=["sliding", "full"])
@pytest.mark.parametrize("chunks", [[T], [5, 1, 1, 1, 14], [1] * T, [9, 2, 11]])
@torch.no_grad()
def test_incremental_equals_full(depth, chunks):
    model = random_mtp()
    ids, pos, hidden = sequence()
    full = model(ids, pos, hidden, depth=depth)
    cache = model.new_cache(batch_size=3, max_length=32)  # larger than needed: unused batch rows stay untouched
    outs, start = [], 0
    for n in chunks:
        sl = slice(start, start + n)
        outs.append(model(ids[:, sl], pos[:, sl], hidden[:, sl], cache=cache, depth=depth))
        start += n
    assert (torch.cat(outs, 1) - full).abs().max().item() < 1e-5


@torch.no_grad()
def test_rewriting_positions_is_a_free_rollback():
    """Draft rows computed with wrong tokens are simply recomputed: the result equals a clean run."""
    model = random_mtp()
    ids, pos, hidden = sequence()
    clean = model.new_cache(2, 32)
    for depth in (0, 1):
        model(ids[:, :12], pos[:, :12], hidden[:, :12], cache=clean, depth=depth)
    expected = [model(ids[:, 12:], pos[:, 12:], hidden[:, 12:], cache=clean, depth=d) for d in (0, 1)]

    cache = model.new_cache(2, 32)
    wrong = torch.randint(0, 256, ids.shape)
    for depth in (0, 1):
        model(ids[:, :9], pos[:, :9], hidden[:, :9], cache=cache, depth=depth)
        model(wrong[:, 9:15], pos[:, 9:15], -hidden[:, 9:15], cache=cache, depth=depth)  # rejected rows
        model(ids[:, 9:12], pos[:, 9:12], hidden[:, 9:12], cache=cache, depth=depth)  # re-run from position 9
    got = [model(ids[:, 12:], pos[:, 12:], hidden[:, 12:], cache=cache, depth=d) for d in (0, 1)]
    for g, e in zip(got, expected):
        assert (g - e).abs().max().item() < 1e-5


@torch.no_grad()
def test_padding_rows_and_ragged_positions():
    """Sequences at different positions share one call; rows at cache.pad_position are ignored."""
    model = random_mtp()
    ids, pos, hidden = sequence()
    cache = model.new_cache(2, 32)
    # prefill: sequence 0 fills positions 0..9, sequence 1 only 0..3 (its last six rows are padding)
    prefill_pos = pos[:, :10].clone()
    prefill_pos[1, 4:] = cache.pad_position
    model(ids[:, :10], prefill_pos, hidden[:, :10], cache=cache)
    step_ids = torch.stack([ids[0, 10:12], ids[1, 4:6]])
    step_pos = torch.tensor([[10, 11], [4, cache.pad_position]])  # sequence 1 has one real row and one pad row
    step_hidden = torch.stack([hidden[0, 10:12], hidden[1, 4:6]])
    out = model(step_ids, step_pos, step_hidden, cache=cache)
    full0 = model(ids[:1, :12], pos[:1, :12], hidden[:1, :12])
    full1 = model(ids[1:, :5], pos[1:, :5], hidden[1:, :5])
    assert (out[0] - full0[0, 10:12]).abs().max().item() < 1e-5
    assert (out[1, 0] - full1[0, 4]).abs().max().item() < 1e-5
    # the pad row left no trace: position 5 for sequence 1 continues exactly
    nxt = model(ids[:, 5:6], torch.tensor([[cache.pad_position], [5]]), hidden[:, 5:6], cache=cache)
    assert (nxt[1, 0] - model(ids[1:, :6], pos[1:, :6], hidden[1:, :6])[0, 5]).abs().max().item() < 1e-5


@torch.no_grad()
def test_bf16_close_to_fp32():
    ref = random_mtp()
    bf = random_mtp(dtype=torch.bfloat16)
    ids, pos, hidden = sequence()
    for depth in (0, 1):
        want = ref(ids, pos, hidden, depth=depth)
        got = bf(ids, pos, hidden.bfloat16(), depth=depth)
        assert got.dtype == torch.bfloat16
        # bf16 has 8 mantissa bits (rel. eps 2^-8 = 0.4 %); a whole block of rounded ops stays within a few eps
        rel = (got.float() - want).norm() / want.norm()
        assert rel < 0.02, rel
        logits_ref, logits = ref.compute_logits(want), bf.compute_logits(got)
        assert (logits.float() - logits_ref).abs().max() < 0.05 * logits_ref.abs().max()


@torch.no_grad()
def test_rows_of_a_sequence_must_be_consecutive():
    model = random_mtp()
    ids, pos, hidden = sequence()
    cache = model.new_cache(2, 32)
    with pytest.raises(ArgumentError, match=r"sequence 1: positions \[3, 5\] are not consecutive"):
        model(ids[:, :2], torch.tensor([[3, 4], [3, 5]]), hidden[:, :2], cache=cache)


@torch.no_grad()
def test_sliding_depth_reads_only_its_window():
    """A decode step of a sliding depth sees W + T - 1 key slots, not the whole cache (and still equals full)."""
    model = random_mtp()
    ids, pos, hidden = sequence(batch=1)
    cache = model.new_cache(1, 512)
    model(ids[:, :21], pos[:, :21], hidden[:, :21], cache=cache)
    k = torch.zeros(1, 1, 2, 32)
    keys, _, key_pos = cache.depths[0].write_kv(k, k, torch.tensor([[21]]), window=8)
    assert keys.shape[1] == 8 and key_pos.tolist() == [list(range(14, 22))]


def graph_nodes(t: torch.Tensor) -> int:
    """Autograd nodes reachable from ``t`` (what a backward would walk, and what keeps saved tensors alive)."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
    return len(seen)


def test_cached_forwards_without_no_grad_record_no_history():
    """As the README uses it (no torch.no_grad(), Parameters that require grad, e.g. the target's shared ones): the
    cache never records autograd history, so a step's graph does not grow with the steps before it."""
    model = random_mtp().requires_grad_(True)
    ids, pos, hidden = sequence(batch=1)
    cache = model.new_cache(1, 32)
    nodes = {0: set(), 1: set()}
    for t in range(T):
        for depth in (0, 1):
            out = model(ids[:, t:t + 1], pos[:, t:t + 1], hidden[:, t:t + 1], cache=cache, depth=depth)
            assert out.requires_grad  # the call itself is differentiable as usual
            nodes[depth].add(graph_nodes(out))
    assert len(nodes[0]) == len(nodes[1]) == 1, nodes  # the same graph size at every step
    for d in cache.depths:
        assert all(not t.requires_grad and t.grad_fn is None for t in d.tensors())


def test_a_cache_made_under_inference_mode_works_outside_it():
    """Its buffers are normal tensors: made as inference tensors, every later in-place write outside inference mode
    (a forward's slot writes, ``zero_()``) would be refused for good."""
    model = random_mtp()
    ids, pos, hidden = sequence()
    with torch.inference_mode():
        cache = model.new_cache(2, 32)
        inside = model(ids, pos, hidden, cache=cache)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, hidden, cache=cache.zero_()), inside)
