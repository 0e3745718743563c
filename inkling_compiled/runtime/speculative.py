"""Speculative decoding with the Inkling MTP draft head around a transformers Inkling target, K drafts per round:
:func:`speculative_generate` (prefill, verify, per-row accept / reject or ``lockstep``, the per-row rollback of the
target's cache, finished rows leaving the batch) and its statistics. The protocol and why it is lossless are in
docs/protocol.md §6.3-§6.5, §6.7, §6.9; the loop's contract with its drafter and its host syncs in §6.10.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .. import arguments
from ..config import logits_vocab_size
from ..hf_compat import cache_argument
from ..model.mtp import InklingMTP
from .drafter import DraftResult, DraftSource
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
    j + 1 drafts were accepted), ``emitted_per_round`` (tokens the rows emitted, summed over rows).
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
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over ``input_ids`` [B, T] continuing ``cache``.

    Returns (post-final-norm hidden [B, T, H], in ``dtype`` when given, float32 logits [B, T or 1, V]); the logits
    are computed with exactly the operations of the target's own forward (hidden / muP -> lm_head -> drop the padded
    vocabulary rows), from the hidden in the target's own dtype.
    """
    model = target.model
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **{cache_argument(model): cache})
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
    scaled = logits.float() / temperature
    if top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_above >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.softmax(dim=-1)


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
              eos_token_id, pad_token_id) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """Check every argument before any model call; return (input_ids, attention_mask) as int64 tensors, the EOS
    ids and the pad id (checked whether or not an EOS is given: it is also the token of the drafter's padding rows
    when rows keep different numbers of tokens)."""
    if not isinstance(target, nn.Module) or not hasattr(getattr(target, "config", None), "get_text_config"):
        raise arguments.ArgumentError(f"target must be a transformers Inkling model (InklingForCausalLM or "
                                      f"InklingForConditionalGeneration), got {type(target).__name__}")
    if not isinstance(drafter, DraftSource):
        raise arguments.ArgumentError(f"drafter must follow the DraftSource protocol (draft, max_batch_size, "
                                      f"max_length, num_speculative_tokens), got {type(drafter).__name__}")
    arguments.positive_int("max_new_tokens", max_new_tokens)
    arguments.temperature(temperature)
    arguments.check_bool("lockstep", lockstep)
    arguments.top_p(top_p)
    input_ids = arguments.integer_tensor("input_ids", input_ids, ndim=2)
    batch, length = input_ids.shape
    if batch < 1 or length < 1:
        raise ValueError(f"input_ids must be non-empty, got shape {tuple(input_ids.shape)}")
    target_device = next(target.parameters()).device
    if input_ids.device != target_device:
        raise ValueError(f"input_ids are on {input_ids.device}, the target on {target_device}")
    draft_model = getattr(drafter, "model", None)
    draft_device = getattr(draft_model, "device", target_device)
    if draft_device != target_device:
        raise ValueError(f"the drafter's model is on {draft_device}, the target on {target_device}")
    if isinstance(draft_model, InklingMTP):  # what the drafter would check on every call, checked once here
        draft_model.check_parameters()
    arguments.generator(generator, target_device)
    text = _text_config(target)
    eos = arguments.token_ids("eos_token_id", eos_token_id, text.vocab_size)
    pad = arguments.token_id("pad_token_id", (eos[0] if eos else 0) if pad_token_id is None else pad_token_id,
                             text.vocab_size, " (finished rows feed it to the target, padding rows to the drafter)")
    # every id is embedded, padding included: one outside the table is an index error (on CUDA, a device assert)
    low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one host sync for both
    if low < 0 or high >= text.vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids hold token id {bad}, outside the target's vocabulary [0, {text.vocab_size})")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.long)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}")
    mask_cpu = attention_mask.cpu()
    if not bool(((mask_cpu == 0) | (mask_cpu == 1)).all()):  # before the cast: 0.5 must not truncate to 0
        raise ValueError("attention_mask must contain only 0 and 1")
    attention_mask, mask_cpu = attention_mask.to(device=input_ids.device, dtype=torch.long), mask_cpu.long()
    if bool((mask_cpu[:, 1:] < mask_cpu[:, :-1]).any()):
        raise ValueError("attention_mask must be left-padded (zeros, then ones, in every row)")
    real = mask_cpu.sum(dim=1)
    if bool((real == 0).any()):
        raise ValueError("every sequence needs at least one real (attention_mask == 1) prompt token")
    if batch > drafter.max_batch_size:
        raise ValueError(f"batch size {batch} exceeds the drafter's max_batch_size {drafter.max_batch_size}")
    longest = int(real.max())
    if longest > drafter.max_length:
        raise ValueError(f"prompt of {longest} tokens is longer than the drafter's max_length {drafter.max_length}")
    # Drafter rows go up to position prompt + max_new_tokens - 2 (the row carrying the last emitted token).
    if longest + max_new_tokens - 1 > drafter.max_length:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} - 1 exceeds the drafter's max_length "
            f"{drafter.max_length}; build the Drafter with max_length >= {longest + max_new_tokens - 1}")
    logits_vocab = logits_vocab_size(text)
    draft_config = getattr(draft_model, "config", None)
    draft_vocab = getattr(draft_config, "logits_vocab_size", None)
    if draft_vocab is not None and draft_vocab != logits_vocab:
        raise ValueError(f"drafter logits vocabulary {draft_vocab} != target logits vocabulary {logits_vocab}")
    draft_table = getattr(draft_config, "vocab_size", None)
    if draft_table is not None and draft_table < text.vocab_size:  # every id the target takes is embedded
        raise ValueError(f"drafter embedding table has {draft_table} rows, fewer than the target's vocabulary "
                         f"{text.vocab_size}")
    draft_hidden = getattr(draft_config, "hidden_size", None)
    if draft_hidden is not None and draft_hidden != text.hidden_size:
        raise ValueError(f"drafter hidden size {draft_hidden} != target hidden size {text.hidden_size}")
    return input_ids, attention_mask, eos, pad


# --------------------------------------------------------------------------------------------------------------------
# the loop


def speculative_generate(target, drafter: DraftSource, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor | None = None, *,
                         max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                         eos_token_id: int | list[int] | torch.Tensor | None = None, pad_token_id: int | None = None,
                         generator: torch.Generator | None = None, lockstep: bool = False) -> SpeculativeOutput:
    """Generate up to ``max_new_tokens`` tokens per sequence with MTP speculative decoding, as many drafts per round
    as the drafter proposes (``Drafter(num_speculative_tokens=K)``; docs/protocol.md §6.10).

    ``input_ids`` [B, L] is left-padded as described by ``attention_mask`` (1 = real token); ``temperature == 0``
    is greedy (``top_p`` ignored), otherwise tokens follow ``softmax(top_p(logits / temperature))`` exactly.
    ``generator`` (on the target's device) drives every random draw of the loop and is passed to the drafter.
    Each sequence advances by its own accepted length; ``lockstep=True`` advances the batch by its shortest one (the
    benchmark's baseline; same tokens, more rounds). Raises ``ValueError`` on bad arguments before any model call.
    """
    input_ids, attention_mask, eos, pad_token_id = _validate(target, drafter, input_ids, attention_mask,
                                                             max_new_tokens, temperature, top_p, generator, lockstep,
                                                             eos_token_id, pad_token_id)
    with torch.no_grad():
        return _run(target, drafter, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                    temperature=float(temperature), top_p=float(top_p), eos=eos, pad_token_id=pad_token_id,
                    generator=generator, lockstep=lockstep)


def _proposals(result: DraftResult, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(drafts [B, K], draft distributions [B, K, V] or None) of a draft result, on the loop's device."""
    if not isinstance(result, DraftResult):
        raise TypeError(f"drafter.draft must return a DraftResult, got {type(result).__name__}")
    probs = result.draft_probs
    return result.drafts.to(device=device, dtype=torch.long), None if probs is None else probs.to(device)


def _new_cache(target):
    """The target's own ``DynamicCache``, imported here: importing the runtime must not import transformers."""
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


def _run(target, drafter, input_ids, attention_mask, *, max_new_tokens, temperature, top_p, eos, pad_token_id,
         generator, lockstep) -> SpeculativeOutput:
    device = input_ids.device
    batch, length = input_ids.shape
    greedy = temperature == 0.0
    draft_temperature = 0.0 if greedy else temperature
    eos_t = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
    # A drafter may run in another dtype than the target (a bf16 / int8 draft head beside an fp32 target, holding its
    # own copy of the shared tensors): it gets the target's hiddens in its own dtype.
    draft_dtype = getattr(getattr(drafter, "model", None), "dtype", None)

    def choose(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B]
        return logits.argmax(-1) if greedy else _sample(target_distribution(logits, temperature, top_p), generator)

    def is_eos(tokens: torch.Tensor) -> torch.Tensor:
        if eos_t is None:
            return torch.zeros_like(tokens, dtype=torch.bool)
        return torch.isin(tokens, eos_t)

    # -- prefill ------------------------------------------------------------------------------------------------
    cache = _new_cache(target)
    hidden, logits = _target_step(target, input_ids, attention_mask, cache, last_only=True, dtype=draft_dtype)
    first = choose(logits[:, -1])
    finished = is_eos(first)
    cache.activate_past_recording()  # after the prefill: only the verify rows need history for the rollback

    if max_new_tokens == 1 or (eos_t is not None and bool(finished.all())):  # done: no draft needed
        return _output(input_ids, first[:, None], [], drafter.num_speculative_tokens)

    pad_left = length - attention_mask.sum(dim=1)  # [B]
    positions = torch.arange(length, device=device)[None, :] - pad_left[:, None]  # real-token positions, < 0 = pad
    draft_ids = torch.cat([input_ids[:, 1:], first[:, None]], dim=1)
    # Every drafter call passes rows this loop built from inputs validated up front (batch, ids, positions <
    # max_length): the drafter skips its own validation, which would read them again (host syncs).
    result = drafter.draft(draft_ids, positions, hidden, temperature=draft_temperature, generator=generator,
                           validate=False)
    drafts, q = _proposals(result, device)
    k = drafts.shape[1]  # drafts per round
    lockstep = lockstep or _storage_may_reach_log_scaling(target, length, max_new_tokens, k)
    columns = torch.arange(k + 1, device=device)
    # Every row's new tokens at columns 0..count_b - 1 (the rest pad), with room for one round past max_new_tokens.
    out = torch.full((batch, max_new_tokens + k + 1), pad_token_id, dtype=torch.long, device=device)
    out[:, 0] = first
    count = torch.ones(batch, dtype=torch.long, device=device)
    # Only unfinished rows go on: `rows` are their indices in the batch, and `last` (x_F, not yet in the target
    # cache), `last_pos` (F), the drafts, `mask` and the target cache hold those rows alone.
    rows, last, last_pos = torch.arange(batch, device=device), first[:, None], positions[:, -1:] + 1
    state = (rows, last, last_pos, attention_mask, drafts, q)
    if eos_t is not None and bool(finished.any()):
        state = _drop_finished(cache, (~finished).nonzero().squeeze(1), state)
    rows, last, last_pos, mask, drafts, q = state

    stats: list[torch.Tensor] = []
    while True:
        if drafts.shape[1] != k:
            raise ValueError(f"the drafter returned {drafts.shape[1]} drafts, {k} at the prefill")
        live = rows.shape[0]
        # -- verify [x_F, d_1..d_K] at F..F+K ---------------------------------------------------------------------
        mask = torch.cat([mask, mask.new_ones(live, k + 1)], dim=1)
        hidden, logits = _target_step(target, torch.cat([last, drafts], dim=1), mask, cache, last_only=False,
                                      dtype=draft_dtype)
        if greedy:
            tokens = logits.argmax(-1)  # [B, K+1]: the target's token for F+1..F+K+1
            accepted = tokens[:, :k] == drafts
        else:
            if q is None:
                raise ValueError("the drafter returned no probs for temperature > 0")
            if q.shape[-1] != logits.shape[-1]:
                raise ValueError(f"drafter probs cover {q.shape[-1]} tokens, target logits {logits.shape[-1]}")
            p = target_distribution(logits, temperature, top_p)
            accepted, tokens = _verify_sampled(p[:, :k], q, drafts, generator)
            tokens = torch.cat([tokens, _sample(p[:, k], generator)[:, None]], dim=1)  # the bonus token last
        accepted_len = accepted.long().cumprod(dim=1).sum(dim=1)  # a_b: the row's longest accepted prefix
        # column j of `tokens` is d_{j+1} for j < a_b, then the row's correction (or bonus): row b keeps a_b + 1
        keep = accepted_len + 1
        if lockstep:  # every row keeps as many as the row that accepted the fewest
            keep = keep.amin().expand(live)
        eos_hit = is_eos(tokens)
        before_eos = eos_hit.long().cumsum(dim=1) - eos_hit.long() == 0  # columns up to the row's first EOS
        row_count = count[rows]
        emit = (columns < keep[:, None]) & (columns < (max_new_tokens - row_count)[:, None]) & before_eos
        emitted = emit.sum(dim=1)
        out[rows[:, None], row_count[:, None] + columns] = torch.where(emit, tokens, pad_token_id)  # pad past them
        count.index_add_(0, rows, emitted)
        going = ~(emit & eos_hit).any(dim=1) & (row_count + emitted < max_new_tokens)
        prefix = accepted_len[:, None] > columns[:k]  # [B, K]
        stats.append(torch.cat([accepted_len.new_full((1,), live * k), accepted_len.sum()[None], prefix.sum(dim=0),
                                emitted.sum()[None]]))
        # The one host sync of the round: each row's kept length and whether it goes on.
        values = torch.cat([keep, going.long()]).tolist()
        kept, goes = values[:live], values[live:]
        still = sum(goes)
        if still == 0:
            break
        longest = max(n for n, g in zip(kept, goes) if g)
        # -- roll the target back over each row's rejected rows, feed the drafter each row's verified rows -------
        # (a row that finished here is cropped like the row that kept the most: it is dropped below anyway)
        mask = rollback_rows(cache, mask, [k + 1 - (n if g else longest) for n, g in zip(kept, goes)])
        real = going[:, None] & (columns[:longest] < keep[:, None])
        rows_ids = torch.where(real, tokens[:, :longest], pad_token_id)
        rows_pos = torch.where(real, last_pos + columns[:longest], -1)
        rows_hidden = hidden[:, :longest]
        if live < batch:  # the drafter's cache rows are the batch's: the rows that dropped out get padding
            rows_ids, rows_pos, rows_hidden = (_scatter_rows(t, rows, batch, fill) for t, fill in
                                               ((rows_ids, pad_token_id), (rows_pos, -1), (rows_hidden, 0)))
        result = drafter.draft(rows_ids, rows_pos, rows_hidden, temperature=draft_temperature, generator=generator,
                               validate=False)
        drafts, q = _proposals(result, device)
        drafts, q = drafts[rows], None if q is None else q[rows]
        last, last_pos = tokens.gather(1, (keep - 1)[:, None]), last_pos + keep[:, None]
        if still < live:  # rows finished this round: they drop out of the target's batch (a host sync, rarely)
            rows, last, last_pos, mask, drafts, q = _drop_finished(cache, going.nonzero().squeeze(1),
                                                                   (rows, last, last_pos, mask, drafts, q))

    return _output(input_ids, out[:, :int(count.max())], stats, k)


def _drop_finished(cache, kept: torch.Tensor, state: tuple) -> tuple:
    """Keep the rows ``kept`` of the target cache and of the per-row tensors in ``state`` (None stays None)."""
    select_rows(cache, kept)
    return tuple(None if t is None else t[kept] for t in state)


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


def _output(input_ids, new_tokens: torch.Tensor, stats: list[torch.Tensor], k: int) -> SpeculativeOutput:
    sequences = torch.cat([input_ids, new_tokens], dim=1)
    per_round = torch.stack(stats).tolist() if stats else []
    drafted = [int(r[0]) for r in per_round]
    accepted_counts = [int(r[1]) for r in per_round]
    per_position = [[int(c) for c in r[2:-1]] for r in per_round]
    emitted = [int(r[-1]) for r in per_round]
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
