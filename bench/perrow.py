"""Per-row acceptance against lockstep (``perrow`` section, ``--full``): the same left-padded prompts at batch 1, 4
and 8 for K = 1 and 4, each row advancing by its own accepted length (the default) or the batch at its smallest
(``lockstep=True``): tokens per target forward, tokens/s beside the target alone, same tokens as greedy
``generate``, and the per-row rollback's cost against the verify forward (in the loop, and on longer contexts)."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from inkling_compiled.runtime import Drafter, speculative, speculative_generate
from inkling_compiled.runtime.target_cache import rollback_rows

from .e2e import generators, load
from .harness import Context, fmt, progress, table, yes
from .models import left_pad

MODES = ("lockstep", "per_row")


@dataclass
class PerRowConfig:
    batches: tuple[int, ...] = (1, 4, 8)
    ks: tuple[int, ...] = (1, 4)
    prompt_len: int = 12
    new_tokens: int = 48
    seed: int = 0
    threads: int = 1
    compile: bool = True
    contexts: tuple[int, ...] = (64, 512, 2048)


def _prompts(vocab: int, cfg: PerRowConfig) -> list[torch.Tensor]:
    """max(batches) prompts of lengths prompt_len, prompt_len - 1, ... (cycling over four lengths)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    count = max(cfg.batches)
    return [torch.randint(3, vocab, (cfg.prompt_len - i % 4,), generator=gen) for i in range(count)]


def _groups(prompts, batch: int):
    return [left_pad(prompts[i:i + batch]) for i in range(0, len(prompts), batch)]


@contextlib.contextmanager
def timed_rollback(records: dict[str, list[float]]):
    """Time every verify forward and every per-row rollback of the loop (wall ms per call, appended to
    ``records["forward"]`` / ``records["rollback"]``, and ``records["ragged"]`` for the ragged rollbacks)."""
    step, rollback = speculative._target_step, speculative.rollback_rows

    def forward(*args, last_only, **kwargs):
        start = time.perf_counter()
        result = step(*args, last_only=last_only, **kwargs)
        if not last_only:  # a verify forward (the prefill is last_only)
            records["forward"].append(1e3 * (time.perf_counter() - start))
        return result

    def rolled(cache, mask, rejected):
        start = time.perf_counter()
        result = rollback(cache, mask, rejected)
        records["rollback"].append(1e3 * (time.perf_counter() - start))
        if len(set(rejected)) > 1:
            records["ragged"].append(records["rollback"][-1])
        return result

    speculative._target_step, speculative.rollback_rows = forward, rolled
    try:
        yield records
    finally:
        speculative._target_step, speculative.rollback_rows = step, rollback


def rollback_cost(target, batch: int, context: int, k: int, rounds: int = 20, seed: int = 0) -> dict:
    """Median wall ms of a verify forward (K + 1 rows, ``_target_step``) and of the ragged per-row rollback after
    it, on a cache that starts at ``context`` positions; rows keep 1, 2, .., K + 1 of the verified rows."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.get_text_config().vocab_size
    mask = torch.ones(batch, context, dtype=torch.long)
    cache = DynamicCache(config=target.config)
    speculative._target_step(target, torch.randint(3, vocab, (batch, context), generator=gen), mask, cache,
                             last_only=True)
    cache.activate_past_recording()
    rejected = [b % (k + 1) for b in range(batch)]
    forward, rollback = [], []
    for _ in range(rounds):
        mask = torch.cat([mask, mask.new_ones(batch, k + 1)], dim=1)
        start = time.perf_counter()
        speculative._target_step(target, torch.randint(3, vocab, (batch, k + 1), generator=gen), mask, cache,
                                 last_only=False)
        middle = time.perf_counter()
        mask = rollback_rows(cache, mask, rejected)
        forward.append(1e3 * (middle - start))
        rollback.append(1e3 * (time.perf_counter() - middle))
    forward_ms, rollback_ms = statistics.median(forward), statistics.median(rollback)
    return {"context": context, "batch": batch, "k": k, "forward_ms": forward_ms, "rollback_ms": rollback_ms,
            "share": rollback_ms / forward_ms}


@dataclass
class PerRow:
    checkpoint: str
    config: dict
    target: dict[int, dict] = field(default_factory=dict)  # batch -> the target alone's tokens/s
    ks: dict[int, dict] = field(default_factory=dict)  # K -> batch -> lockstep / per_row / rollback
    rollback_vs_context: list[dict] = field(default_factory=list)


def run_perrow(checkpoint, cfg: PerRowConfig | None = None) -> PerRow:
    """Every figure of the comparison on ``checkpoint`` (a distilled raw-layout directory with >= max(ks) depths),
    CPU fp32."""
    cfg = cfg or PerRowConfig()
    torch.set_num_threads(cfg.threads)
    target, mtp = load(checkpoint)
    prompts = _prompts(mtp.config.logits_vocab_size, cfg)
    alone, _ = generators(target, cfg.new_tokens)
    record = PerRow(str(checkpoint), dict(cfg.__dict__))
    with torch.no_grad():
        progress("perrow: the target alone")
        reference = None
        for batch in cfg.batches:
            groups = _groups(prompts, batch)
            alone(*groups[0])  # warm-up
            start = time.perf_counter()
            outputs = [alone(ids, mask)[0] for ids, mask in groups]
            record.target[batch] = {"tokens_per_s": len(prompts) * cfg.new_tokens / (time.perf_counter() - start)}
            if reference is None:  # greedy generate: the tokens every configuration must reproduce
                reference = [c for out, (_, mask) in zip(outputs, groups) for c in out[:, mask.shape[1]:].tolist()]
        for k in cfg.ks:
            drafter = Drafter(mtp, max(cfg.batches), cfg.prompt_len + cfg.new_tokens + 8, num_speculative_tokens=k,
                              compile=cfg.compile, batch_buckets=cfg.batches)
            entry = record.ks[k] = {b: _batch(target, drafter, _groups(prompts, b), reference, cfg)
                                    for b in cfg.batches}
            for row in entry.values():
                for mode in MODES:
                    row[mode]["vs_batch1"] = row[mode]["tokens_per_forward"] / entry[cfg.batches[0]][mode][
                        "tokens_per_forward"]
        progress("perrow: rollback vs context")
        record.rollback_vs_context = [rollback_cost(target, max(cfg.batches), context, max(cfg.ks))
                                      for context in cfg.contexts]
    return record


def _batch(target, drafter: Drafter, groups, reference, cfg: PerRowConfig) -> dict:
    """One (K, batch): both modes, taking turns group by group after an untimed warm-up; then the rollback timed."""
    k, total = drafter.num_speculative_tokens, sum(len(ids) for ids, _ in groups) * cfg.new_tokens
    progress(f"perrow: K={k} batch {len(groups[0][0])}")

    def run(ids, mask, mode):
        return speculative_generate(target, drafter, ids, mask, max_new_tokens=cfg.new_tokens,
                                    lockstep=mode == "lockstep")

    for ids, mask in groups:  # warm-up: compiles the drafter's shapes of this batch
        for mode in MODES:
            run(ids, mask, mode)
    outputs, seconds = {mode: [] for mode in MODES}, dict.fromkeys(MODES, 0.0)
    for ids, mask in groups:
        for mode in MODES:
            start = time.perf_counter()
            outputs[mode].append(run(ids, mask, mode))
            seconds[mode] += time.perf_counter() - start
    row = {}
    for mode, outs in outputs.items():
        tokens = [c for out, (_, mask) in zip(outs, groups) for c in out.sequences[:, mask.shape[1]:].tolist()]
        row[mode] = {"tokens_per_forward": sum(sum(o.emitted_per_round) for o in outs) / (sum(
                         o.num_drafted for o in outs) // k),
                     "target_forwards": sum(o.num_rounds + 1 for o in outs),
                     "tokens_per_s": total / seconds[mode], "same_tokens": tokens == reference}
    records: dict[str, list[float]] = {"forward": [], "rollback": [], "ragged": []}
    with timed_rollback(records):
        for ids, mask in groups:
            run(ids, mask, "per_row")
    forward, rollback = statistics.median(records["forward"]), statistics.median(records["rollback"])
    row["rollback"] = {"forward_ms": forward, "rollback_ms": rollback, "share": rollback / forward,
                       "ragged_ms": statistics.median(records["ragged"]) if records["ragged"] else None,
                       "rounds": len(records["rollback"]), "ragged_rounds": len(records["ragged"])}
    return row


def measure(ctx: Context) -> PerRow:
    s = ctx.settings
    return run_perrow(ctx.e2e_target().checkpoint, PerRowConfig(new_tokens=min(32, s.e2e_tokens), threads=s.threads,
                                                                contexts=(64,)))


def lines(result: dict) -> list[str]:
    """One row per (K, batch): tokens per target forward and tokens/s, lockstep vs per row, the rollback's cost."""
    cfg = result["config"]
    rows = [["K", "batch", "tok/fwd lockstep (vs b1)", "tok/fwd per-row (vs b1)", "tok/s lockstep", "tok/s per-row",
             "tok/s target", "rollback ms (ragged) / forward ms (share)", "same tokens"]]
    for k, entry in result["ks"].items():
        for batch, row in entry.items():
            lock, per, rb = row["lockstep"], row["per_row"], row["rollback"]
            rows.append([str(k), str(batch),
                         *(f"{m['tokens_per_forward']:.2f} ({m['vs_batch1']:.0%})" for m in (lock, per)),
                         f"{lock['tokens_per_s']:.1f}", f"{per['tokens_per_s']:.1f}",
                         f"{result['target'][str(batch)]['tokens_per_s']:.1f}",
                         f"{rb['rollback_ms']:.3f} ({fmt(rb['ragged_ms'], '.3f')}) / {rb['forward_ms']:.2f} "
                         f"({rb['share']:.1%})", yes(lock["same_tokens"] and per["same_tokens"])])
    out = [f"per-row vs lockstep on {result['checkpoint']} (CPU fp32, {cfg['threads']} thread(s), "
           f"{cfg['new_tokens']} new tokens x {max(cfg['batches'])} prompts, drafter "
           f"{'compiled' if cfg['compile'] else 'eager'})", *table(rows, "  ")]
    return out + [f"rollback outside the loop, batch {c['batch']}, K={c['k']}, context {c['context']}: "
                  f"{c['rollback_ms']:.3f} ms vs verify forward {c['forward_ms']:.2f} ms ({c['share']:.1%})"
                  for c in result["rollback_vs_context"]]
