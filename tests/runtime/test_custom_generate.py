"""``target.generate(custom_generate=custom_generate, drafter=...)`` against ``target.generate`` with the same
arguments (docs/protocol.md §6.11): greedy token for token (batch 1 and ragged, K = 1 and 8, EOS, processors, a
custom stopping criterion, stop strings, a streamer, ``return_dict_in_generate``), sampling in distribution, and
the options it refuses.

Most cases run the tiny random text target of test_speculative.py with oracle stand-in drafters (the target's own
greedy tokens, deliberately wrong at some positions); the image / audio cases run in test_multimodal.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedTokenizerFast,
    StoppingCriteria,
    StoppingCriteriaList,
    TopKLogitsWarper,
)
from transformers.generation import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.streamers import BaseStreamer

from inkling_compiled.runtime import SpeculativeGenerateOutput, custom_generate
from tests.runtime.test_speculative import (
    PAD,
    chi_square_pvalue,
    left_pad,
    make_target,
    oracle_from,
    random_prompts,
    wrong_pattern,
)
from tests.runtime.test_speculative_depths import NEW, KStandInDrafter, SamplingDrafter

pytestmark = pytest.mark.floor  # make test-floor: generate's custom_generate hook on the lowest transformers

MAX_NEW = 14


def prompts_for(batch: int, seed: int = 0):
    return left_pad(random_prompts(random.Random(seed), batch, 2 if batch == 1 else 1, 12))


def both(target, ids, mask, k=1, rate_mod=5, reference_kwargs=None, **kwargs):
    """(generate's output, ours) with the same arguments; our drafter proposes generate's own greedy tokens, wrong at
    the positions ``wrong_pattern(rate_mod)`` picks."""
    reference = target.generate(ids, attention_mask=mask, do_sample=False, **(reference_kwargs or kwargs))
    sequences = reference if isinstance(reference, torch.Tensor) else reference.sequences
    drafter = KStandInDrafter(k, 120, oracle=oracle_from(sequences, mask), wrong=wrong_pattern(rate_mod))
    ours = target.generate(ids, attention_mask=mask, do_sample=False, custom_generate=custom_generate,
                           drafter=drafter, **kwargs)
    return reference, ours


def continuation_token(target, ids, mask, at: int) -> int:
    """A token the target emits ``at`` tokens into the first row's greedy continuation."""
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=at + 1)
    return int(ref[0, ids.shape[1] + at])


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_matches_generate(target, k, batch):
    ids, mask = prompts_for(batch, seed=k + batch)
    for rate_mod in (0, 5):  # every draft right (rounds of K + 1), or about two in five wrong
        reference, ours = both(target, ids, mask, k, rate_mod, max_new_tokens=MAX_NEW)
        assert torch.equal(ours, reference)
    reference, ours = both(target, ids, mask, k, 5, max_length=ids.shape[1] + 5)  # max_length instead
    assert torch.equal(ours, reference) and ours.shape[1] == ids.shape[1] + 5


@pytest.mark.parametrize("k", [1, 8])
def test_eos_one_or_several_and_pad(target, k):
    ids, mask = prompts_for(3, seed=7)
    eos = continuation_token(target, ids, mask, 4)
    for eos_ids in (eos, [5, eos]):
        reference, ours = both(target, ids, mask, k, 0, max_new_tokens=MAX_NEW, eos_token_id=eos_ids,
                               pad_token_id=PAD)
        assert torch.equal(ours, reference) and (reference[0, ids.shape[1]:] == eos).any()


def test_several_eos_criteria_each_stop_their_rows(target):
    """Two EosTokenCriteria of the caller's (the first replaces generate's own): generate stops a row at either's
    id; only the last one's ids were kept, so rows ran past the first's."""
    ids, mask = prompts_for(3, seed=7)
    first, second = continuation_token(target, ids, mask, 2), continuation_token(target, ids, mask, 6)
    criteria = [EosTokenCriteria(first), EosTokenCriteria(second)]
    reference, ours = both(target, ids, mask, 3, 0, max_new_tokens=MAX_NEW, eos_token_id=second, pad_token_id=PAD,
                           stopping_criteria=criteria)
    assert torch.equal(ours, reference) and (reference[0, ids.shape[1]:] == PAD).any()


def test_processors_are_applied_to_the_target(target):
    """Context-dependent processors (repetition penalty, no-repeat n-grams, a minimum length holding back EOS)."""
    ids, mask = prompts_for(3, seed=3)
    eos = continuation_token(target, ids, mask, 1)
    for options in (dict(repetition_penalty=1.6), dict(no_repeat_ngram_size=2),
                    dict(min_new_tokens=6, eos_token_id=eos, pad_token_id=PAD)):
        reference, ours = both(target, ids, mask, 3, 5, max_new_tokens=MAX_NEW, **options)
        assert torch.equal(ours, reference), options
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW)
    assert not torch.equal(plain, reference)  # the processors changed the continuation


def test_processor_token_lists_as_long_as_the_batch_apply_to_every_row(target):
    """Batch 2 with two suppressed tokens, or two EOS ids held back by min_new_tokens: once the rows' counts
    diverged, each row applied only "its" id (the [2] tensors were taken for per-row state), so row 1 emitted
    the token at index 0 (suppressed, or an EOS too early)."""
    ids, mask = prompts_for(2, seed=1)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW)[:, ids.shape[1]:]
    token = int(plain[1, 4])  # row 1 emits it after the counts diverged, row 0 never does
    unused = next(t for t in range(1, 120) if t not in plain)
    assert token not in plain[0] and token not in plain[1, :4]
    for options in (dict(suppress_tokens=[token, unused], no_repeat_ngram_size=MAX_NEW),
                    dict(eos_token_id=[token, unused], pad_token_id=PAD, min_new_tokens=MAX_NEW - 1)):
        reference, ours = both(target, ids, mask, 1, 5, max_new_tokens=MAX_NEW, **options)
        assert torch.equal(ours, reference), options


class StopAfter(StoppingCriteria):
    """Stops a row once it has emitted ``token`` (records every call's width)."""

    def __init__(self, token: int, prompt_len: int):
        self.token, self.prompt_len, self.widths = token, prompt_len, []

    def __call__(self, input_ids, scores, **kwargs):
        self.widths.append(input_ids.shape[1])
        return (input_ids[:, self.prompt_len:] == self.token).any(dim=1)


@pytest.mark.parametrize("eos_ids", [None, 119, []])
def test_custom_stopping_criterion_cuts_the_round_there(target, eos_ids):
    """All drafts right, K = 8: the stop falls inside a round, which is cut exactly there (with an EOS criterion,
    which generate adds even for ``eos_token_id=[]``, the row is padded after it; without one, like generate, a
    stopped row goes on until every row has stopped)."""
    ids, mask = prompts_for(3, seed=11)
    token = continuation_token(target, ids, mask, 3)
    eos = {} if eos_ids is None else dict(eos_token_id=eos_ids, pad_token_id=PAD)
    reference, ours = both(target, ids, mask, 8, 0, max_new_tokens=MAX_NEW,
                           stopping_criteria=[StopAfter(token, ids.shape[1])], **eos)
    assert torch.equal(ours, reference)
    one, ours = both(target, ids[:1], mask[:1], 8, 0, max_new_tokens=MAX_NEW,
                     stopping_criteria=[StopAfter(token, ids.shape[1])], **eos)
    assert torch.equal(ours, one) and ours.shape[1] <= ids.shape[1] + 4 and int(ours[0, -1]) == token


class StopAtLength(StoppingCriteria):
    """Stops a row once it has ``lengths[t]`` new tokens, ``t`` its last prompt token (the loop calls criteria on
    some of the rows at a time, so a row is told by its contents, not its index)."""

    def __init__(self, lengths: dict[int, int], prompt_len: int):
        self.lengths, self.prompt_len = lengths, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        return torch.tensor([input_ids.shape[1] - self.prompt_len >= self.lengths[int(row[self.prompt_len - 1])]
                             for row in input_ids])


@pytest.mark.parametrize("k, rate_mod", [(8, 0), (4, 3)])
def test_the_statistics_count_no_token_of_the_rows_cut_after_the_last_stop(target, k, rate_mod):
    """Without an EOS criterion the stopped rows run on until the last row stops, and all are then cut there, as in
    generate: the tokens past the cut were counted in ``emitted_per_round`` and ``mean_accepted_length``."""
    ids, mask = prompts_for(3, seed=11)
    last = ids[:, -1].tolist()
    assert len(set(last)) == 3
    stop = [StopAtLength(dict(zip(last, [3, 7, 5])), ids.shape[1])]
    reference, ours = both(target, ids, mask, k, rate_mod, max_new_tokens=MAX_NEW, return_dict_in_generate=True,
                           stopping_criteria=stop)
    assert torch.equal(ours.sequences, reference.sequences) and ours.sequences.shape[1] == ids.shape[1] + 7
    stats = ours.speculative
    assert sum(stats.emitted_per_round) + 3 == 3 * 7  # the prefill's token aside, each row's 7 in the output
    assert stats.mean_accepted_length == sum(stats.emitted_per_round) / (stats.num_drafted // k)


def word_tokenizer(vocab: int = 120) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose token i < vocab - 1 is a two-letter word, decoded without spaces (so a stop
    string can straddle two tokens); the last token is the prefix transformers' stop-string matcher probes with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {chr(97 + i // 26) + chr(97 + i % 26): i for i in range(vocab - 1)} | {"abcdef": vocab - 1}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="aa"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Whitespace(), decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="aa", pad_token="aa")


@pytest.mark.parametrize("with_eos", [False, True])
def test_stop_strings_with_a_tokenizer(target, with_eos):
    ids, mask = prompts_for(2, seed=5)
    tokenizer = word_tokenizer()
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW)
    first, second = (tokenizer.convert_ids_to_tokens(int(t)) for t in ref[0, ids.shape[1] + 4:ids.shape[1] + 6])
    stop = first[1] + second  # ends inside the second token's word: the text ends with it after that token
    eos = dict(eos_token_id=119, pad_token_id=PAD) if with_eos else {}
    # generate(stop_strings=..., tokenizer=...) builds this criterion; it hands a custom_generate callable no
    # tokenizer (transformers 5.23-5.24), so with custom_generate the same criterion is passed ready-made
    reference, ours = both(target, ids, mask, 8, 0, reference_kwargs=dict(max_new_tokens=MAX_NEW, stop_strings=[stop],
                                                                           tokenizer=tokenizer, **eos),
                           max_new_tokens=MAX_NEW, stopping_criteria=[StopStringCriteria(tokenizer, [stop])], **eos)
    assert torch.equal(ours, reference)
    text = tokenizer.decode(ours[0, ids.shape[1]:])
    assert stop in text and (text.endswith(stop) or with_eos or ours.shape[1] == ids.shape[1] + MAX_NEW)


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1


@pytest.mark.parametrize("batch", [1, 2])
def test_streamer_gets_every_token_in_order_and_one_end(target, batch):
    ids, mask = prompts_for(batch, seed=13)
    eos = continuation_token(target, ids, mask, 6)
    theirs, ours = Recorder(), Recorder()
    options = dict(max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=PAD)
    reference, out = both(target, ids, mask, 3, 5, reference_kwargs=dict(options, streamer=theirs), streamer=ours,
                          **options)
    assert torch.equal(out, reference) and ours.ends == theirs.ends == 1
    assert torch.equal(ours.puts[0], theirs.puts[0])  # the prompt, put by generate itself
    if batch == 1:  # one chunk per round (the accepted drafts and the correction), in order
        assert len(ours.puts) < len(theirs.puts)
        assert torch.equal(torch.cat(ours.puts[1:]), torch.cat([p.reshape(-1) for p in theirs.puts[1:]]))
    else:  # one [B] column at a time, as generate puts them
        assert [p.tolist() for p in ours.puts[1:]] == [p.tolist() for p in theirs.puts[1:]]


def test_return_dict_in_generate(target):
    ids, mask = prompts_for(3, seed=17)
    reference, ours = both(target, ids, mask, 8, 5, max_new_tokens=MAX_NEW, return_dict_in_generate=True)
    assert isinstance(ours, SpeculativeGenerateOutput) and torch.equal(ours.sequences, reference.sequences)
    for name in ("scores", "logits", "attentions", "hidden_states"):
        assert getattr(ours, name) is None and getattr(reference, name) is None
    stats = ours.speculative
    assert stats.num_speculative_tokens == 8 and 0 < stats.acceptance_rate < 1
    assert len(stats.acceptance_per_position) == 8 and torch.equal(stats.sequences, ours.sequences)


@pytest.mark.parametrize("options,match", [
    (dict(num_beams=2), "num_beams=2"),
    (dict(return_dict_in_generate=True, output_scores=True), "output_scores"),
    (dict(prefix_allowed_tokens_fn=lambda b, ids: [1, 2]), "PrefixConstrainedLogitsProcessor"),
    (dict(drafter=None), "needs a drafter"),
    (dict(inputs_embeds=torch.zeros(1, 4, 64)), "a prompt given as inputs_embeds is not supported"),
    (dict(token_type_ids=torch.zeros(1, 4, dtype=torch.long)), "token_type_ids"),
    (dict(do_sample=True, temperature=1e-7), "temperature 1e-07 is below 1e-06: .* pass do_sample=False"),
    # generate refuses these two modes only when no custom_generate is given: they were greedy decoding silently
    (dict(penalty_alpha=0.6, top_k=4), r"not contrastive search \(leave out penalty_alpha\)"),
    (dict(dola_layers="high"), r"not dola generation \(leave out dola_layers\)"),
    (dict(assistant_early_exit=1), "assistant_early_exit"),
])
def test_what_it_cannot_honour_is_refused_by_name(target, options, match):
    ids = torch.tensor([[5, 6, 7, 8]])
    drafter = options.pop("drafter", KStandInDrafter(1, 120, oracle=[{}]))
    with pytest.raises(ValueError, match=match):  # token_type_ids: transformers itself refuses it
        target.generate(ids, max_new_tokens=4, custom_generate=custom_generate, drafter=drafter, **options)


def test_a_refusal_ends_the_streamer_generate_gave_the_prompt(target):
    """A consumer of a TextIteratorStreamer waited for ever: generate puts the prompt before calling us."""
    streamer = Recorder()
    with pytest.raises(ValueError, match="num_beams=2"):
        target.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, num_beams=2, streamer=streamer,
                        custom_generate=custom_generate, drafter=KStandInDrafter(1, 120, oracle=[{}]))
    assert len(streamer.puts) == 1 and streamer.ends == 1


def test_a_direct_call_is_told_to_go_through_generate(target):
    """An unprepared GenerationConfig (its fields None in transformers 5) was 'num_beams=None (beam search)', a
    TypeError or an AttributeError."""
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match=r"call target.generate\(\.\.\., custom_generate=custom_generate"):
        custom_generate(target, ids, LogitsProcessorList(), StoppingCriteriaList(),
                        GenerationConfig(num_beams=1, max_new_tokens=4), drafter=KStandInDrafter(1, 120, oracle=[{}]))


def test_num_return_sequences_is_named_when_the_copies_outgrow_the_drafter(target):
    ids, mask = prompts_for(2, seed=3)
    drafter = KStandInDrafter(1, 120, oracle=[{}], max_batch_size=4)
    with pytest.raises(ValueError, match=r"batch size 6 \(2 prompts x num_return_sequences=3\) exceeds the "
                                         r"drafter's max_batch_size 4"):
        target.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, num_return_sequences=3,
                        custom_generate=custom_generate, drafter=drafter)


def test_a_max_length_criterion_within_the_prompt_still_gets_one_token(target):
    """generate's loop emits a token before asking its criteria; the loop was given max_new_tokens = -4."""
    ids, mask = prompts_for(2, seed=5)
    criteria = StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] - 2)])
    reference, ours = both(target, ids, mask, 2, 5, max_new_tokens=6, stopping_criteria=criteria)
    assert reference.shape[1] == ids.shape[1] + 1 and torch.equal(ours, reference)


# --------------------------------------------------------------------------------------------- sampling law


@pytest.fixture(scope="module")
def tiny_vocab_target():
    return make_target(vocab=8, unpadded=4, hidden=32, mlp=("dense", "dense"), seed=3, init=0.3, mup=1.0)


def processed_laws(target, prompt, n, processors):
    """The law of each next token after prompt + x_1..x_j (j < n) under generate's ``processors`` (softmax of the
    processed scores, exactly what generate samples from), as tensors [V] * (j + 1); and the joint law."""
    vocab = target.config.unpadded_vocab_size
    laws = []
    for j in range(n):
        prefixes = torch.cartesian_prod(*[torch.arange(vocab)] * j).reshape(-1, j) if j else torch.zeros(1, 0)
        ids = torch.cat([torch.tensor([prompt]).expand(len(prefixes), -1), prefixes.long()], dim=1)
        scores = processors(ids, target(input_ids=ids).logits[:, -1].float())
        laws.append(scores.softmax(-1).view(*[vocab] * (j + 1)))
    joint = laws[0]
    for law in laws[1:]:
        joint = joint[..., None] * law
    return laws, joint


def test_sampling_with_top_k_and_top_p_follows_the_processed_target_law(tiny_vocab_target):
    """do_sample with temperature, top-k and top-p: generate's processors act on the target's and the drafts'
    distributions (the drafts re-drawn by coupling), and 4000 rows of K = 3 rounds follow generate's own law."""
    target, prompt = tiny_vocab_target, [1, 3, 2, 3]  # no 0: generate would take it for padding
    options = dict(temperature=0.9, top_k=3, top_p=0.9)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(3), TopPLogitsWarper(0.9)])
    laws, joint = processed_laws(target, prompt, NEW, processors)
    raw_laws, _ = processed_laws(target, prompt, NEW, LogitsProcessorList([TemperatureLogitsWarper(0.9)]))
    drafter = SamplingDrafter(raw_laws, len(prompt), {1, 2}, 4, 4000)  # q: tempered but not truncated, mixed
    out = target.generate(torch.tensor([prompt] * 4000), do_sample=True, max_new_tokens=NEW,
                          custom_generate=custom_generate, drafter=drafter,
                          generator=torch.Generator().manual_seed(3), return_dict_in_generate=True, **options)
    samples = out.sequences[:, len(prompt):]
    assert 0 < out.speculative.acceptance_rate < 1 and out.speculative.num_rounds > 1
    assert chi_square_pvalue(samples, joint) > 1e-3
    raw_joint = processed_laws(target, prompt, NEW, LogitsProcessorList([TemperatureLogitsWarper(0.9)]))[1]
    assert chi_square_pvalue(samples, raw_joint) < 1e-6  # the bound can fail: the untruncated law is rejected


def test_a_drafter_returning_other_than_its_k_drafts_is_refused(target):
    class TooMany(KStandInDrafter):
        def draft(self, *args, **kwargs):
            result = super().draft(*args, **kwargs)
            result.drafts = torch.cat([result.drafts, result.drafts[:, :1]], dim=1)
            return result

    with pytest.raises(ValueError, match=r"returned drafts of shape \(1, 3\), expected \[1, 2\]"):
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, custom_generate=custom_generate,
                        drafter=TooMany(2, 120, oracle=[{}]))
