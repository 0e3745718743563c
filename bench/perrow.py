"""Per-row acceptance vs lockstep (issue 13): tokens per target forward and tokens/s at several batch sizes and K.

:func:`run_perrow` generates the same prompts (random ids, left-padded to different lengths, no EOS stop) at every
batch size (batch 1: one prompt at a time; batch B: the prompts in groups of B) with ``speculative_generate`` per row
(the default) and with ``lockstep=True``, for each K, on one distilled checkpoint, and reports:

* ``tokens_per_forward``: tokens each sequence emitted per target forward (``mean_accepted_length`` pooled over the
  runs) and its ratio to batch 1's (the goal: batch 4 keeps >= 90 %);
* ``tokens_per_s``: new tokens of all sequences / wall seconds, next to the target alone (``generate`` greedy at the
  same batch);
* ``same_tokens``: every continuation equals the target's greedy ``generate`` (decoding is lossless);
* ``rollback``: per-row runs again with the verify forward and the per-row rollback timed (``time.perf_counter``
  around each call): median ms per round of each, the rollback's share, and the median of the ragged rounds alone
  (rows rejected different counts: the K/V gather; the others are a plain crop);
* ``rollback_vs_context``: the same two timings outside the loop, on a cache of ``context`` positions (batch
  max(batches), K = max(ks), every round ragged: rows keep 1..K+1), for longer contexts than the runs reach.

Every configuration runs once untimed first (the drafter compiles its shapes), then once timed, lockstep and per row
taking turns group by group; one intra-op thread.

    python -m bench.perrow [--checkpoint DIR] [--batches 1,4,8] [--ks 1,4] [--new-tokens 48] [--json out.json]

(default checkpoint: the ``tiny8`` synthetic preset, self-distilled and cached, as ``bench.ksweep`` uses).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

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


def _left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    return ids, mask


def _groups(prompts, batch: int):
    return [_left_pad(prompts[i:i + batch]) for i in range(0, len(prompts), batch)]


def _continuations(out, mask) -> list[list[int]]:
    return out.sequences[:, mask.shape[1]:].tolist()


@contextlib.contextmanager
def timed_rollback(records: dict[str, list[float]]):
    """Time every verify forward and every per-row rollback of the loop (wall ms per call, appended to
    ``records["forward"]`` / ``records["rollback"]``, and ``records["ragged"]`` for the ragged rollbacks)."""
    from inkling_compiled.runtime import speculative

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
    from transformers import DynamicCache

    from inkling_compiled.runtime.speculative import _target_step
    from inkling_compiled.runtime.target_cache import rollback_rows

    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.get_text_config().vocab_size
    mask = torch.ones(batch, context, dtype=torch.long)
    cache = DynamicCache(config=target.config)
    _target_step(target, torch.randint(3, vocab, (batch, context), generator=gen), mask, cache, last_only=True)
    cache.activate_past_recording()
    rejected = [b % (k + 1) for b in range(batch)]
    forward, rollback = [], []
    for _ in range(rounds):
        mask = torch.cat([mask, mask.new_ones(batch, k + 1)], dim=1)
        start = time.perf_counter()
        _target_step(target, torch.randint(3, vocab, (batch, k + 1), generator=gen), mask, cache, last_only=False)
        middle = time.perf_counter()
        mask = rollback_rows(cache, mask, rejected)
        forward.append(1e3 * (middle - start))
        rollback.append(1e3 * (time.perf_counter() - middle))
    forward_ms, rollback_ms = statistics.median(forward), statistics.median(rollback)
    return {"context": context, "batch": batch, "k": k, "forward_ms": forward_ms, "rollback_ms": rollback_ms,
            "share": rollback_ms / forward_ms}


def run_perrow(checkpoint, cfg: PerRowConfig | None = None, progress=lambda msg: None) -> dict:
    """Every figure of the comparison on ``checkpoint`` (a distilled raw-layout directory with >= max(ks) depths),
    CPU fp32."""
    from inkling_compiled import InklingMTP
    from inkling_compiled.runtime import Drafter, speculative_generate
    from inkling_compiled.testing.synthetic import greedy_generation_config, load_hf_target

    cfg = cfg or PerRowConfig()
    torch.set_num_threads(cfg.threads)
    target = load_hf_target(checkpoint, dtype=torch.float32).requires_grad_(False)
    mtp = InklingMTP.from_pretrained(checkpoint, target=target)
    prompts = _prompts(mtp.config.logits_vocab_size, cfg)
    gconfig = greedy_generation_config(target, cfg.new_tokens)
    max_length = cfg.prompt_len + cfg.new_tokens + 8
    result: dict = {"checkpoint": str(checkpoint), "config": dict(cfg.__dict__), "ks": {}, "target": {}}

    with torch.no_grad():
        progress("perrow: the target alone")
        reference = None
        for batch in cfg.batches:
            groups = _groups(prompts, batch)
            target.generate(groups[0][0], attention_mask=groups[0][1], generation_config=gconfig)  # warm-up
            start = time.perf_counter()
            outputs = [target.generate(ids, attention_mask=mask, generation_config=gconfig) for ids, mask in groups]
            result["target"][batch] = {"tokens_per_s": len(prompts) * cfg.new_tokens / (time.perf_counter() - start)}
            if reference is None:  # greedy generate: the tokens every configuration must reproduce
                reference = [c for out, (_, mask) in zip(outputs, groups) for c in out[:, mask.shape[1]:].tolist()]
        for k in cfg.ks:
            drafter = Drafter(mtp, max(cfg.batches), max_length, num_speculative_tokens=k, compile=cfg.compile,
                              batch_buckets=cfg.batches)
            entry = result["ks"][k] = {}
            for batch in cfg.batches:
                groups = _groups(prompts, batch)
                progress(f"perrow: K={k} batch {batch}")

                def run(ids, mask, mode, drafter=drafter):
                    return speculative_generate(target, drafter, ids, mask, max_new_tokens=cfg.new_tokens,
                                                lockstep=mode == "lockstep")

                for ids, mask in groups:  # warm-up: compiles the drafter's shapes of this batch
                    for mode in MODES:
                        run(ids, mask, mode)
                outputs, seconds = {mode: [] for mode in MODES}, dict.fromkeys(MODES, 0.0)
                for ids, mask in groups:  # the modes take turns group by group: drift hits them alike
                    for mode in MODES:
                        start = time.perf_counter()
                        outputs[mode].append(run(ids, mask, mode))
                        seconds[mode] += time.perf_counter() - start
                for mode in MODES:
                    tokens = [c for out, (_, mask) in zip(outputs[mode], groups) for c in _continuations(out, mask)]
                    rows = sum(out.num_drafted for out in outputs[mode]) // k
                    entry.setdefault(batch, {})[mode] = {
                        "tokens_per_forward": sum(sum(out.emitted_per_round) for out in outputs[mode]) / rows,
                        "target_forwards": sum(out.num_rounds + 1 for out in outputs[mode]),
                        "tokens_per_s": len(prompts) * cfg.new_tokens / seconds[mode],
                        "same_tokens": tokens == reference,
                    }
                records: dict[str, list[float]] = {"forward": [], "rollback": [], "ragged": []}
                with timed_rollback(records):
                    for ids, mask in groups:
                        speculative_generate(target, drafter, ids, mask, max_new_tokens=cfg.new_tokens)
                forward, rollback = statistics.median(records["forward"]), statistics.median(records["rollback"])
                ragged = statistics.median(records["ragged"]) if records["ragged"] else None
                entry[batch]["rollback"] = {"forward_ms": forward, "rollback_ms": rollback, "share": rollback / forward,
                                            "ragged_ms": ragged, "rounds": len(records["rollback"]),
                                            "ragged_rounds": len(records["ragged"])}
            base = entry[cfg.batches[0]]  # the baseline batch size
            for batch in cfg.batches:
                for mode in MODES:
                    figures = entry[batch][mode]
                    figures["vs_batch1"] = figures["tokens_per_forward"] / base[mode]["tokens_per_forward"]
        progress("perrow: rollback vs context")
        result["rollback_vs_context"] = [rollback_cost(target, max(cfg.batches), context, max(cfg.ks))
                                         for context in cfg.contexts]
    return result


def format_table(result: dict) -> str:
    """One row per (K, batch): tokens per target forward and tokens/s, lockstep vs per row, the rollback's cost."""
    cfg = result["config"]
    lines = [f"per-row vs lockstep on {result['checkpoint']} (CPU fp32, {cfg['threads']} thread(s), "
             f"{cfg['new_tokens']} new tokens x {max(cfg['batches'])} prompts, drafter "
             f"{'compiled' if cfg['compile'] else 'eager'})",
             "  K  batch  tok/fwd lockstep (vs b1)  tok/fwd per-row (vs b1)  tok/s lockstep  tok/s per-row"
             "  tok/s target  rollback ms (ragged) / forward ms (share)  same tokens"]
    for k, entry in result["ks"].items():
        for batch, row in entry.items():
            lock, per, rb = row["lockstep"], row["per_row"], row["rollback"]
            lines.append(
                f"{k:>3}  {batch:>5}  {lock['tokens_per_forward']:8.2f} ({lock['vs_batch1']:5.0%})"
                f"          {per['tokens_per_forward']:8.2f} ({per['vs_batch1']:5.0%})"
                f"         {lock['tokens_per_s']:8.1f}       {per['tokens_per_s']:8.1f}"
                f"      {result['target'][batch]['tokens_per_s']:8.1f}"
                f"      {rb['rollback_ms']:6.3f} ({_ms(rb['ragged_ms'])}) / {rb['forward_ms']:6.2f}"
                f" ({rb['share']:5.1%})"
                f"            {lock['same_tokens'] and per['same_tokens']}")
    for cost in result.get("rollback_vs_context", []):
        lines.append(f"rollback outside the loop, batch {cost['batch']}, K={cost['k']}, context {cost['context']}: "
                     f"{cost['rollback_ms']:.3f} ms vs verify forward {cost['forward_ms']:.2f} ms "
                     f"({cost['share']:.1%})")
    return "\n".join(lines)


def _ms(value) -> str:
    return "  -  " if value is None else f"{value:.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.perrow", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="distilled raw-layout checkpoint (default: tiny8, self-distilled)")
    parser.add_argument("--batches", default="1,4,8", help="comma-separated batch sizes, the first the baseline")
    parser.add_argument("--ks", default="1,4", help="comma-separated K values (default 1,4)")
    parser.add_argument("--new-tokens", type=int, default=PerRowConfig.new_tokens)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-compile", action="store_true", help="eager drafter (no compile time)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    cfg = PerRowConfig(batches=tuple(int(b) for b in args.batches.split(",")),
                       ks=tuple(int(k) for k in args.ks.split(",")), new_tokens=args.new_tokens,
                       threads=args.threads, compile=not args.no_compile)
    result = run_perrow(args.checkpoint or _distilled_tiny8(), cfg,
                        progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


def _distilled_tiny8():
    """The default checkpoint: the tiny8 preset, self-distilled (cached; the one ``bench.ksweep`` uses)."""
    from inkling_compiled.testing.synthetic import cached_checkpoint
    from inkling_compiled.training.distill import distill

    return distill(cached_checkpoint("tiny8"))


if __name__ == "__main__":
    sys.exit(main())
