"""End to end on CPU: speculative generation with the *compiled* drafter (real InklingMTP, a self-distilled tiny
checkpoint so that drafts are often accepted) is token-for-token identical to the target's own greedy generate."""

import pytest
import torch

from inkling_compiled import InklingMTP
from inkling_compiled.runtime import Drafter, speculative_generate
from inkling_compiled.testing.synthetic import cached_checkpoint, load_hf_target
from inkling_compiled.training.distill import distill

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def setup():
    path = distill(cached_checkpoint("tiny"), steps=120, num_sequences=256, eval_sequences=16, progress=False)
    target = load_hf_target(path)
    target.generation_config.eos_token_id = None  # compare full-length continuations
    drafter = Drafter(InklingMTP.from_pretrained(path, target=target), max_batch_size=4, max_length=64,
                      batch_buckets=(4,), num_speculative_tokens=1)  # one batch bucket: batch 1..4 share graphs
    return target, drafter


def prompts(batch, length, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, 500, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for b in range(1, batch):  # left padding: rows of different lengths
        pad = (b * 3 + seed) % (length - 1)
        ids[b, :pad], mask[b, :pad] = 0, 0
    return ids, mask


@torch.no_grad()
def test_compiled_drafter_is_lossless(setup):
    target, drafter = setup
    accepted = drafted = 0
    cases = [(1, 3 + (s * 5) % 14, s) for s in range(16)] + [(b, 9 + s, 100 + s) for s, b in enumerate((2, 3, 4, 4))]
    for batch, length, seed in cases:  # 20 prompts of lengths 3..16, batch 1 and left-padded batches 2-4
        ids, mask = prompts(batch, length, seed)
        ours = speculative_generate(target, drafter, ids, mask, max_new_tokens=NEW_TOKENS)
        expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS)
        assert torch.equal(ours.sequences, expected), (batch, length, seed)
        accepted, drafted = accepted + ours.num_accepted, drafted + ours.num_drafted
    assert accepted > 0.1 * drafted  # the distilled drafter is good enough that both accept and reject paths ran
    assert accepted < drafted
