"""Speculative decoding with the Inkling MTP draft head around a transformers Inkling target, K drafts per round:
:func:`speculative_generate` (prefill, verify, per-row accept / reject or ``lockstep``, the per-row rollback of the
target's cache, finished rows leaving the batch) and its statistics. The protocol and why it is lossless are in
docs/protocol.md §6.3-§6.5, §6.7, §6.9; the loop's contract with its drafter and its host syncs in §6.10.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import arguments
from ..arguments import ArgumentError
from ..config import logits_vocab_size
from ..hf_compat import cache_argument
from ..model.mtp import InklingMTP
from ..model.tensor_parallel import CHECKSUM, checksum
from .drafter import Drafter, DraftResult, DraftSource
from .multimodal import check_drafter_takes_rows, merged_rows
from .target_cache import rollback_rows, select_rows

__all__ = ["SpeculativeOutput", "speculative_generate", "target_distribution"]


@dataclass
class SpeculativeOutput:
    """Result of :func:`speculative_generate`.

    ``sequences``: ``[B, L + n]`` (the left-padded prompt followed by the ``n <= max_new_tokens`` new columns, rows
    that finished early padded). Counts are per unfinished row and round, each row counting the drafts *it* accepted
    (its longest accepted prefix, before a lockstep cut). ``acceptance_rate`` = accepted drafts / drafted.
    ``acceptance_per_position[j]`` = the fraction of (row, round) pairs in which draft ``j + 1`` was accepted
    together with every draft before it (vLLM's per-position acceptance; with K = 1 it is ``[acceptance_rate]``).
    ``mean_accepted_length`` = tokens the rows emitted in verify rounds / (row, round) pairs, i.e. tokens per
    sequence per target forward, the bonus / corrected token included (vLLM's "acceptance length"); per row it is
    ``1 + sum(acceptance_per_position)`` up to the final truncation, with ``lockstep=True`` it is what the batch's
    cut left. The prefill's first token is not counted. Per round: ``drafted_per_round`` (K x unfinished rows),
    ``accepted_per_round`` (their accepted drafts), ``accepted_per_position_per_round`` (K counts: rows whose first
    j + 1 drafts were accepted), ``emitted_per_round`` (tokens the rows emitted, summed over rows). Only the emitted
    counts are clipped to what ``sequences`` holds: drafted, accepted and the (row, round) pairs count every round
    the target verified, a row's rounds past the final cut included, so ``mean_accepted_length`` is the tokens kept
    per row-forward spent and ``acceptance_rate`` is the verifier's, not the output's.
    """

    sequences: torch.LongTensor
    num_new_tokens: int
    num_rounds: int
    num_drafted: int
    num_accepted: int
    acceptance_rate: float
    mean_accepted_length: float
    num_speculative_tokens: int = 1
    acceptance_per_position: list[float] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    accepted_per_position_per_round: list[list[int]] = field(default_factory=list)
    emitted_per_round: list[int] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------------------------
# target side


def _text_config(target):
    config = target.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _target_step(target, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache, *, last_only: bool,
                 dtype: torch.dtype | None = None, inputs_embeds: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over ``input_ids`` [B, T] (or their merged multimodal rows ``inputs_embeds``) continuing
    ``cache``.

    Returns (post-final-norm hidden [B, T, H], in ``dtype`` when given, float32 logits [B, T or 1, V]); the logits
    are computed with exactly the operations of the target's own forward (hidden / muP -> lm_head -> drop the padded
    vocabulary rows), from the hidden in the target's own dtype.
    """
    model = target.model
    inputs = {"input_ids": input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
    out = model(**inputs, attention_mask=attention_mask, use_cache=True, **{cache_argument(model): cache})
    hidden = out.last_hidden_state
    text = _text_config(target)
    scaled = hidden / text.logits_mup_width_multiplier
    if last_only:
        scaled = scaled[:, -1:, :]
    logits = target.lm_head(scaled)
    unpadded = text.unpadded_vocab_size
    if unpadded is not None and unpadded < logits.shape[-1]:
        logits = logits[..., :unpadded]
    return (hidden if dtype is None else hidden.to(dtype)), logits.float()


def target_distribution(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The processed target distribution p: ``softmax(top_p(logits / temperature))`` over the last dim (float32).

    Top-p keeps the smallest set of most probable tokens whose mass reaches ``top_p`` (a token is dropped when the
    mass of the tokens ranked strictly above it is already >= top_p; the most probable token is always kept).
    """
    return temperature_top_p_scores(logits, temperature, top_p).softmax(dim=-1)


def temperature_top_p_scores(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """``top_p(logits / temperature)`` in float32: the scores whose softmax is :func:`target_distribution`."""
    scaled = logits.float() / temperature
    if top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_above >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from (possibly unnormalized) ``probs`` [..., V], without a host sync (exponential race)."""
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / race).argmax(dim=-1)


def _accept_mask(p_draft: torch.Tensor, q_draft: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Speculative-sampling acceptance: accept with probability min(1, p(d) / q(d)) (``u * q < p``, u ~ U[0, 1))."""
    return uniform * q_draft < p_draft


def _verify_sampled(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, generator: torch.Generator | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept/reject ``draft`` [...] (sampled from ``q`` [..., V]) against the target distribution ``p`` [..., V].

    Returns (accepted [...] bool, token [...]): the draft when accepted, else a sample of normalize(max(0, p - q)).
    Every position is decided independently; the caller keeps the tokens up to the first rejection.
    """
    p_d = p.gather(-1, draft[..., None]).squeeze(-1)
    q_d = q.gather(-1, draft[..., None]).squeeze(-1).to(p.dtype)
    uniform = torch.rand(p_d.shape, generator=generator, device=p.device, dtype=p.dtype)
    accepted = _accept_mask(p_d, q_d, uniform)
    residual = (p - q.to(p.dtype)).clamp_min(0.0)
    # p == q up to rounding: rejection then has (near) zero probability; fall back to p to stay well defined.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    return accepted, torch.where(accepted, draft, _sample(residual, generator))


# --------------------------------------------------------------------------------------------------------------------
# validation


def _validate(target, drafter, input_ids, attention_mask, max_new_tokens, temperature, top_p, generator, lockstep,
              eos_token_id, pad_token_id, media: dict) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """Check every argument before any model call; return (input_ids, attention_mask) as int64 tensors, the EOS
    ids and the pad id (checked whether or not an EOS is given: it is also the token of the drafter's padding rows
    when rows keep different numbers of tokens). ``media``: the image / audio inputs given (their contents are
    checked where the target's rows are merged). A tensor-parallel drafter's ranks compare them all in one exchange
    (:meth:`TensorParallel.agree`): the ranks split the weights, so each must decode the same batch."""
    def checked():
        validated = _checked_arguments(target, drafter, input_ids, attention_mask, max_new_tokens, temperature,
                                       top_p, generator, lockstep, eos_token_id, pad_token_id)
        check_drafter_takes_rows(drafter, media)
        return validated

    def run():
        validated = checked()
        return validated, _generation_fields(*validated, max_new_tokens, temperature, top_p, generator, lockstep,
                                             media)

    parallel = getattr(getattr(drafter, "model", None), "parallel", None)
    if parallel is None:
        return checked()
    return parallel.agree("speculative decoding's arguments", GENERATION_FIELDS, run, fix="Every rank passes the "
                          "same prompt and options, and a generator seeded alike.")


# What tensor-parallel ranks compare of a generation's arguments (the prompt's padding aside: it reaches no output)
GENERATION_FIELDS = ("batch", "prompt length", "max_new_tokens", "pad_token_id", CHECKSUM + "input_ids",
                     CHECKSUM + "attention_mask", CHECKSUM + "the EOS ids", CHECKSUM + "temperature, top_p, lockstep",
                     CHECKSUM + "the generator's state", CHECKSUM + "the image / audio inputs")


def _generation_fields(input_ids, attention_mask, eos, pad, max_new_tokens, temperature, top_p, generator, lockstep,
                       media) -> dict:
    options = torch.tensor([float(temperature), float(top_p), float(lockstep)], dtype=torch.float64)
    state = generator.get_state() if generator is not None else torch.zeros(0, dtype=torch.uint8)
    given = [t for value in media.values() for t in _tensors(value)]
    return {"batch": input_ids.shape[0], "prompt length": input_ids.shape[1], "max_new_tokens": max_new_tokens,
            "pad_token_id": pad, CHECKSUM + "input_ids": checksum(input_ids * attention_mask),
            CHECKSUM + "attention_mask": checksum(attention_mask), CHECKSUM + "the EOS ids": checksum(
                torch.tensor(eos, dtype=torch.long)), CHECKSUM + "temperature, top_p, lockstep": checksum(options),
            CHECKSUM + "the generator's state": checksum(state), CHECKSUM + "the image / audio inputs": sum(
                (checksum(t).cpu() for t in given), torch.tensor(len(given)))}


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in a multimodal argument: itself, or a dict's / vision output's values, one level down."""
    if isinstance(value, torch.Tensor):
        return [value]
    inner = value.values() if isinstance(value, Mapping) else ()  # a ModelOutput is a Mapping too
    return [v for v in inner if isinstance(v, torch.Tensor)]


def _checked_arguments(target, drafter, input_ids, attention_mask, max_new_tokens, temperature, top_p, generator,
                       lockstep, eos_token_id, pad_token_id) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    if not isinstance(target, nn.Module) or not hasattr(getattr(target, "config", None), "get_text_config"):
        raise ArgumentError(f"target must be a transformers Inkling model (InklingForCausalLM or "
                            f"InklingForConditionalGeneration), got {type(target).__name__}")
    if not isinstance(drafter, DraftSource):
        raise ArgumentError(f"drafter must follow the DraftSource protocol (draft, max_batch_size, "
                            f"max_length, num_speculative_tokens), got {type(drafter).__name__}")
    for name in ("max_batch_size", "max_length", "num_speculative_tokens"):  # a drafter of the caller's own
        arguments.positive_int(f"drafter.{name}", getattr(drafter, name))
    arguments.positive_int("max_new_tokens", max_new_tokens)
    arguments.temperature(temperature)
    arguments.check_bool("lockstep", lockstep)
    arguments.top_p(top_p)
    input_ids = arguments.integer_tensor("input_ids", input_ids, ndim=2)
    batch, length = input_ids.shape
    if batch < 1 or length < 1:
        raise ArgumentError(f"input_ids must be non-empty, got shape {tuple(input_ids.shape)}")
    first = next(target.parameters())
    target_device, target_dtype = first.device, first.dtype
    if target_dtype not in (torch.float32, torch.bfloat16, torch.float16):  # the drafter gets its hiddens cast
        raise ArgumentError(f"the target runs in {target_dtype}; speculative decoding takes a float32, bfloat16 or "
                            f"float16 target")
    if input_ids.device != target_device:
        raise ArgumentError(f"input_ids are on {input_ids.device}, the target on {target_device}")
    draft_model = getattr(drafter, "model", None)
    draft_device = getattr(draft_model, "device", target_device)
    if draft_device != target_device:
        raise ArgumentError(f"the drafter's model is on {draft_device}, the target on {target_device}")
    if isinstance(draft_model, InklingMTP):  # what the drafter would check on every call, checked once here
        draft_model.check_parameters()
    if isinstance(drafter, Drafter):
        drafter.check_model_unchanged()
    arguments.generator(generator, target_device)
    text = _text_config(target)
    eos = arguments.token_ids("eos_token_id", eos_token_id, text.vocab_size)
    pad = arguments.token_id("pad_token_id", (eos[0] if eos else 0) if pad_token_id is None else pad_token_id,
                             text.vocab_size, " (finished rows feed it to the target, padding rows to the drafter)")
    # every id is embedded, padding included: one outside the table is an index error (on CUDA, a device assert)
    arguments.ids_below("input_ids", input_ids, text.vocab_size, "the target's vocabulary", what="token id")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.long)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ArgumentError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {got}")
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:  # an additive mask is 0 / -inf
        raise ArgumentError(f"attention_mask must be an integer or bool tensor of 0s and 1s, got "
                            f"{attention_mask.dtype}")
    mask_cpu = attention_mask.cpu()
    if not bool(((mask_cpu == 0) | (mask_cpu == 1)).all()):
        raise ArgumentError("attention_mask must contain only 0 and 1")
    attention_mask, mask_cpu = attention_mask.to(device=input_ids.device, dtype=torch.long), mask_cpu.long()
    unpadded = (mask_cpu[:, 1:] < mask_cpu[:, :-1]).any(dim=1)
    if bool(unpadded.any()):
        raise ArgumentError(f"attention_mask must be left-padded (zeros, then ones, in every row), got row "
                            f"{int(unpadded.nonzero()[0])}: {mask_cpu[int(unpadded.nonzero()[0])].tolist()}")
    real = mask_cpu.sum(dim=1)
    if bool((real == 0).any()):
        raise ArgumentError(f"every sequence needs at least one real (attention_mask == 1) prompt token, got none in "
                            f"row {int((real == 0).nonzero()[0])}")
    if batch > drafter.max_batch_size:
        raise ArgumentError(f"batch size {batch} exceeds the drafter's max_batch_size {drafter.max_batch_size}")
    longest = int(real.max())
    if longest > drafter.max_length:
        raise ArgumentError(f"prompt of {longest} tokens is longer than the drafter's max_length {drafter.max_length}")
    # Drafter rows go up to position prompt + max_new_tokens - 2 (the row carrying the last emitted token).
    if longest + max_new_tokens - 1 > drafter.max_length:
        raise ArgumentError(
            f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} - 1 exceeds the drafter's max_length "
            f"{drafter.max_length}; build the Drafter with max_length >= {longest + max_new_tokens - 1}")
    logits_vocab = logits_vocab_size(text)
    draft_config = getattr(draft_model, "config", None)
    draft_vocab = getattr(draft_config, "logits_vocab_size", None)
    if draft_vocab is not None and draft_vocab != logits_vocab:
        raise ArgumentError(f"drafter logits vocabulary {draft_vocab} != target logits vocabulary {logits_vocab}")
    draft_table = getattr(draft_config, "vocab_size", None)
    if draft_table is not None and draft_table < text.vocab_size:  # every id the target takes is embedded
        raise ArgumentError(f"drafter embedding table has {draft_table} rows, fewer than the target's vocabulary "
                            f"{text.vocab_size}")
    draft_hidden = getattr(draft_config, "hidden_size", None)
    if draft_hidden is not None and draft_hidden != text.hidden_size:
        raise ArgumentError(f"drafter hidden size {draft_hidden} != target hidden size {text.hidden_size}")
    return input_ids, attention_mask, eos, pad


# --------------------------------------------------------------------------------------------------------------------
# the loop


def speculative_generate(target, drafter: DraftSource, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor | None = None, *,
                         max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                         eos_token_id: int | list[int] | torch.Tensor | None = None, pad_token_id: int | None = None,
                         generator: torch.Generator | None = None, lockstep: bool = False,
                         pixel_values: torch.Tensor | None = None, audio_input_ids: torch.Tensor | None = None,
                         audio_input_ids_mask: torch.Tensor | None = None,
                         mm_encoder_outputs: dict | None = None) -> SpeculativeOutput:
    """Generate up to ``max_new_tokens`` tokens per sequence with MTP speculative decoding, as many drafts per round
    as the drafter proposes (``Drafter(num_speculative_tokens=K)``; docs/protocol.md §6.10; behind generate: §6.11).

    ``input_ids`` [B, L] is left-padded as described by ``attention_mask`` (1 = real token); ``temperature == 0``
    is greedy (``top_p`` ignored), otherwise tokens follow ``softmax(top_p(logits / temperature))`` exactly.
    ``eos_token_id`` (one id or several) ends a row at its first EOS, padded with ``pad_token_id`` after; None: no
    EOS, whatever the target's generation config says (``generate(custom_generate=...)`` reads that one).
    ``generator`` (on the target's device) drives every random draw of the loop and is passed to the drafter.
    Each sequence advances by its own accepted length; ``lockstep=True`` advances the batch by its shortest one (the
    benchmark's baseline; same tokens, more rounds). ``pixel_values`` / ``audio_input_ids`` (with their
    ``audio_input_ids_mask``) / ``mm_encoder_outputs`` are the target's multimodal inputs, as ``generate`` takes
    them: the target's prefill reads the merged rows, and so does the drafter's (docs/model.md §7). Raises
    ``ArgumentError`` on bad arguments before any model call.
    """
    media = {"pixel_values": pixel_values, "audio_input_ids": audio_input_ids,
             "audio_input_ids_mask": audio_input_ids_mask, "mm_encoder_outputs": mm_encoder_outputs}
    input_ids, attention_mask, eos, pad_token_id = _validate(target, drafter, input_ids, attention_mask,
                                                             max_new_tokens, temperature, top_p, generator, lockstep,
                                                             eos_token_id, pad_token_id, media)
    if temperature == 0:
        decoding = Decoding()
    else:
        decoding = Decoding(greedy=False, draft_temperature=float(temperature),
                            scores=lambda context, logits, rows: temperature_top_p_scores(logits, temperature, top_p))
    with torch.no_grad():
        rows = merged_rows(target, input_ids, **media)
        return run_loop(target, drafter, input_ids, attention_mask, decoding, max_new_tokens=max_new_tokens, eos=eos,
                        pad_token_id=pad_token_id, generator=generator, lockstep=lockstep, rows=rows)


@dataclass(frozen=True)
class Decoding:
    """How the loop turns the target's logits (and the draft's distributions) into tokens, and what else ends a row:
    :func:`speculative_generate`'s temperature / top-p, or ``generate``'s logits processors and stopping criteria
    (runtime/hf_generate.py).

    ``scores(context, logits [n, V], rows)`` gives the processed scores the token is the argmax of (greedy) or
    sampled from the softmax of; ``context`` [n, L] holds each row's tokens before that position (its left-padded
    prompt, then its new tokens) and ``rows`` [n] their batch rows, both passed only with ``needs_context`` (else
    None, one call for every row and column). ``draft_scores`` processes each draft's log-distribution the same way
    (sampling); the draft is then re-drawn from it by a maximal coupling, so it stays the drafter's token whenever
    it can. ``stop(sequences [n, L]) -> bool [n]`` is a stopping
    criterion checked after every emitted token; with ``pad_after_stop`` a row it ends is finished (padding after),
    without it (``generate`` with no EOS criterion) the row goes on until every row has been stopped once.
    """

    greedy: bool = True
    draft_temperature: float = 0.0
    scores: Callable[[torch.Tensor | None, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
    needs_context: bool = False
    draft_scores: Callable[[torch.Tensor | None, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
    stop: Callable[[torch.Tensor], torch.Tensor] | None = None
    pad_after_stop: bool = True
    streamer: object | None = None


class _Batch:
    """Every row's output: the left-padded prompt and the new tokens (device), each row's count and limit (host,
    mirrored on the device), which rows are done, what the streamer has been given, the per-round statistics."""

    def __init__(self, prompt: torch.Tensor, max_new_tokens: int, k: int, pad_token_id: int,
                 checked_vocab: int | None = None):
        batch = prompt.shape[0]
        self.prompt, self.pad, self.k = prompt, pad_token_id, k
        self.checked_vocab = checked_vocab  # a drafter not our own: its drafts are checked to lie in [0, V)
        self.out = torch.full((batch, max_new_tokens + k + 1), pad_token_id, dtype=torch.long, device=prompt.device)
        self.count = torch.zeros(batch, dtype=torch.long, device=prompt.device)
        self.counts, self.limits = [0] * batch, [max_new_tokens] * batch
        self.limit = torch.full((batch,), max_new_tokens, dtype=torch.long, device=prompt.device)
        self.done = [False] * batch
        self.stopped_at: list[int | None] = [None] * batch  # without pad_after_stop: the new-token count at the stop
        self.streamed = 0
        self.stats: list[torch.Tensor] = []  # per verify round: drafted, accepted, accepted per position (device)
        self.emitted: list[list[tuple[int, int, int]]] = [[] for _ in range(batch)]  # per row: (round, before, new)

    def contexts(self, rows: list[int], extra: torch.Tensor):
        """(indices into ``rows``, their batch rows, tokens [n, L + count + j]) per group of rows with equal counts:
        each row's prompt, new tokens, then its ``extra`` [len(rows), j] tokens."""
        groups: dict[int, list[int]] = {}
        for i, b in enumerate(rows):
            groups.setdefault(self.counts[b], []).append(i)
        for count, members in groups.items():
            index = torch.tensor(members, device=extra.device)
            batch_rows = torch.tensor([rows[i] for i in members], device=extra.device)
            yield index, batch_rows, torch.cat([self.prompt[batch_rows], self.out[batch_rows, :count], extra[index]],
                                               dim=1)

    def width(self) -> int:
        return min(max(self.counts), max(self.limits))

    def emitted_per_round(self) -> list[int]:
        """Each verify round's new tokens that the output holds: without ``pad_after_stop`` the rows run on to the
        last row's stop and are then all cut there, and what a row emitted past that cut counts in no round."""
        per_round, width = [0] * len(self.stats), self.width()
        for rounds in self.emitted:
            for r, before, new in rounds:
                per_round[r] += max(0, min(new, width - before))
        return per_round


@dataclass
class _Live:
    """The unfinished rows, in the target's batch order: their batch indices (device, and host in ``index``), x_F
    (not yet in the target cache) and its position F, the target's attention mask, the drafts and their
    distributions."""

    rows: torch.Tensor
    index: list[int]
    last: torch.Tensor
    last_pos: torch.Tensor
    mask: torch.Tensor
    drafts: torch.Tensor | None = None
    q: torch.Tensor | None = None

    def keep(self, cache, kept: list[int]) -> _Live:
        """The rows at ``kept`` (positions in this batch), the target cache cut to them."""
        at = torch.tensor(kept, device=self.rows.device)
        select_rows(cache, at)
        return _Live(self.rows[at], [self.index[i] for i in kept], *(None if t is None else t[at] for t in
                                                                     (self.last, self.last_pos, self.mask,
                                                                      self.drafts, self.q)))


def run_loop(target, drafter, input_ids, attention_mask, decoding: Decoding, *, max_new_tokens: int, eos: list[int],
             pad_token_id: int, generator, lockstep: bool, rows: torch.Tensor | None = None) -> SpeculativeOutput:
    """The speculative loop over validated inputs: prefill, then rounds of verify, emit, advance (and draft)."""
    device = input_ids.device
    eos_t = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
    # A drafter may run in another dtype than the target (a bf16 / int8 draft head beside an fp32 target, holding its
    # own copy of the shared tensors): it gets the target's hiddens in its own dtype.
    draft_dtype = getattr(getattr(drafter, "model", None), "dtype", None)
    k = drafter.num_speculative_tokens
    vocab = None if isinstance(drafter, Drafter) else logits_vocab_size(_text_config(target))
    batch = _Batch(input_ids, max_new_tokens, k, pad_token_id, vocab)
    cache = _new_cache(target)
    live, hidden, goes = _prefill(target, input_ids, attention_mask, rows, cache, batch, decoding, eos_t, generator,
                                  draft_dtype)
    if live is not None:  # depth k of the prompt's row t reads x_{t+k+1}: the prompt shifted once, then x_L
        length = input_ids.shape[1]
        positions = torch.arange(length, device=device)[None, :] - (length - attention_mask.sum(dim=1))[:, None]
        draft_rows = None if rows is None else torch.cat([rows[:, 1:], _embed(target, live.last)], dim=1)
        result = _draft(drafter, decoding, torch.cat([input_ids[:, 1:], live.last], dim=1), positions, hidden,
                        draft_rows, generator)
        if not all(goes):
            live = live.keep(cache, [b for b, g in enumerate(goes) if g])
        live = _with_proposals(live, result, decoding, batch, generator)
        reach = _rows_reach(target, input_ids, attention_mask, rows, k)
        lockstep = lockstep or _storage_may_reach_log_scaling(target, length, max_new_tokens, k)
    while live is not None:
        hidden, tokens, accepted_len = _verify(target, live, cache, decoding, batch, generator, draft_dtype)
        keep = accepted_len + 1  # accepted drafts, then the row's correction (or bonus)
        if lockstep:  # every row keeps as many as the row that accepted the fewest
            keep = keep.amin().expand(len(live.index))
        # K > 1 re-runs up to K - 1 stored rows: while one reads a tower row of the prompt, the drafter gets rows too
        reads_prompt = any(batch.counts[b] <= reach[b] for b in live.index)
        kept, goes = _emit(batch, live, tokens, keep, decoding, eos_t, accepted_len=accepted_len)
        live = _advance(target, drafter, cache, live, hidden, tokens, kept, goes, decoding, batch, generator,
                        prompt_rows=reads_prompt)
    _stream(batch, decoding.streamer, final=True)
    return _output(input_ids, batch.out[:, :batch.width()], batch.stats, batch.emitted_per_round(), k)


def _rows_reach(target, input_ids, attention_mask, rows, k: int) -> list[int]:
    """Per row, the largest count of new tokens at which a round's re-run rows (up to K - 1 stored rows before the
    frontier F = L - 1 + count, reading positions from F - K + 2 on) still read a tower row of the prompt; -1 if
    none ever does (no multimodal rows, K = 1, or enough text after the last one)."""
    if rows is None or k == 1:
        return [-1] * input_ids.shape[0]
    tower = (rows != _embed(target, input_ids)).any(dim=-1) & attention_mask.bool()  # [B, L]
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = torch.where(tower, columns, -1).amax(dim=1)  # the last tower column of each row
    pad_left = input_ids.shape[1] - attention_mask.sum(dim=1)
    # the last tower position p (real position last - pad_left) is read while p >= L + count - K + 1
    reach = torch.where(last >= 0, last - pad_left - attention_mask.sum(dim=1) + k - 1, -1)
    return reach.tolist()


def _embed(target, input_ids: torch.Tensor) -> torch.Tensor:
    """The target's (normed) embedding of text tokens: the merged rows' value at a text position."""
    return target.get_input_embeddings()(input_ids)


def _scores(decoding: Decoding, batch: _Batch, rows: list[int], logits: torch.Tensor, fed: torch.Tensor
            ) -> torch.Tensor:
    """The processed scores of ``logits`` [R, T, V], column j following each row's tokens and ``fed[:, :j]``."""
    if decoding.scores is None:
        return logits
    if not decoding.needs_context:
        return decoding.scores(None, logits.reshape(-1, logits.shape[-1]), None).view(logits.shape)
    return torch.stack([_column_scores(decoding.scores, decoding, batch, rows, logits[:, j], fed[:, :j])
                        for j in range(logits.shape[1])], dim=1)


def _column_scores(score, decoding: Decoding, batch: _Batch, rows: list[int], logits: torch.Tensor,
                   fed: torch.Tensor) -> torch.Tensor:
    """``score`` of one column ``logits`` [R, V] following each row's tokens and ``fed`` [R, j]."""
    if not decoding.needs_context:
        return score(None, logits, None)
    scores = torch.empty_like(logits)
    for members, batch_rows, context in batch.contexts(rows, fed):
        scores[members] = score(context, logits[members], batch_rows)
    return scores


def _choose(decoding: Decoding, scores: torch.Tensor, generator) -> torch.Tensor:
    """The target's token from processed scores [..., V]: their argmax, or a sample of their softmax."""
    return scores.argmax(-1) if decoding.greedy else _sample(scores.softmax(dim=-1), generator)


# -- the steps --------------------------------------------------------------------------------------------------


def _new_cache(target):
    """The target's own ``DynamicCache``, imported here: importing the runtime must not import transformers."""
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


def _prefill(target, input_ids, attention_mask, rows, cache, batch: _Batch, decoding: Decoding, eos_t, generator,
             draft_dtype) -> tuple[_Live | None, torch.Tensor, list[bool]]:
    """The target over the prompt (its merged rows when given) and its first token, emitted; the live rows."""
    hidden, logits = _target_step(target, input_ids, attention_mask, cache, last_only=True, dtype=draft_dtype,
                                  inputs_embeds=rows)
    every = list(range(input_ids.shape[0]))
    first = _choose(decoding, _scores(decoding, batch, every, logits, input_ids[:, :0]), generator)  # [B, 1]
    cache.activate_past_recording()  # after the prefill: only the verify rows need history for the rollback
    device = input_ids.device
    real_positions = attention_mask.sum(dim=1, keepdim=True)
    live = _Live(torch.arange(len(every), device=device), every, first, real_positions, attention_mask)
    _, goes = _emit(batch, live, first, torch.ones(len(every), dtype=torch.long, device=device), decoding, eos_t)
    return (live if any(goes) else None), hidden, goes


def _draft(drafter, decoding: Decoding, input_ids, positions, hidden, rows, generator):
    # Every drafter call passes rows this loop built from inputs validated up front (batch, ids, positions <
    # max_length): the drafter skips its own validation, which would read them again (host syncs).
    extra = {} if rows is None else {"inputs_embeds": rows if hidden.dtype == rows.dtype else rows.to(hidden.dtype)}
    return drafter.draft(input_ids, positions, hidden, temperature=decoding.draft_temperature, generator=generator,
                         validate=False, **extra)


def _with_proposals(live: _Live, result, decoding: Decoding, batch: _Batch, generator) -> _Live:
    """``live`` with the drafts of ``result`` (its rows' own), processed like the target's (``draft_scores``)."""
    drafts, q = _proposals(result, live.rows.device)
    if batch.checked_vocab is not None:
        _check_proposals(drafts, None if decoding.greedy else q, len(batch.counts), batch.k, batch.checked_vocab)
    drafts, q = drafts[live.rows], None if q is None else q[live.rows]
    if not decoding.greedy:
        if q is None:
            raise ValueError("the drafter returned no probs for temperature > 0")
        if decoding.draft_scores is not None:
            drafts, q = _couple(decoding, batch, live.index, drafts, q, generator)
    live.drafts, live.q = drafts, q
    return live


def _couple(decoding: Decoding, batch: _Batch, rows: list[int], drafts, q, generator):
    """Drafts re-drawn from the processed draft distributions q'_j (draft j following the re-drawn drafts before
    it): kept with probability min(1, q'(d) / q(d)), else a sample of normalize(max(0, q' - q)), which has law q'
    exactly (the verification's own rule) and keeps the drafter's token as often as any coupling can."""
    new_drafts, new_q = drafts.clone(), torch.empty_like(q)
    for j in range(drafts.shape[1]):
        log_q = q[:, j].clamp_min(0).log()
        new_q[:, j] = _column_scores(decoding.draft_scores, decoding, batch, rows, log_q,
                                     new_drafts[:, :j]).softmax(dim=-1)
        _, new_drafts[:, j] = _verify_sampled(new_q[:, j], q[:, j], drafts[:, j], generator)
    return new_drafts, new_q


def _verify(target, live: _Live, cache, decoding: Decoding, batch: _Batch, generator, draft_dtype):
    """The target over [x_F, d_1..d_K] at F..F+K: its hiddens, the row's tokens (drafts, then the correction or
    bonus, [R, K + 1]) and each row's accepted count a_b."""
    k = live.drafts.shape[1]
    live.mask = torch.cat([live.mask, live.mask.new_ones(len(live.index), k + 1)], dim=1)
    hidden, logits = _target_step(target, torch.cat([live.last, live.drafts], dim=1), live.mask, cache,
                                  last_only=False, dtype=draft_dtype)
    scores = _scores(decoding, batch, live.index, logits, live.drafts)
    if decoding.greedy:
        tokens = scores.argmax(-1)  # [R, K+1]: the target's token for F+1..F+K+1
        accepted = tokens[:, :k] == live.drafts
    else:
        if live.q.shape[-1] != logits.shape[-1]:
            raise ValueError(f"drafter probs cover {live.q.shape[-1]} tokens, target logits {logits.shape[-1]}")
        p = scores.softmax(dim=-1)
        accepted, tokens = _verify_sampled(p[:, :k], live.q, live.drafts, generator)
        tokens = torch.cat([tokens, _sample(p[:, k], generator)[:, None]], dim=1)  # the bonus token last
    return hidden, tokens, accepted.long().cumprod(dim=1).sum(dim=1)


def _emit(batch: _Batch, live: _Live, tokens: torch.Tensor, keep: torch.Tensor, decoding: Decoding, eos_t,
          accepted_len: torch.Tensor | None = None) -> tuple[list[int], list[bool]]:
    """Write each live row's first ``keep`` tokens, cut at its first EOS, its limit and its first stop; record the
    round's statistics; stream the columns every row now has. Returns each row's kept count and whether it goes
    on. The one host sync of a round."""
    columns = torch.arange(tokens.shape[1], device=tokens.device)
    eos_hit = torch.isin(tokens, eos_t) if eos_t is not None else torch.zeros_like(tokens, dtype=torch.bool)
    before_eos = eos_hit.long().cumsum(dim=1) - eos_hit.long() == 0  # columns up to the row's first EOS
    row_count = batch.count[live.rows]
    emit = (columns < keep[:, None]) & (columns < (batch.limit[live.rows] - row_count)[:, None]) & before_eos
    emitted = emit.sum(dim=1)
    values = torch.cat([keep, emitted, (emit & eos_hit).any(dim=1).long()]).tolist()
    n = len(live.index)
    kept, counts, ended = values[:n], values[n:2 * n], [bool(v) for v in values[2 * n:]]
    if decoding.stop is not None:
        stopped = _stops(batch, live.index, tokens, counts, decoding)
        for i, at in stopped.items():
            if decoding.pad_after_stop:
                counts[i], ended[i] = at, True
            elif batch.stopped_at[live.index[i]] is None:
                batch.stopped_at[live.index[i]] = batch.counts[live.index[i]] + at
        if decoding.pad_after_stop and stopped:
            emitted = torch.tensor(counts, device=tokens.device)
    batch.out[live.rows[:, None], row_count[:, None] + columns] = torch.where(columns < emitted[:, None], tokens,
                                                                              batch.pad)
    batch.count.index_add_(0, live.rows, emitted)
    for b, c, e in zip(live.index, counts, ended):
        if accepted_len is not None:  # a verify round's (the prefill's token counts in no figure)
            batch.emitted[b].append((len(batch.stats), batch.counts[b], c))
        batch.counts[b] += c
        batch.done[b] = e or batch.counts[b] >= batch.limits[b]
    if all(at is not None for at in batch.stopped_at):  # without padding: the batch ends at the last row's stop
        end = max(batch.stopped_at)
        batch.limits = [end] * len(batch.limits)
        batch.limit.fill_(end)
        batch.done = [c >= end for c in batch.counts]
    if accepted_len is not None:
        k = tokens.shape[1] - 1
        prefix = accepted_len[:, None] > columns[:k]  # [R, K]
        batch.stats.append(torch.cat([accepted_len.new_full((1,), n * k), accepted_len.sum()[None],
                                      prefix.sum(dim=0)]))
    _stream(batch, decoding.streamer)
    return kept, [not batch.done[b] for b in live.index]


def _stops(batch: _Batch, rows: list[int], tokens: torch.Tensor, counts: list[int], decoding: Decoding
           ) -> dict[int, int]:
    """For each live row (index into ``rows``) that ``decoding.stop`` ends within its ``counts[i]`` new tokens: the
    number of those tokens up to and including the one after which it fired."""
    stopped: dict[int, int] = {}
    for j in range(max(counts, default=0)):
        pending = [i for i in range(len(rows)) if counts[i] > j and i not in stopped]
        if not pending:
            break
        at = torch.tensor(pending, device=tokens.device)
        for members, _, context in batch.contexts([rows[i] for i in pending], tokens[at, :j + 1]):
            for m, fired in zip(members.tolist(), decoding.stop(context).tolist()):
                if fired:
                    stopped[pending[m]] = j + 1
    return stopped


def _stream(batch: _Batch, streamer, final: bool = False) -> None:
    """Give the streamer the columns every row now has (the rows that are done have them all), in order: the
    tokens themselves for one sequence, one [B] column at a time for a batch, as ``generate`` does; ``end`` once."""
    if streamer is None:
        return
    open_counts = [c for c, done in zip(batch.counts, batch.done) if not done]
    upto = batch.width() if final or not open_counts else min(open_counts)
    if upto > batch.streamed:
        new = batch.out[:, batch.streamed:upto].cpu()
        for chunk in ([new[0]] if new.shape[0] == 1 else new.T):
            streamer.put(chunk)
        batch.streamed = upto
    if final:
        streamer.end()


def _advance(target, drafter, cache, live: _Live, hidden, tokens, kept: list[int], goes: list[bool],
             decoding: Decoding, batch: _Batch, generator, *, prompt_rows: bool) -> _Live | None:
    """Roll the target back over each row's rejected rows, feed the drafter each row's verified rows and take its
    drafts; the rows that finished drop out. None when every row is done."""
    if not any(goes):
        return None
    k = tokens.shape[1] - 1
    longest = max(n for n, g in zip(kept, goes) if g)
    # (a row that finished here is cropped like the row that kept the most: it is dropped below anyway)
    live.mask = rollback_rows(cache, live.mask, [k + 1 - (n if g else longest) for n, g in zip(kept, goes)])
    device = tokens.device
    keep = torch.tensor(kept, device=device)
    going = torch.tensor(goes, device=device)
    columns = torch.arange(longest, device=device)
    real = going[:, None] & (columns < keep[:, None])
    rows_ids = torch.where(real, tokens[:, :longest], batch.pad)
    rows_pos = torch.where(real, live.last_pos + columns, -1)
    rows_hidden = hidden[:, :longest]
    full = len(batch.counts)
    if len(live.index) < full:  # the drafter's cache rows are the batch's: the rows that dropped out get padding
        rows_ids, rows_pos, rows_hidden = (_scatter_rows(t, live.rows, full, fill) for t, fill in
                                           ((rows_ids, batch.pad), (rows_pos, -1), (rows_hidden, 0)))
    rows = _embed(target, rows_ids) if prompt_rows else None
    result = _draft(drafter, decoding, rows_ids, rows_pos, rows_hidden, rows, generator)
    live.last, live.last_pos = tokens.gather(1, (keep - 1)[:, None]), live.last_pos + keep[:, None]
    if not all(goes):  # rows finished this round: they drop out of the target's batch (rarely)
        live = live.keep(cache, [i for i, g in enumerate(goes) if g])
    return _with_proposals(live, result, decoding, batch, generator)


def _proposals(result: DraftResult, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(drafts [B, K], draft distributions [B, K, V] or None) of a draft result, on the loop's device."""
    if not isinstance(result, DraftResult):
        raise TypeError(f"drafter.draft must return a DraftResult, got {type(result).__name__}")
    probs = result.draft_probs
    return result.drafts.to(device=device, dtype=torch.long), None if probs is None else probs.to(device)


def _check_proposals(drafts: torch.Tensor, q: torch.Tensor | None, batch: int, k: int, vocab: int) -> None:
    """A drafter of the caller's own: drafts [B, K] of ids the target can embed (an id out of range would index
    past its embedding table), and when sampling, distributions [B, K, V]."""
    if tuple(drafts.shape) != (batch, k):
        raise ValueError(f"the drafter returned drafts of shape {tuple(drafts.shape)}, expected [{batch}, {k}]")
    low, high = (int(v) for v in torch.aminmax(drafts)) if drafts.numel() else (0, 0)
    if low < 0 or high >= vocab:
        raise ValueError(f"the drafter returned draft ids in [{low}, {high}]; the target's vocabulary is [0, {vocab})")
    if q is not None and tuple(q.shape) != (batch, k, vocab):
        raise ValueError(f"the drafter returned draft_probs of shape {tuple(q.shape)}, expected "
                         f"[{batch}, {k}, {vocab}]")


def _scatter_rows(values: torch.Tensor, rows: torch.Tensor, batch: int, fill) -> torch.Tensor:
    """``values`` [R, ...] of the batch rows ``rows`` as a [batch, ...] tensor, ``fill`` in the other rows."""
    full = values.new_full((batch, *values.shape[1:]), fill)
    full[rows] = values
    return full


def _storage_may_reach_log_scaling(target, length: int, max_new_tokens: int, k: int) -> bool:
    """Whether a target query's storage index may reach ``log_scaling_n_floor``: the slots that per-row rollback
    shifts in would then change full layers' log scaling (docs/protocol.md §6.9), so the loop keeps lockstep."""
    n_floor = getattr(_text_config(target), "log_scaling_n_floor", None)
    return n_floor is not None and length + (max_new_tokens - 1) * (k + 1) > n_floor


def _output(input_ids, new_tokens: torch.Tensor, stats: list[torch.Tensor], emitted: list[int], k: int
            ) -> SpeculativeOutput:
    sequences = torch.cat([input_ids, new_tokens], dim=1)
    per_round = torch.stack(stats).tolist() if stats else []
    drafted = [int(r[0]) for r in per_round]
    accepted_counts = [int(r[1]) for r in per_round]
    per_position = [[int(c) for c in r[2:]] for r in per_round]
    num_drafted, num_accepted = sum(drafted), sum(accepted_counts)
    drafting_rows = num_drafted // k
    return SpeculativeOutput(
        sequences=sequences,
        num_new_tokens=sequences.shape[1] - input_ids.shape[1],
        num_rounds=len(per_round),
        num_drafted=num_drafted,
        num_accepted=num_accepted,
        acceptance_rate=num_accepted / num_drafted if num_drafted else 0.0,
        mean_accepted_length=sum(emitted) / drafting_rows if drafting_rows else 0.0,
        num_speculative_tokens=k,
        acceptance_per_position=[sum(c) / drafting_rows for c in zip(*per_position)] if drafting_rows else [],
        drafted_per_round=drafted,
        accepted_per_round=accepted_counts,
        accepted_per_position_per_round=per_position,
        emitted_per_round=emitted,
    )
