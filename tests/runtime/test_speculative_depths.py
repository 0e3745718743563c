"""The speculative loop with K drafts per round (docs/protocol.md §6.5, §6.7): lossless greedy for K = 2, 3, 8 with
a stand-in drafter that proposes the target's own greedy tokens or deliberately wrong ones, the acceptance statistics,
and the sampling law for K = 3 (chi-square against the target's exact joint law on a tiny vocabulary).

The target is the tiny random ``InklingForCausalLM`` of ``test_speculative`` (sliding window 8, so a K = 8 verify
window of 9 rows crosses it on every round).
"""

from __future__ import annotations

import random

import pytest
import torch

from inkling_compiled.runtime import DraftResult, speculative
from inkling_compiled.runtime.speculative import speculative_generate
from tests.runtime.test_speculative import (
    StandInDrafter,
    _first_eos_candidate,
    _top_p_reference,
    chi_square_pvalue,
    left_pad,
    make_target,
    oracle_from,
    random_prompts,
    tokens_emitted,
    wrong_pattern,
)

PAD = 0


class KStandInDrafter(StandInDrafter):
    """``StandInDrafter`` with K greedy drafts per round: the target's greedy token for each of the K positions after
    the last row (from ``generate``), or a deliberately wrong one where ``wrong(b, position)``."""

    def __init__(self, k, vocab, **kwargs):
        super().__init__(vocab, **kwargs)
        self.num_speculative_tokens = k

    def draft(self, input_ids, positions, hidden, *, temperature=0.0, generator=None, validate=True):
        super().draft(input_ids, positions, hidden, temperature=temperature, generator=generator, validate=validate)
        drafts = []
        for b, last in enumerate(positions.amax(dim=1).tolist()):  # the last real row (ragged windows: padding after)
            row = []
            for p in range(last + 2, last + 2 + self.num_speculative_tokens):
                token = self.oracle[b].get(p, 3)
                row.append((token + 1 + b) % self.vocab if self.wrong(b, p) else token)
            drafts.append(row)
        return DraftResult(drafts=torch.tensor(drafts), draft_probs=None, hidden=hidden[:, -1])


def check_statistics(out, k, prompt_len, batch, eos=None, lockstep=False):
    """The statistics agree with each other and with the tokens; per row, a round emits each row's accepted drafts
    + 1 unless the row finished in it (EOS, or max_new_tokens cut it)."""
    assert out.num_speculative_tokens == k and len(out.acceptance_per_position) == (k if out.num_rounds else 0)
    assert sum(out.emitted_per_round) + batch == sum(tokens_emitted(out, prompt_len, eos))
    assert all(d % k == 0 for d in out.drafted_per_round) and out.num_drafted == sum(out.drafted_per_round)
    assert out.num_accepted == sum(out.accepted_per_round) == sum(map(sum, out.accepted_per_position_per_round))
    rows = out.num_drafted // k
    for j, rate in enumerate(out.acceptance_per_position):
        assert rate == sum(c[j] for c in out.accepted_per_position_per_round) / rows
    assert out.acceptance_per_position == sorted(out.acceptance_per_position, reverse=True)
    assert out.mean_accepted_length == (sum(out.emitted_per_round) / rows if rows else 0.0)
    if not lockstep:
        rounds = list(zip(out.drafted_per_round, out.accepted_per_round, out.emitted_per_round))
        for (drafted, accepted, emitted), (drafted_next, _, _) in zip(rounds, rounds[1:]):
            if drafted_next == drafted:  # no row finished in this round
                assert emitted == drafted // k + accepted


def _greedy_case(target, k, prompts, max_new, rate_mod, eos=None, lockstep=False):
    ids, mask = left_pad(prompts)
    gen_kwargs = {} if eos is None else dict(eos_token_id=eos, pad_token_id=PAD)
    reference = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, **gen_kwargs)
    drafter = KStandInDrafter(k, 120, oracle=oracle_from(reference, mask), wrong=wrong_pattern(rate_mod))
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=max_new, eos_token_id=eos,
                               pad_token_id=PAD if eos is not None else None, lockstep=lockstep)
    assert torch.equal(out.sequences, reference), (k, out.sequences[:, ids.shape[1]:], reference[:, ids.shape[1]:])
    assert drafter.check_rows(out.sequences, mask, target) > 0 or not drafter.calls
    check_statistics(out, k, ids.shape[1], len(prompts), eos, lockstep)
    return out


@pytest.mark.parametrize("k", [2, 3, 8])
def test_greedy_batch1_matches_generate(target, k):
    rng = random.Random(k)
    for i, prompt in enumerate(random_prompts(rng, 8, 1, 20)):
        rate_mod = [0, 1, 5, 7][i % 4]
        out = _greedy_case(target, k, [prompt], 20, rate_mod)
        # batch 1: every round but the last (cut at max_new_tokens) emits the accepted drafts + 1
        assert out.emitted_per_round[:-1] == [1 + a for a in out.accepted_per_round[:-1]]
        if rate_mod == 0:  # perfect drafts (up to the end of the oracle): all accepted, K + 1 tokens per round
            assert out.accepted_per_position_per_round[:-1] == [[1] * k] * (out.num_rounds - 1)
            assert out.emitted_per_round[0] == k + 1
        if rate_mod == 1:  # always wrong: nothing accepted, one token per round
            assert out.acceptance_per_position == [0.0] * k and out.mean_accepted_length == 1.0
        if rate_mod == 5:  # some drafts right, some wrong: acceptance falls with the position
            assert 0 < out.acceptance_per_position[0] < 1


@pytest.mark.parametrize("k", [2, 3, 8])
def test_greedy_left_padded_batches_match_generate(target, k):
    rng = random.Random(10 + k)
    saw_lockstep_cut = False
    for rate_mod in (0, 5, 7):
        prompts = random_prompts(rng, 4, 1, 16)
        _greedy_case(target, k, prompts, 18, rate_mod)
        out = _greedy_case(target, k, prompts, 18, rate_mod, lockstep=True)
        # lockstep: in some round a row accepted a draft that the batch then dropped
        saw_lockstep_cut |= any(e < d // k + a for d, a, e in zip(out.drafted_per_round, out.accepted_per_round,
                                                                   out.emitted_per_round[:-1]))
    assert saw_lockstep_cut


@pytest.mark.parametrize("k", [3, 8])
def test_greedy_with_eos_mid_batch_matches_generate(target, k):
    rng = random.Random(20 + k)
    prompts = random_prompts(rng, 4, 2, 12)
    eos = _first_eos_candidate(target, prompts, 15)
    out = _greedy_case(target, k, prompts, 15, rate_mod=7, eos=eos)
    new = out.sequences[:, -out.num_new_tokens:]
    assert (new == eos).any() and not (new == eos).any(dim=1).all()  # one row stops mid-batch, another goes on
    out1 = _greedy_case(target, k, prompts[:1], 15, rate_mod=0, eos=eos)  # batch 1 stops at EOS mid-round
    assert out1.sequences[0, -1].item() == eos and out1.num_new_tokens < 15


def test_max_new_tokens_cuts_a_round(target):
    prompts = [[5, 6, 7], [8]]
    for n in (1, 2, 4, 9, 10, 11):  # all accepted: K + 1 = 9 per round, never a column past max_new_tokens
        assert _greedy_case(target, 8, prompts, n, rate_mod=0).num_new_tokens == n


# --------------------------------------------------------------------------------------------- sampling law

NEW = 5  # tokens per sample: the prefill's, then a K = 3 round of up to 4 (three drafts and the bonus)


@pytest.fixture(scope="module")
def tiny_vocab_target():
    return make_target(vocab=8, unpadded=4, hidden=32, mlp=("dense", "dense"), seed=3, init=0.3, mup=1.0)


def exact_laws(target, prompt, n, temperature, top_p):
    """The target's conditional law of the next token after every prefix prompt + x_1..x_j (j < n), as a tensor
    [V] * (j + 1) per j, from no-cache forwards; and the joint law of x_1..x_n."""
    vocab = target.config.unpadded_vocab_size
    laws = []
    for j in range(n):
        prefixes = torch.cartesian_prod(*[torch.arange(vocab)] * j).reshape(-1, j) if j else torch.zeros(1, 0)
        ids = torch.cat([torch.tensor([prompt]).expand(len(prefixes), -1), prefixes.long()], dim=1)
        logits = target(input_ids=ids).logits[:, -1].float()
        laws.append(_top_p_reference((logits / temperature).softmax(-1), top_p).view(*[vocab] * (j + 1)))
    joint = laws[0]
    for law in laws[1:]:
        joint = joint[..., None] * law
    return laws, joint


class SamplingDrafter:
    """K = 3 drafts per round for a batch of one repeated prompt, each drawn from ``q_j`` given the row's committed
    tokens and the drafts before it: the target's exact conditional law, mixed half-and-half with a wrong one at the
    depths in ``mixed`` (so a big batch still reaches every position: rows all accept at exact depths). Rows advance
    by their own accepted lengths, so each keeps its own history."""

    num_speculative_tokens = 3

    def __init__(self, laws, prompt_len, mixed, vocab, batch):
        self.laws, self.prompt_len, self.mixed = laws, prompt_len, mixed
        self.max_batch_size, self.max_length = batch, 32
        self.wrong = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(11)).mul(2).softmax(-1)
        self.committed = [[] for _ in range(batch)]

    def draft(self, input_ids, positions, hidden, *, temperature=0.0, generator=None, validate=True):
        new_rows = positions >= self.prompt_len - 1  # the rows carrying generated tokens (one prompt, no padding)
        for committed, ids, new in zip(self.committed, input_ids.tolist(), new_rows.tolist()):
            committed.extend(t for t, n in zip(ids, new) if n)
        lengths = torch.tensor([len(c) for c in self.committed])
        drafts = torch.zeros(len(lengths), self.num_speculative_tokens, dtype=torch.long)
        probs = torch.zeros(len(lengths), self.num_speculative_tokens, 4)
        for length in lengths.unique().tolist():  # rows with as many committed tokens share one law lookup
            rows = (lengths == length).nonzero().squeeze(1)
            history = torch.tensor([self.committed[b] for b in rows.tolist()]).view(len(rows), length)
            for depth in range(self.num_speculative_tokens):
                j = history.shape[1]
                exact = self.laws[j][tuple(history.T)] if j < len(self.laws) else torch.full((len(history), 4), 0.25)
                q = 0.5 * exact + 0.5 * self.wrong[history[:, -1]] if depth in self.mixed else exact
                draft = torch.multinomial(q, 1, generator=generator)
                drafts[rows, depth], probs[rows, depth] = draft[:, 0], q
                history = torch.cat([history, draft], dim=1)
        return DraftResult(drafts=drafts, draft_probs=probs, hidden=hidden[:, -1])


def test_sampling_k3_matches_target_distribution(tiny_vocab_target, monkeypatch):
    target, prompt, temperature, top_p = tiny_vocab_target, [1, 3, 2, 0], 0.9, 0.95
    laws, joint = exact_laws(target, prompt, NEW, temperature, top_p)

    def run(mixed, batch, seed, lockstep=False):
        drafter = SamplingDrafter(laws, len(prompt), mixed, 4, batch)
        out = speculative_generate(target, drafter, torch.tensor([prompt] * batch), max_new_tokens=NEW,
                                   temperature=temperature, top_p=top_p, generator=torch.Generator().manual_seed(seed),
                                   lockstep=lockstep)
        return out, out.sequences[:, len(prompt):]

    # Wrong at depth 1 / 2 / 3 (a row then stops after 0 / 1 / 2 drafts or takes the residual sample there), or exact
    # everywhere (every draft accepted, the bonus token emitted): each row keeps its own accepted length, the rows
    # that stopped early go on with ragged windows, and every run must follow the target's exact joint law.
    for mixed, cut in (({0, 1, 2}, 0), ({1, 2}, 1), ({2}, 2), ((), 3)):
        out, samples = run(mixed, 4000, 7 + cut)
        first_round = out.accepted_per_position_per_round[0]
        assert first_round[:cut] == [4000] * cut and out.emitted_per_round[0] == 4000 + out.accepted_per_round[0]
        if cut < 3:  # at the first mixed depth some rows accept (and emit their draft), the others resample
            assert 400 < first_round[cut] < 3600, (mixed, first_round)
            assert out.num_rounds > 1 and out.drafted_per_round[1] < out.drafted_per_round[0]
        assert chi_square_pvalue(samples, joint) > 1e-3, mixed

    # Lockstep (the benchmark's baseline): the batch is cut after the drafts every row accepted; same law.
    out, samples = run({1, 2}, 4000, 8, lockstep=True)
    assert out.emitted_per_round[0] == 4000 * 2 and chi_square_pvalue(samples, joint) > 1e-3

    # The test can fail: a wrong acceptance rule (always accept the draft) is detected by the same bound.
    monkeypatch.setattr(speculative, "_accept_mask", lambda p_d, q_d, u: torch.ones_like(p_d, dtype=torch.bool))
    _, samples = run({0, 1, 2}, 4000, 7)
    assert chi_square_pvalue(samples, joint) < 1e-6
