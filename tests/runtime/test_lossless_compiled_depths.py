"""End to end on CPU with K = 2, 3, 8 chained depths: speculative generation with the drafter (the tiny8 preset —
Inkling's eight MTP depths in its sliding / full pattern — self-distilled so that drafts are accepted) is
token-for-token identical to the target's own greedy generate, on 20 prompts per K: batch 1 and left-padded batches,
varied lengths, an EOS that stops some sequences mid-batch. K = 8 runs the session's compiled drafter
(``compiled_k8`` in tests/runtime/conftest.py, shared with test_drafter_depths.py: both geometries' steps and the
window prologue, one batch bucket, prompt lengths chosen so that the prefill windows are the decode ones: compile
time is what K = 8 costs in CI); K = 2 and 3 run the same round eagerly (the compiled steps are the same
per-geometry graphs at other window sizes; compiled against eager is tests/runtime/test_drafter_depths.py's K = 8
test, and K = 1 compiled is tests/runtime/test_lossless_compiled.py). Their time is the eager transformers target
(its generate and verification forwards), not the drafter."""

import pytest
import torch

from inkling_compiled.runtime import Drafter, speculative_generate
from inkling_compiled.training.distill import load_metrics

NEW_TOKENS = 14
MAX_PROMPT = {2: 3, 3: 4, 8: 9}  # prefill windows are decode windows: K = 2 -> 2, 3 rows; 3 -> 3, 4; 8 -> 8, 9
COMPILED = 8  # the session's compiled K = 8 drafter (tests/runtime/conftest.py)


def test_distillation_trains_every_depth(tiny8_distilled):
    """All eight depths learn, each on its own shifted targets (held-out teacher-forced top-1 agreement)."""
    metrics = load_metrics(tiny8_distilled)
    before, after = metrics["agreement_before"], metrics["agreement_after"]
    assert len(before) == len(after) == 8
    assert all(b < 0.05 < a for b, a in zip(before, after)), (before, after)


def prompts(batch, length, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, 500, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for b in range(1, batch):  # left padding: rows of different lengths
        pad = (b + seed) % length
        ids[b, :pad], mask[b, :pad] = 0, 0
    return ids, mask


@torch.no_grad()
@pytest.mark.parametrize("k", [2, 3, 8])
def test_k_depth_drafter_is_lossless(request, tiny8_target_and_mtp, k):
    target, mtp = tiny8_target_and_mtp
    if k == COMPILED:
        drafter = request.getfixturevalue("compiled_k8")[0]
    else:
        drafter = Drafter(mtp, max_batch_size=4, max_length=32, num_speculative_tokens=k, batch_buckets=(4,),
                          compile=False)
    longest = MAX_PROMPT[k]
    cases = [(1, 1 + s % longest, s) for s in range(16)] + [(b, longest, 100 + s) for s, b in enumerate((2, 3, 4, 4))]
    per_position, drafted, stopped_mid_batch = torch.zeros(k), 0, False
    for i, (batch, length, seed) in enumerate(cases):
        ids, mask = prompts(batch, length, seed)
        eos = None
        if i % 3 == 2:  # an EOS the target emits mid-continuation for the first sequence
            free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                                   pad_token_id=0)
            eos = int(free[0, ids.shape[1] + NEW_TOKENS // 2])
        expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                                   eos_token_id=eos, pad_token_id=0)
        ours = speculative_generate(target, drafter, ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                                    pad_token_id=0)
        assert torch.equal(ours.sequences, expected), (k, batch, length, seed)
        if eos is not None and batch > 1:
            ended = (ours.sequences[:, ids.shape[1]:] == eos).any(dim=1)
            stopped_mid_batch |= bool(ended.any() and not ended.all())
        if ours.num_rounds:
            rows = ours.num_drafted // k
            per_position += torch.tensor(ours.acceptance_per_position) * rows
            drafted += rows
    per_position /= drafted
    assert stopped_mid_batch
    # the distilled drafter is good enough that rounds stop at the first draft and go past it
    assert 0.1 < per_position[0] < 1 and per_position[1] > 0
