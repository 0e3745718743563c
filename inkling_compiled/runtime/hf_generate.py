"""Our speculative decoding behind transformers' own ``generate``: ``target.generate(**inputs,
custom_generate=custom_generate, drafter=drafter, ...)`` (docs/protocol.md §6.11).

``generate`` prepares the inputs, the generation config, the logits processors and the stopping criteria, encodes
images once (``mm_encoder_outputs``), then calls :func:`custom_generate` instead of its own decoding loop. This
module maps what it prepared onto the loop of ``speculative.py``: the processors become the
:class:`~inkling_compiled.runtime.speculative.Decoding`'s scores (for the target's tokens and, when sampling, the
drafts'), ``max_length`` / EOS / pad are the loop's own, every other stopping criterion is checked after each
emitted token, and the streamer is given the tokens as the rows commit them. Anything it cannot honour is refused by
name before any model call.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass

import torch
from transformers import GenerationMixin
from transformers.generation import (
    EosTokenCriteria,
    GenerateDecoderOnlyOutput,
    GenerationMode,
    LogitsProcessorList,
    MaxLengthCriteria,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
)

from .. import arguments
from ..arguments import ArgumentError
from .multimodal import MULTIMODAL_KWARGS, merged_rows
from .speculative import Decoding, SpeculativeOutput, _validate, run_loop

__all__ = ["SpeculativeGenerateOutput", "custom_generate"]

# transformers' processors that act on each row alone, from its own tokens and scores: the loop can apply them at
# any position of any row. Those that read only the scores need no context at all (one call per round).
CONTEXT_FREE_PROCESSORS = {"TemperatureLogitsWarper", "TopPLogitsWarper", "TopKLogitsWarper", "TopHLogitsWarper",
                           "MinPLogitsWarper", "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper",
                           "InfNanRemoveLogitsProcessor", "LogitNormalization", "SuppressTokensLogitsProcessor"}
ROW_PROCESSORS = CONTEXT_FREE_PROCESSORS | {
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "RepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor", "SequenceBiasLogitsProcessor", "NoBadWordsLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor", "ExponentialDecayLengthPenalty",
    "SuppressTokensAtBeginLogitsProcessor", "WatermarkLogitsProcessor"}
# model kwargs generate passes that the loop derives itself (position ids from the mask) or does not need
DERIVED_KWARGS = {"attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep"}
UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
# the flags that select generate's other one-beam decoding modes
MODE_FLAGS = {GenerationMode.CONTRASTIVE_SEARCH: "penalty_alpha", GenerationMode.DOLA_GENERATION: "dola_layers",
              GenerationMode.CONSTRAINED_BEAM_SEARCH: "constraints / force_words_ids"}


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """``generate``'s output with ``return_dict_in_generate=True``, plus ``speculative``: the acceptance statistics
    of the run (:class:`~inkling_compiled.runtime.speculative.SpeculativeOutput`). The target cache is not returned
    (``cache`` is None): its rows were rolled back per row and masked, which only this loop's mask describes."""

    speculative: SpeculativeOutput | None = None


def custom_generate(model, input_ids: torch.Tensor, logits_processor: LogitsProcessorList,
                    stopping_criteria: StoppingCriteriaList, generation_config, synced_gpus: bool = False,
                    streamer=None, *, drafter=None, generator: torch.Generator | None = None, lockstep: bool = False,
                    **model_kwargs):
    """The decoding method ``generate(custom_generate=custom_generate, drafter=...)`` calls: greedy or sampled
    speculative decoding of ``model`` (a transformers Inkling target) with ``drafter`` (a
    :class:`~inkling_compiled.runtime.drafter.Drafter`), honouring what ``generate`` prepared.

    Returns what ``generate`` returns: the sequences [B, L + n], or with ``return_dict_in_generate=True`` a
    :class:`SpeculativeGenerateOutput`. ``generator`` seeds the loop's draws (sampling); ``lockstep`` as in
    ``speculative_generate``. Raises ArgumentError naming any option it cannot honour.
    """
    streamer, synced_gpus, assistant = _generate_call_arguments(streamer, synced_gpus)
    try:
        return _custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                                streamer, assistant, drafter, generator, lockstep, model_kwargs)
    except BaseException:
        if streamer is not None:  # generate gave it the prompt already: a consumer thread would wait for ever
            streamer.end()
        raise


def _custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
                     assistant, drafter, generator, lockstep, model_kwargs):
    if not hasattr(generation_config, "_pad_token_tensor"):  # generate's _prepare_special_tokens sets it
        raise ArgumentError("custom_generate takes the generation config that generate prepares: call "
                            "target.generate(..., custom_generate=custom_generate, drafter=...), not it directly")
    if drafter is None:
        raise ArgumentError("custom_generate needs a drafter: generate(..., custom_generate=custom_generate, "
                            "drafter=Drafter(...))")
    if input_ids.shape[1] == 0 or "inputs_embeds" in model_kwargs:  # before the other model inputs: named here
        raise ArgumentError("custom_generate needs input_ids (a prompt given as inputs_embeds is not supported)")
    _refuse_unsupported(generation_config, synced_gpus, assistant, model_kwargs)
    max_length = generation_config.max_length
    criteria = []
    eos = None  # every EosTokenCriteria's ids: generate stops a row at any of them
    for criterion in stopping_criteria:
        if isinstance(criterion, MaxLengthCriteria):
            max_length = min(max_length, criterion.max_length)
        elif isinstance(criterion, EosTokenCriteria):
            eos = list(dict.fromkeys([*(eos or []), *criterion.eos_token_id.reshape(-1).tolist()]))
        elif type(criterion).__name__ == "ConfidenceCriteria":
            raise ArgumentError("stopping_criteria: custom_generate cannot honour ConfidenceCriteria (assisted "
                                "decoding's, it reads scores)")
        else:
            criteria.append(criterion)
    # generate's loop emits a token before it asks any criterion, so a MaxLengthCriteria of the caller's at or below
    # the prompt's width still gets one (generate itself refuses such a max_length of the config, before us)
    max_new_tokens = max(1, max_length - input_ids.shape[1])
    do_sample = bool(generation_config.do_sample)
    draft_temperature = _draft_temperature(logits_processor) if do_sample else 0.0
    pad = generation_config._pad_token_tensor
    media = {name: model_kwargs.get(name) for name in MULTIMODAL_KWARGS}
    copies, most = generation_config.num_return_sequences or 1, getattr(drafter, "max_batch_size", None)
    if copies > 1 and isinstance(most, int) and input_ids.shape[0] > most:  # the loop's message names only B x n
        raise ArgumentError(f"batch size {input_ids.shape[0]} ({input_ids.shape[0] // copies} prompts x "
                            f"num_return_sequences={copies}) exceeds the drafter's max_batch_size {most}")
    input_ids, attention_mask, eos, pad = _validate(model, drafter, input_ids, model_kwargs.get("attention_mask"),
                                                    max_new_tokens, draft_temperature, 1.0, generator, lockstep, eos,
                                                    None if pad is None else int(pad), media)
    beyond_temperature = LogitsProcessorList(p for p in logits_processor if not isinstance(p, TemperatureLogitsWarper))
    decoding = Decoding(
        greedy=not do_sample, draft_temperature=draft_temperature,
        scores=_processor_scores(logits_processor) if len(logits_processor) else None,
        needs_context=any(type(p).__name__ not in CONTEXT_FREE_PROCESSORS for p in logits_processor),
        draft_scores=_processor_scores(beyond_temperature) if do_sample and len(beyond_temperature) else None,
        stop=(lambda sequences: StoppingCriteriaList(criteria)(sequences, None)) if criteria else None,
        pad_after_stop=_pads_after_stop(stopping_criteria), streamer=streamer)
    with torch.no_grad():
        rows = merged_rows(model, input_ids, **media)
        out = run_loop(model, drafter, input_ids, attention_mask, decoding,
                       max_new_tokens=max_new_tokens, eos=eos, pad_token_id=pad,
                       generator=generator, lockstep=lockstep, rows=rows)
    if generation_config.return_dict_in_generate:
        return SpeculativeGenerateOutput(sequences=out.sequences, speculative=out)
    return out.sequences


def _generate_call_arguments(streamer, synced_gpus):
    """(streamer, synced_gpus, assistant_model) of the ``generate`` call that called us. transformers (5.23-5.24)
    hands a ``custom_generate`` callable only the keyword arguments its signature adds to ``_sample``'s, so it
    never passes the streamer or ``synced_gpus`` on (after putting the prompt into the streamer itself); they are
    read from the calling ``generate`` frame then, so that a streamer is driven rather than silently dropped."""
    frame = sys._getframe(2)  # custom_generate's caller
    if frame.f_code.co_name != "generate" or not isinstance(frame.f_locals.get("self"), GenerationMixin):
        return streamer, synced_gpus, None  # called directly, not from generate
    found = frame.f_locals
    return (streamer if streamer is not None else found.get("streamer"), bool(synced_gpus or found.get("synced_gpus")),
            found.get("assistant_model"))


def _refuse_unsupported(generation_config, synced_gpus, assistant, model_kwargs) -> None:
    if generation_config.num_beams != 1:
        raise ArgumentError(f"custom_generate cannot honour num_beams={generation_config.num_beams} (beam search)")
    if assistant is not None or generation_config.prompt_lookup_num_tokens is not None or \
            getattr(generation_config, "assistant_early_exit", None) is not None:
        raise ArgumentError("custom_generate drafts with its own drafter: leave out assistant_model / "
                            "prompt_lookup_num_tokens / assistant_early_exit")
    mode = _decoding_mode(generation_config)
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):  # generate refuses these only without us
        raise ArgumentError(f"custom_generate runs greedy or sampled decoding, not {mode.value.replace('_', ' ')} "
                            f"(leave out {MODE_FLAGS.get(mode, 'its flags')})")
    if synced_gpus:
        raise ArgumentError("custom_generate cannot honour synced_gpus=True")
    if generation_config.return_dict_in_generate:
        wanted = [name for name in UNSUPPORTED_OUTPUTS if getattr(generation_config, name, False)]
        if wanted:
            raise ArgumentError(f"custom_generate cannot return {', '.join(wanted)} (it runs no one-token steps)")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise ArgumentError("custom_generate starts from the prompt: a cache holding tokens cannot be continued")
    unknown = sorted(set(model_kwargs) - DERIVED_KWARGS - set(MULTIMODAL_KWARGS))
    if unknown:
        raise ArgumentError(f"custom_generate cannot honour the model inputs {unknown}")


def _decoding_mode(generation_config) -> GenerationMode:
    """generate's decoding mode for these flags, ``use_mtp`` aside (the drafter is the MTP, whichever the flag)."""
    config = copy.copy(generation_config)
    config.use_mtp = False
    return config.get_generation_mode()


def _pads_after_stop(stopping_criteria: StoppingCriteriaList) -> bool:
    """Whether ``generate`` pads a row after any stop: its sampling loop does so whenever a criterion holds an
    ``eos_token_id`` (the EosTokenCriteria it adds even for ``eos_token_id=[]``), whatever the ids are."""
    return any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)


def _draft_temperature(processors: LogitsProcessorList) -> float:
    """The temperature the drafter samples at: the processors' (so its q is tempered like p), else 1."""
    tempered = [p.temperature for p in processors if isinstance(p, TemperatureLogitsWarper)]
    temperature = float(tempered[-1]) if tempered else 1.0
    if 0 < temperature < arguments.MIN_TEMPERATURE:  # generate takes no temperature 0 with do_sample=True
        raise ArgumentError(f"temperature {temperature:g} is below {arguments.MIN_TEMPERATURE:g}: sampling there is "
                            "greedy decoding up to rounding, and 1 / temperature overflows float32; pass "
                            "do_sample=False")
    return temperature


def _processor_scores(processors: LogitsProcessorList):
    """(context, scores [n, V], batch rows [n] or None) -> processed scores, after checking every processor acts on
    each row alone. The one per-row state among transformers' processors, ``RepetitionPenaltyLogitsProcessor``'s
    ``prompt_ignore_length`` tensor [B] (generate's prompt padding lengths), is cut to the given rows; any other
    processor sees only the n rows' tokens and scores."""
    for processor in processors:
        name = type(processor).__name__
        from_transformers = type(processor).__module__.startswith("transformers.")
        if from_transformers and name not in ROW_PROCESSORS:
            raise ArgumentError(f"custom_generate cannot honour the logits processor {name} (it is not a function of "
                                "each row's own tokens and scores)")

    def scores_of(context, scores, rows):
        scores = scores.float()
        for processor in processors:
            scores = (processor if rows is None else _for_rows(processor, rows))(context, scores)
        return scores

    return scores_of


def _for_rows(processor, rows: torch.Tensor):
    """``processor`` as applied to the batch rows ``rows`` alone: a copy holding their ``prompt_ignore_length``
    entries when it is a repetition penalty given per row, else ``processor`` itself."""
    ignore = getattr(processor, "prompt_ignore_length", None)
    if not (isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(ignore, torch.Tensor)):
        return processor
    processor = copy.copy(processor)
    processor.prompt_ignore_length = ignore[rows.to(ignore.device)]
    return processor
