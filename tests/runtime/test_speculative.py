"""Speculative decoding loop (docs/protocol.md §6.1-6.4, §6.7): lossless greedy, sampling distribution, cache rollback,
bad input.

The target is a tiny random transformers ``InklingForCausalLM`` (fp32, eager attention, sliding window 8 so the
window is crossed); the drafter is a stand-in defined here that follows the ``Drafter.draft`` protocol, proposes the
target's own greedy token or a deliberately wrong one (greedy) or samples from a chosen q (sampling), and checks
every row it is fed against the final sequences.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from inkling_compiled import InklingMTP
from inkling_compiled.arguments import ArgumentError
from inkling_compiled.generate import main as generate_cli
from inkling_compiled.runtime import Drafter, speculative
from inkling_compiled.runtime.speculative import speculative_generate, target_distribution
from inkling_compiled.testing import synthetic
from tests.helpers import PAD, StandInDrafter, make_target, random_mtp, tiny_text_config

pytestmark = pytest.mark.floor  # make test-floor: exercises a dependency at its lowest version


def random_prompts(rng: random.Random, n, lo, hi, vocab=120):
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def left_pad(prompts):
    length = max(map(len, prompts))
    ids = torch.full((len(prompts), length), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, length - len(p):] = torch.tensor(p)
        mask[b, length - len(p):] = 1
    return ids, mask


def tokens_emitted(out, prompt_len, eos=None):
    """New tokens each row emitted: its columns up to and including its first EOS (the rest are padding)."""
    new = out.sequences[:, prompt_len:]
    if eos is None:
        return [new.shape[1]] * new.shape[0]
    hit = torch.isin(new, torch.tensor(eos if isinstance(eos, list) else [eos]))
    return [int(h.nonzero()[0]) + 1 if h.any() else new.shape[1] for h in hit]


def oracle_from(sequences, mask):
    """Per row: real position -> token of a (generate) output."""
    pad_left = (mask.shape[1] - mask.sum(1)).tolist()
    return [{c - pad_left[b]: tok for c, tok in enumerate(sequences[b].tolist()) if c >= pad_left[b]}
            for b in range(sequences.shape[0])]


def wrong_pattern(rate_mod):
    # deterministic, position-keyed: rejects ~2 of every `rate_mod` positions (0 = never, 1 = always)
    if rate_mod == 0:
        return lambda b, p: False
    if rate_mod == 1:
        return lambda b, p: True
    return lambda b, p: (3 * p + 5 * b) % rate_mod in (0, 2)


# --------------------------------------------------------------------------------------------------- greedy

def _greedy_case(target, prompts, max_new, rate_mod, eos=None, pad=None):
    ids, mask = left_pad(prompts)
    gen_kwargs = {} if eos is None else dict(eos_token_id=eos, pad_token_id=pad)
    reference = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, **gen_kwargs)
    drafter = StandInDrafter(120, oracle=oracle_from(reference, mask), wrong=wrong_pattern(rate_mod))
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=max_new, eos_token_id=eos,
                               pad_token_id=pad)
    assert torch.equal(out.sequences, reference), (out.sequences[:, ids.shape[1]:], reference[:, ids.shape[1]:])
    checked = drafter.check_rows(out.sequences, mask, target)
    assert checked > 0 or (out.num_new_tokens == 1 and not drafter.calls)  # done after the prefill: no drafting
    assert out.num_new_tokens == reference.shape[1] - ids.shape[1]
    assert sum(out.emitted_per_round) + len(prompts) == sum(tokens_emitted(out, ids.shape[1], eos))
    assert out.num_accepted == sum(out.accepted_per_round) <= out.num_drafted == sum(out.drafted_per_round)
    return out


def test_greedy_batch1_matches_generate(target):
    rng = random.Random(0)
    prompts = random_prompts(rng, 12, 1, 20)
    accepted = drafted = 0
    for i, prompt in enumerate(prompts):
        out = _greedy_case(target, [prompt], 18, rate_mod=[0, 1, 5, 7][i % 4])
        accepted += out.num_accepted
        drafted += out.num_drafted
        if i % 4 == 0:  # perfect drafts: all accepted, two tokens per verify round
            assert out.acceptance_rate == 1.0 and out.mean_accepted_length > 1.8
        if i % 4 == 1:  # always wrong: nothing accepted, one token per round
            assert out.num_accepted == 0 and out.mean_accepted_length == 1.0
    assert 0 < accepted < drafted


def test_greedy_left_padded_batches_match_generate(target):
    rng = random.Random(1)
    saw_partial = False
    for rate_mod in (0, 5, 7):
        prompts = random_prompts(rng, 4, 1, 16)
        out = _greedy_case(target, prompts, 16, rate_mod)
        # lockstep: a round with some (not all) rows accepting emits one column
        saw_partial |= any(0 < a < d for a, d in zip(out.accepted_per_round, out.drafted_per_round))
    assert saw_partial


def _first_eos_candidate(target, prompts, max_new):
    """A token that the target emits mid-continuation for the first prompt (so EOS really occurs)."""
    ids, mask = left_pad(prompts)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new)
    return ref[0, ids.shape[1] + max_new // 3].item()


def test_greedy_with_eos_matches_generate(target):
    rng = random.Random(2)
    prompts = random_prompts(rng, 4, 2, 12)
    eos = _first_eos_candidate(target, prompts, 15)
    out = _greedy_case(target, prompts, 15, rate_mod=7, eos=eos, pad=PAD)
    assert (out.sequences[:, -out.num_new_tokens:] == eos).any()
    out1 = _greedy_case(target, prompts[:1], 15, rate_mod=0, eos=eos, pad=PAD)  # batch 1 stops at EOS
    assert out1.sequences[0, -1].item() == eos and out1.num_new_tokens < 15
    first = out1.sequences[0, len(prompts[0])].item()  # EOS as the very first new token: stop after the prefill
    out2 = _greedy_case(target, prompts[:1], 15, rate_mod=0, eos=[first, eos], pad=PAD)
    assert out2.num_new_tokens == 1 and out2.num_rounds == 0


def test_max_new_tokens_one_and_exact_length(target):
    prompts = [[5, 6, 7], [8]]
    out = _greedy_case(target, prompts, 1, rate_mod=0)
    assert out.num_new_tokens == 1 and out.num_rounds == 0
    for n in (2, 3, 4):  # all accepted: never emit a bonus column past max_new_tokens
        assert _greedy_case(target, prompts, n, rate_mod=0).num_new_tokens == n


def test_logits_identical_to_target_forward(target):
    ids, mask = left_pad([[4, 5, 6, 7, 8, 9], [10, 11, 12]])
    ref = target(input_ids=ids, attention_mask=mask, cache=DynamicCache(config=target.config), use_cache=True)
    hidden, logits = speculative._target_step(target, ids, mask, DynamicCache(config=target.config),
                                              last_only=False)
    assert torch.equal(logits, ref.logits.float()) and logits.shape[-1] == 120
    _, last = speculative._target_step(target, ids, mask, DynamicCache(config=target.config), last_only=True)
    ref_last = target(input_ids=ids, attention_mask=mask, logits_to_keep=1)
    assert torch.equal(last, ref_last.logits.float())


# ------------------------------------------------------------------------------------------------ cache rollback

def test_cache_after_rejection_matches_fresh_recompute(target, monkeypatch):
    """Every verify forward (after per-row rollbacks of rejected rows, across the sliding window) equals, row by row,
    a no-cache forward of that row's committed tokens and window alone."""
    recorded = []
    original = speculative._target_step

    def spy(tgt, input_ids, attention_mask, cache, *, last_only, **kwargs):
        hidden, logits = original(tgt, input_ids, attention_mask, cache, last_only=last_only, **kwargs)
        if not last_only:
            recorded.append((input_ids.clone(), attention_mask.clone(), logits.clone()))
        return hidden, logits

    monkeypatch.setattr(speculative, "_target_step", spy)
    prompts = [[7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]
    ids, mask = left_pad(prompts)
    reference = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    drafter = StandInDrafter(120, oracle=oracle_from(reference, mask), wrong=wrong_pattern(5))
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=20)
    assert torch.equal(out.sequences, reference)
    # rounds where both rows rejected (2 tokens), one did (3: the rows now differ in length), both accepted (4)
    assert {2, 3, 4} <= set(out.emitted_per_round[:-1])
    assert len(recorded) == out.num_rounds and recorded[-1][1].shape[1] > 8 + ids.shape[1]  # past the window
    for window, verify_mask, logits in recorded:
        for b, prompt in enumerate(prompts):
            cached = int(verify_mask[b, :-2].sum())  # the row's real tokens in the cache before this window
            row = out.sequences[b, ids.shape[1] - len(prompt):][:cached]
            if cached > len(prompt) + out.num_new_tokens - 1:  # the row had finished: it verified padding
                continue
            fresh = target(input_ids=torch.cat([row, window[b]])[None]).logits[0, -2:].float()
            torch.testing.assert_close(logits[b], fresh, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------- sampling law

def _top_p_reference(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Independent (loop) top-p: keep most probable tokens until their mass reaches top_p, renormalize."""
    out = torch.zeros_like(probs)
    for row, p in enumerate(probs):
        mass = 0.0
        for idx in sorted(range(len(p)), key=lambda i: -float(p[i])):
            if mass >= top_p:
                break
            out[row, idx] = p[idx]
            mass += float(p[idx])
    return out / out.sum(-1, keepdim=True)


def exact_three_token_law(target, prompt, temperature, top_p):
    """P(x1, x2, x3 | prompt) [V, V, V] from no-cache target forwards."""
    vocab = target.config.unpadded_vocab_size

    def law(prefixes):
        logits = target(input_ids=torch.tensor(prefixes)).logits[:, -1].float()
        return _top_p_reference((logits / temperature).softmax(-1), top_p)

    p1 = law([prompt])[0]
    p2 = law([prompt + [a] for a in range(vocab)])
    p3 = law([prompt + [a, b] for a in range(vocab) for b in range(vocab)]).view(vocab, vocab, vocab)
    return p1[:, None, None] * p2[:, :, None] * p3, p2, p3


def chi_square_pvalue(samples: torch.Tensor, law: torch.Tensor) -> float:
    """Goodness of fit of the rows of ``samples`` [N, n] to the joint ``law`` [V] * n (cells with expected count
    < 5 pooled); 0 for a sample outside the law's support."""
    vocab = law.shape[0]
    n = samples.shape[0]
    cells = torch.zeros(n, dtype=torch.long)
    for column in samples.T:
        cells = cells * vocab + column
    observed = torch.bincount(cells, minlength=law.numel()).double()
    expected = law.reshape(-1).double() * n
    if observed[expected == 0].sum() > 0:  # a sample outside the target's support (e.g. top-p removed it)
        return 0.0
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


@pytest.fixture(scope="module")
def small_vocab_target():
    return make_target(vocab=8, unpadded=6, hidden=32, mlp=("dense", "dense"), seed=3, init=0.3, mup=1.0)


def _wrong_q(vocab):
    gen = torch.Generator().manual_seed(11)
    table = torch.randn(vocab, vocab, generator=gen) * 2.0
    return lambda history, pos: table[history[pos - 1]].softmax(-1)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.75)])
def test_sampling_matches_target_distribution(small_vocab_target, temperature, top_p, monkeypatch):
    target = small_vocab_target
    vocab = 6
    prompt = [1, 4, 2, 5]
    law, p2, p3 = exact_three_token_law(target, prompt, temperature, top_p)
    wrong = _wrong_q(vocab)
    start = len(prompt) + 1  # real position of x2

    def exact_q(history, pos):  # q = p: every draft accepted -> the bonus path emits x3
        return p2[history[pos - 1]] if pos == start else p3[history[pos - 2], history[pos - 1]]

    def mixed_q(history, pos):  # q != p: accept/reject + residual resampling; lockstep drops the bonus
        return 0.5 * exact_q(history, pos) + 0.5 * wrong(history, pos)

    def run(q_fn, batch, seed, lockstep=False):
        ids = torch.tensor([prompt] * batch)
        drafter = StandInDrafter(vocab, max_batch_size=batch, q_fn=q_fn)
        gen = torch.Generator().manual_seed(seed)
        out = speculative_generate(target, drafter, ids, max_new_tokens=3, temperature=temperature, top_p=top_p,
                                   generator=gen, lockstep=lockstep)
        return out, out.sequences[:, len(prompt):]

    out, samples = run(mixed_q, 6000, 0)
    # per row: a row that accepted emitted its draft and the bonus (done), one that rejected went on for a round
    accepted = out.accepted_per_round[0]
    assert 0.2 < out.acceptance_rate < 0.95 and out.emitted_per_round[0] == 6000 + accepted
    assert out.drafted_per_round == [6000, 6000 - accepted]
    assert chi_square_pvalue(samples, law) > 1e-3

    out, samples = run(exact_q, 3000, 1)
    assert out.acceptance_rate > 0.99 and out.num_rounds == 1 and out.emitted_per_round == [6000]  # x3: the bonus
    assert chi_square_pvalue(samples, law) > 1e-3

    # Batch of 2, many calls: acceptance is random per row, so the rows often keep different numbers of tokens.
    samples, ragged = [], 0
    for seed in range(250):
        out, s = run(mixed_q, 2, 100 + seed)
        samples.append(s)
        ragged += out.accepted_per_round[0] == 1
    assert 0 < ragged < 250
    assert chi_square_pvalue(torch.cat(samples), law) > 1e-3

    # Lockstep (the benchmark's baseline) follows the same law: the bonus is kept only when both rows accept.
    samples, kept_bonus = [], 0
    for seed in range(250):
        out, s = run(mixed_q, 2, 100 + seed, lockstep=True)
        samples.append(s)
        kept_bonus += out.emitted_per_round[0] == 4
    assert 0 < kept_bonus < 250
    assert chi_square_pvalue(torch.cat(samples), law) > 1e-3

    # The test can fail: a wrong acceptance rule (always accept the draft) is detected by the same bound.
    monkeypatch.setattr(speculative, "_accept_mask", lambda p_d, q_d, u: torch.ones_like(p_d, dtype=torch.bool))
    _, samples = run(mixed_q, 6000, 0)
    assert chi_square_pvalue(samples, law) < 1e-6


def test_target_distribution_top_p_matches_reference():
    logits = torch.randn(50, 9, generator=torch.Generator().manual_seed(5)) * 2
    for top_p in (0.3, 0.75, 0.95, 1.0):
        ref = _top_p_reference((logits / 0.8).softmax(-1), top_p)
        torch.testing.assert_close(target_distribution(logits, 0.8, top_p), ref, atol=1e-6, rtol=1e-5)


def test_residual_sampling_exact():
    """One verification step in isolation: P(token) = p for a fixed q over many independent rows."""
    gen = torch.Generator().manual_seed(9)
    p = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
    q = torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1])
    n = 200_000
    draft = torch.multinomial(q, n, replacement=True, generator=gen)
    accepted, token = speculative._verify_sampled(p.expand(n, -1), q.expand(n, -1), draft, gen)
    freq = torch.bincount(token, minlength=5).double() / n
    assert (freq - p.double()).abs().max() < 4e-3
    assert abs(accepted.double().mean().item() - torch.minimum(p, q).sum().item()) < 4e-3


# ---------------------------------------------------------------------------------------------------- bad input

class ExplodingDrafter(StandInDrafter):
    def draft(self, *args, **kwargs):
        raise AssertionError("drafter called")


@pytest.mark.parametrize("case,match", [
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (dict(max_new_tokens=-3), "max_new_tokens must be an int >= 1"),
    (dict(prompt_len=13), "prompt of 13 tokens is longer than the drafter's max_length 12"),
    (dict(prompt_len=8, max_new_tokens=6), r"prompt of 8 tokens \+ max_new_tokens 6 - 1 exceeds"),
    (dict(batch=3), "batch size 3 exceeds the drafter's max_batch_size 2"),
    (dict(right_padded=True), r"left-padded \(zeros, then ones, in every row\), got row 0: \[1, 1, 1, 0\]"),
    (dict(empty_row=True), r"at least one real \(attention_mask == 1\) prompt token, got none in row 0"),
    (dict(short_mask=True), r"attention_mask must have the shape of input_ids \(1, 4\), got \(1, 3\)"),
    (dict(temperature=-1.0), "temperature must be"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(token=-1), r"token id -1, outside the target's vocabulary \[0, 128\)"),
    (dict(token=128), r"token id 128, outside the target's vocabulary \[0, 128\)"),
    (dict(device="meta"), "input_ids are on meta, the target on cpu"),
    (dict(temperature=True), "temperature must be"),
    (dict(generator=7), r"generator must be a torch\.Generator \(or None\), got int"),
    (dict(top_p=True), "top_p must be in"),
    (dict(bool_ids=True), r"input_ids must be an integer tensor"),
    (dict(mask_value=2), "attention_mask must contain only 0 and 1"),
    (dict(mask_dtype=torch.float32), "attention_mask must be an integer or bool tensor of 0s and 1s, got torch.float"),
    (dict(mask_dtype=torch.complex64), "attention_mask must be an integer or bool tensor of 0s and 1s, got torch.co"),
    (dict(eos=3, pad=-1), r"pad_token_id must be a token id in \[0, 128\) \(finished rows feed it to the target"),
    (dict(eos=3, pad=128), r"pad_token_id must be a token id in \[0, 128\)"),
    (dict(lockstep=1), "lockstep must be a bool, got 1"),
])
def test_bad_input_rejected_before_any_model_call(target, monkeypatch, case, match):
    def boom(*args, **kwargs):
        raise AssertionError("target called")

    monkeypatch.setattr(speculative, "_target_step", boom)
    batch, prompt_len = case.get("batch", 1), case.get("prompt_len", 4)
    ids = torch.randint(1, 100, (batch, prompt_len))
    if "token" in case:
        ids[0, 1] = case["token"]
    mask = torch.ones_like(ids)
    ids = ids.to(case.get("device", "cpu"))
    if case.get("right_padded"):
        mask[:, -1] = 0
    if case.get("empty_row"):
        mask[0] = 0
    if case.get("short_mask"):
        mask = mask[:, :3]
    if "mask_value" in case:
        mask[0, 0] = case["mask_value"]
    mask = mask.to(case.get("mask_dtype", mask.dtype))
    if case.get("bool_ids"):
        ids = ids > 50
    drafter = ExplodingDrafter(120, max_batch_size=2, max_length=12)
    with pytest.raises(ArgumentError, match=match):
        speculative_generate(target, drafter, ids, mask, max_new_tokens=case.get("max_new_tokens", 3),
                             temperature=case.get("temperature", 0.0), top_p=case.get("top_p", 1.0),
                             generator=case.get("generator"), eos_token_id=case.get("eos"),
                             pad_token_id=case.get("pad"), lockstep=case.get("lockstep", False))


class WithoutK:
    """A drafter that does not say how many tokens it drafts per round."""

    max_batch_size, max_length = 1, 12

    def draft(self, *args, **kwargs):
        raise AssertionError("drafter called")


class OneDraftShape(StandInDrafter):
    """Returns the one-draft shape the loop once accepted (``tokens`` [B], ``probs``): not a ``DraftResult``."""

    def draft(self, input_ids, positions, hidden, **kwargs):
        return SimpleNamespace(tokens=super().draft(input_ids, positions, hidden, **kwargs).drafts[:, 0], probs=None)


def test_the_drafter_contract_is_checked(target):
    """A drafter lacking a member of ``DraftSource`` is refused before any model call; a draft result of another
    type, at the first draft."""
    ids = torch.randint(1, 100, (1, 4))
    with pytest.raises(ArgumentError, match=r"drafter must follow the DraftSource protocol .* got WithoutK"):
        speculative_generate(target, WithoutK(), ids, max_new_tokens=3)
    with pytest.raises(TypeError, match="drafter.draft must return a DraftResult, got SimpleNamespace"):
        speculative_generate(target, OneDraftShape(120, max_batch_size=1, max_length=12), ids, max_new_tokens=3)


@pytest.mark.parametrize("member, value", [("num_speculative_tokens", 0), ("num_speculative_tokens", "1"),
                                           ("max_batch_size", "4"), ("max_length", None)])
def test_a_drafters_sizes_are_checked_before_any_model_call(target, member, value):
    """A K of 0 was a ZeroDivisionError after the whole loop had run; a size of another type, a TypeError."""
    drafter = StandInDrafter(120)
    setattr(drafter, member, value)
    drafter.draft = lambda *args, **kwargs: pytest.fail("drafter called")
    with pytest.raises(ArgumentError, match=f"drafter.{member} must be an int >= 1, got {value!r}"):
        speculative_generate(target, drafter, torch.randint(1, 100, (1, 4)), max_new_tokens=3)


class BadDrafts(StandInDrafter):
    """Returns drafts (and probs) the target cannot take: an id past its vocabulary, or the wrong shape."""

    def __init__(self, *args, change, **kwargs):
        super().__init__(*args, **kwargs)
        self.change = change

    def draft(self, input_ids, positions, hidden, **kwargs):
        result = super().draft(input_ids, positions, hidden, **kwargs)
        return dataclasses.replace(result, **self.change(result))


@pytest.mark.parametrize("change,match", [
    (lambda r: {"drafts": r.drafts + 120}, r"draft ids in \[\d+, \d+\]; the target's vocabulary is \[0, 120\)"),
    (lambda r: {"drafts": r.drafts - 200}, r"draft ids in \[-\d+, -\d+\]; the target's vocabulary is \[0, 120\)"),
    (lambda r: {"drafts": r.drafts[0]}, r"drafts of shape \(1,\), expected \[1, 1\]"),
    (lambda r: {"drafts": r.drafts.expand(2, 1)}, r"drafts of shape \(2, 1\), expected \[1, 1\]"),
])
def test_a_custom_drafters_impossible_drafts_are_named(target, change, match):
    """A DraftSource of the caller's own is not trusted like ours: an id past the vocabulary indexed the target's
    embedding deep inside torch (an illegal memory access on a GPU)."""
    drafter = BadDrafts(120, max_batch_size=1, max_length=12, change=change)
    with pytest.raises(ValueError, match=match):
        speculative_generate(target, drafter, torch.randint(1, 100, (1, 4)), max_new_tokens=3)


def test_a_custom_drafters_probs_are_checked_when_sampling_only(target):
    """Greedy decoding never reads draft_probs; sampling indexes them by the target's vocabulary."""
    def short_probs(result):
        return {"draft_probs": torch.full((1, 1, 100), 0.01)}

    def uniform(history, position):
        return torch.full((120,), 1 / 120)

    ids = torch.randint(1, 100, (1, 4))
    speculative_generate(target, BadDrafts(120, max_batch_size=1, max_length=12, change=short_probs), ids,
                         max_new_tokens=3)
    drafter = BadDrafts(120, max_batch_size=1, max_length=12, change=short_probs, q_fn=uniform)
    with pytest.raises(ValueError, match=r"draft_probs of shape \(1, 1, 100\), expected \[1, 1, 120\]"):
        speculative_generate(target, drafter, ids, max_new_tokens=3, temperature=1.0)


@pytest.mark.parametrize("overrides,match", [
    (dict(vocab_size=256, unpadded_vocab_size=250), "drafter logits vocabulary 250 != target logits vocabulary 120"),
    (dict(vocab_size=128, unpadded_vocab_size=120, hidden_size=32), "drafter hidden size 32 != target hidden size 64"),
    (dict(vocab_size=124, unpadded_vocab_size=120),
     "drafter embedding table has 124 rows, fewer than the target's vocabulary 128"),
])
def test_a_drafter_built_for_another_model_is_rejected(target, overrides, match):
    drafter = Drafter(random_mtp(tiny_text_config(**overrides)), max_batch_size=1, max_length=16, compile=False,
                      num_speculative_tokens=1)
    with pytest.raises(ArgumentError, match=match):
        speculative_generate(target, drafter, torch.randint(1, 100, (1, 4)), max_new_tokens=3)


def test_a_drafter_in_another_dtype_gets_the_hiddens_in_its_own(target):
    """A bf16 draft head beside an fp32 target (its own copy of the shared tensors) drafts from bf16 hiddens, and the
    output is still the target's own greedy continuation."""
    drafter = Drafter(random_mtp(tiny_text_config(vocab_size=128, unpadded_vocab_size=120), dtype=torch.bfloat16),
                      max_batch_size=1, max_length=16, compile=False, num_speculative_tokens=1)
    ids = torch.randint(1, 100, (1, 4), generator=torch.Generator().manual_seed(0))
    ours = speculative_generate(target, drafter, ids, max_new_tokens=8)
    expected = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                               eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.sequences, expected)


@pytest.mark.parametrize("k", [1, 2])
def test_a_drafter_whose_model_was_converted_after_construction_is_refused_up_front(target, monkeypatch, k):
    """Its cache and buffers keep the old dtype: the loop's unvalidated draft calls met it inside a kernel (an index
    put or a matmul of mixed dtypes). Drafter.check names it; the loop, which skips that check, must too."""
    mtp = random_mtp(tiny_text_config(vocab_size=128, unpadded_vocab_size=120))
    drafter = Drafter(mtp, max_batch_size=1, max_length=16, compile=False, num_speculative_tokens=k)
    mtp.to(torch.bfloat16)
    monkeypatch.setattr(speculative, "_target_step", lambda *args, **kwargs: pytest.fail("target called"))
    with pytest.raises(ValueError, match=r"the model is now torch\.bfloat16 on cpu, but this Drafter was built for "
                                         r"it as torch\.float32 on cpu: build a new Drafter"):
        speculative_generate(target, drafter, torch.randint(1, 100, (1, 4)), max_new_tokens=3)


def test_validated_once_up_front_then_the_drafter_checks_nothing(target, monkeypatch):
    """The loop validates its inputs before any model call; every drafter call (prefill too) skips validation."""
    drafter = Drafter(random_mtp(tiny_text_config(vocab_size=128, unpadded_vocab_size=120)), max_batch_size=2,
                      max_length=32, compile=False, num_speculative_tokens=1)

    def refuse(*args, **kwargs):
        raise AssertionError("the drafter validated again")

    monkeypatch.setattr(Drafter, "check", refuse)
    ids, mask = left_pad([[5, 6, 7, 8, 9], [10, 11]])
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=6)
    assert torch.equal(out.sequences, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6))


# ------------------------------------------------------------------------- real drafter, synthetic checkpoint, CLI

def test_real_drafter_with_conditional_generation_target():
    """End to end with the lead's Drafter (eager) on the tiny synthetic checkpoint (multimodal target, text only)."""
    path = synthetic.cached_checkpoint("tiny")
    target = synthetic.load_hf_target(path)
    drafter = Drafter(InklingMTP.from_pretrained(path, target=target), max_batch_size=4, max_length=32,
                      compile=False, num_speculative_tokens=1)
    ids, mask = left_pad(random_prompts(random.Random(4), 3, 3, 10, vocab=500))
    eos, pad = target.generation_config.eos_token_id, target.generation_config.pad_token_id
    reference = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=pad)
    assert torch.equal(out.sequences, reference)
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=12, temperature=0.8, top_p=0.9,
                               generator=torch.Generator().manual_seed(0))
    assert out.sequences.shape[1] <= ids.shape[1] + 12 and int(out.sequences.max()) < 500
    assert out.num_drafted == sum(out.drafted_per_round) > 0


def test_cli_smoke(capsys):
    code = generate_cli(["--no-compile", "--no-warmup", "--check", "--batch", "2", "--ragged", "--prompt-len", "6",
                         "--max-new-tokens", "5", "--ignore-eos"])
    printed = capsys.readouterr().out
    assert code == 0 and "greedy generate() match: True" in printed and "acceptance rate" in printed
