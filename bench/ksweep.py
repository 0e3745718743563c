"""The K sweep: K = 1, 2, 4, 8 chained MTP depths per round on one distilled checkpoint (issue 11).

:func:`run_ksweep` returns, for each K, from one run:

* ``compile``: the cold compile of a drafter's greedy decode windows (K and K + 1 rows, batch 1), each K in a fresh
  subprocess with an empty Inductor cache: wall seconds and CPU seconds (the process and its C++ compiler children,
  the steadier figure on a shared machine), graphs compiled, our passes' match counts, and recompiles over 64 rounds
  at advancing positions with every accepted count. ``compile_ratio`` is K's CPU seconds over K = 1's.
* ``round_ms``: draft-round latency of the compiled drafter (``Drafter.draft`` on the verified rows of a round, at
  advancing positions), batch 1 and 4, the K-row window (after a rejection) and, batch 1, the K + 1-row one (all
  accepted): median wall ms and median thread-CPU ms (one intra-op thread: the work itself, without the time another
  process held the core).
* ``e2e``: greedy batch-1 tokens/s of ``speculative_generate`` with that drafter, ``mean_accepted_length``,
  ``acceptance_per_position``, ``1 + sum(acceptance_per_position)`` (what each sequence accepted: equal to the mean
  accepted length at batch 1), the same for one left-padded batch of 4 (per-row acceptance), and whether
  the tokens equal the target's greedy ``generate``.

Baselines from the same run, on the same prompts: the target alone (``generate(do_sample=False)``) and transformers'
``generate(use_mtp=True)`` (every depth of its ``MtpModel``, batch 1).

    python -m bench.ksweep [--checkpoint DIR] [--ks 1,2,4,8] [--json out.json]

(default checkpoint: the ``tiny8`` synthetic preset, self-distilled and cached).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

PROBE_PREFIX = "KSWEEP_PROBE: "


@dataclass
class KSweepConfig:
    ks: tuple[int, ...] = (1, 2, 4, 8)
    prompts: int = 4
    prompt_len: int = 8
    new_tokens: int = 64
    latency_rounds: int = 200
    seed: int = 0
    threads: int = 1


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _rows(config, batch: int, start: int, rows: int, gen: torch.Generator):
    ids = torch.randint(3, config.logits_vocab_size, (batch, rows), generator=gen)
    positions = torch.arange(start, start + rows)[None].expand(batch, rows).contiguous()
    return ids, positions, torch.randn(batch, rows, config.hidden_size, generator=gen)


# ------------------------------------------------------------------------------------------------ cold compile

def compile_probe(checkpoint, k: int, threads: int = 1) -> dict:
    """In this process (fresh Inductor cache expected): compile K's greedy decode windows at batch 1, then count
    recompiles over 64 rounds of 1..K+1 verified rows."""
    from torch._dynamo.utils import counters

    from inkling_compiled import InklingMTP, passes
    from inkling_compiled.runtime import Drafter

    torch.set_num_threads(threads)
    mtp = InklingMTP.from_pretrained(checkpoint)
    drafter = Drafter(mtp, 1, 1024, num_speculative_tokens=k, batch_buckets=(1,))
    passes.reset_match_counts()
    cpu0, wall0 = _cpu_seconds(), time.perf_counter()
    drafter.capture((1,))
    wall, cpu = time.perf_counter() - wall0, _cpu_seconds() - cpu0
    graphs = counters["stats"]["unique_graphs"]
    gen, start = torch.Generator().manual_seed(1), 0
    for i in range(64):
        rows = i % (k + 1) + 1
        drafter.draft(*_rows(mtp.config, 1, start, rows, gen), validate=False)
        start += rows
    return {"k": k, "wall_s": wall, "cpu_s": cpu, "graphs": graphs, "matches": passes.match_counts(),
            "recompiles_over_64_rounds": counters["stats"]["unique_graphs"] - graphs}


def cold_compile(checkpoint, k: int, threads: int = 1) -> dict:
    """:func:`compile_probe` in a subprocess with an empty Inductor cache (what a first run on a machine costs)."""
    with tempfile.TemporaryDirectory(prefix="ksweep-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
        out = subprocess.run([sys.executable, "-m", "bench.ksweep", "--probe", str(k), "--checkpoint", str(checkpoint),
                              "--threads", str(threads)], env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith(PROBE_PREFIX)]
    if out.returncode or not lines:
        raise RuntimeError(f"compile probe for K={k} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(lines[-1][len(PROBE_PREFIX):])


# ------------------------------------------------------------------------------------------------ round latency

def round_latency(drafter, batch: int, rows: int, rounds: int, seed: int = 0) -> dict:
    """Median ms (wall and thread CPU) of ``drafter.draft`` on ``rows`` verified rows per round, positions advancing
    (and starting over before the cache's end), after 10 untimed rounds."""
    config = drafter.model.config
    gen = torch.Generator().manual_seed(seed)
    calls = []
    start = 0
    for _ in range(rounds + 10):
        if start + rows >= drafter.max_length:
            start = 0
        calls.append(_rows(config, batch, start, rows, gen))
        start += rows
    wall, cpu = [], []
    with torch.no_grad():
        for i, call in enumerate(calls):
            w0, c0 = time.perf_counter(), time.thread_time()
            drafter.draft(*call, validate=False)
            if i >= 10:
                wall.append(time.perf_counter() - w0)
                cpu.append(time.thread_time() - c0)
    return {"wall_ms": 1e3 * statistics.median(wall), "cpu_ms": 1e3 * statistics.median(cpu), "rounds": rounds}


# ------------------------------------------------------------------------------------------------ end to end

def _timed(fn) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run_ksweep(checkpoint, cfg: KSweepConfig | None = None, progress=lambda msg: None) -> dict:
    """Every figure of the K sweep on ``checkpoint`` (a distilled raw-layout directory with >= max(ks) depths), on
    CPU in fp32."""
    from inkling_compiled import InklingMTP
    from inkling_compiled.runtime import Drafter, speculative_generate
    from inkling_compiled.testing.synthetic import greedy_generation_config, load_hf_target

    from .e2e import count_hf_matches

    cfg = cfg or KSweepConfig()
    torch.set_num_threads(cfg.threads)
    result: dict = {"checkpoint": str(checkpoint), "config": cfg.__dict__, "ks": {}}
    for k in cfg.ks:
        progress(f"ksweep: cold compile, K={k} (subprocess)")
        result["ks"][k] = {"compile": cold_compile(checkpoint, k, cfg.threads)}
    base = result["ks"][cfg.ks[0]]["compile"]["cpu_s"]
    for k in cfg.ks:
        result["ks"][k]["compile_ratio"] = result["ks"][k]["compile"]["cpu_s"] / base

    target = load_hf_target(checkpoint, dtype=torch.float32).requires_grad_(False)
    mtp = InklingMTP.from_pretrained(checkpoint, target=target)
    vocab = mtp.config.logits_vocab_size
    gen = torch.Generator().manual_seed(cfg.seed + 1000)
    prompts = [torch.randint(3, vocab, (1, cfg.prompt_len), generator=gen) for _ in range(cfg.prompts)]
    batch_ids = torch.cat(prompts)
    batch_mask = torch.ones_like(batch_ids)
    for b in range(1, len(prompts)):  # left padding: the batch's sequences have different lengths
        batch_ids[b, :b], batch_mask[b, :b] = 0, 0
    gconfig = greedy_generation_config(target, cfg.new_tokens)
    gconfig_mtp = greedy_generation_config(target, cfg.new_tokens)
    gconfig_mtp.use_mtp = True
    max_length = cfg.prompt_len + cfg.new_tokens + 8

    def target_alone(p):
        return target.generate(p, attention_mask=torch.ones_like(p), generation_config=gconfig)

    drafters = {k: Drafter(mtp, len(prompts), max_length, num_speculative_tokens=k, batch_buckets=(1, len(prompts)))
                for k in cfg.ks}
    with torch.no_grad():
        reference = [target_alone(p) for p in prompts]  # also the warm-up of the target
        for k, drafter in drafters.items():
            progress(f"ksweep: K={k} warm-up (compiles the decode and prefill windows, batch 1 and 4)")
            speculative_generate(target, drafter, prompts[0], max_new_tokens=cfg.new_tokens)
            speculative_generate(target, drafter, batch_ids, batch_mask, max_new_tokens=cfg.new_tokens)
            entry = result["ks"][k]
            entry["round_ms"] = {
                "batch1_k_rows": round_latency(drafter, 1, 1, cfg.latency_rounds, cfg.seed),
                "batch1_k_plus_1_rows": round_latency(drafter, 1, k + 1, cfg.latency_rounds, cfg.seed),
                "batch4_k_rows": round_latency(drafter, len(prompts), 1, cfg.latency_rounds, cfg.seed),
            }
        progress("ksweep: end to end, methods interleaved prompt by prompt")
        seconds = {name: 0.0 for name in ["target", "hf_mtp", *cfg.ks]}
        stats = {k: [] for k in cfg.ks}
        hf_rounds, same = [], {k: True for k in cfg.ks}
        for i, p in enumerate(prompts):
            _, t = _timed(lambda p=p: target_alone(p))
            seconds["target"] += t
            with count_hf_matches() as rounds:
                _, t = _timed(lambda p=p: target.generate(p, attention_mask=torch.ones_like(p),
                                                          generation_config=gconfig_mtp))
            seconds["hf_mtp"] += t
            hf_rounds += rounds
            for k in cfg.ks:
                out, t = _timed(lambda k=k, p=p: speculative_generate(target, drafters[k], p,
                                                                      max_new_tokens=cfg.new_tokens))
                seconds[k] += t
                stats[k].append(out)
                same[k] &= torch.equal(out.sequences, reference[i])
        tokens = cfg.prompts * cfg.new_tokens
        result["target_tokens_per_s"] = tokens / seconds["target"]
        hf_drafted = sum(r[0] for r in hf_rounds)
        result["hf_mtp"] = {"tokens_per_s": tokens / seconds["hf_mtp"],
                            "acceptance": sum(r[1] for r in hf_rounds) / hf_drafted if hf_drafted else None,
                            "tokens_per_round": (tokens - cfg.prompts) / len(hf_rounds) if hf_rounds else None}
        for k in cfg.ks:
            batched = speculative_generate(target, drafters[k], batch_ids, batch_mask, max_new_tokens=cfg.new_tokens)
            result["ks"][k]["e2e"] = {
                "tokens_per_s": tokens / seconds[k],
                "speedup_vs_target": seconds["target"] / seconds[k],
                "speedup_vs_hf_mtp": seconds["hf_mtp"] / seconds[k],
                "outputs_match_target": same[k],
                **_acceptance(stats[k]),
                "batch4": _acceptance([batched]),
            }
    return result


def _acceptance(outputs) -> dict:
    """Pooled acceptance figures of several :class:`SpeculativeOutput` (rounds weighted equally)."""
    k = outputs[0].num_speculative_tokens
    rows = sum(o.num_drafted for o in outputs) // k
    per_position = [sum(sum(r[j] for r in o.accepted_per_position_per_round) for o in outputs) / rows
                    for j in range(k)]
    rounds = sum(o.num_rounds for o in outputs)
    return {"mean_accepted_length": sum(sum(o.emitted_per_round) for o in outputs) / rows,  # per (row, round)
            "acceptance_per_position": per_position, "per_sequence_accepted_length": 1 + sum(per_position),
            "rounds": rounds}


def format_table(result: dict) -> str:
    """The sweep as plain-text rows (one per K) next to the baselines."""
    lines = [f"K sweep on {result['checkpoint']} (CPU fp32, {result['config']['threads']} thread(s))",
             f"target alone (generate greedy): {result['target_tokens_per_s']:.1f} tok/s; transformers "
             f"generate(use_mtp=True): {result['hf_mtp']['tokens_per_s']:.1f} tok/s, "
             f"{result['hf_mtp']['tokens_per_round']:.2f} tok/round",
             "  K  cold compile cpu s (wall s, x K=1)  round ms b1 (cpu)  b1 K+1 rows  b4 (cpu)  tok/s  vs target"
             "  vs hf  accepted len (b4 / per seq)  acceptance per position  same tokens"]
    for k, e in result["ks"].items():
        c, r, x = e["compile"], e["round_ms"], e["e2e"]
        lines.append(
            f"{k:>3}  {c['cpu_s']:6.1f} ({c['wall_s']:6.1f}, {e['compile_ratio']:.2f}x)          "
            f"{r['batch1_k_rows']['wall_ms']:6.2f} ({r['batch1_k_rows']['cpu_ms']:.2f})  "
            f"{r['batch1_k_plus_1_rows']['wall_ms']:6.2f}  {r['batch4_k_rows']['wall_ms']:6.2f} "
            f"({r['batch4_k_rows']['cpu_ms']:.2f})  {x['tokens_per_s']:6.1f}  {x['speedup_vs_target']:.2f}x  "
            f"{x['speedup_vs_hf_mtp']:.2f}x  {x['mean_accepted_length']:.2f} "
            f"({x['batch4']['mean_accepted_length']:.2f} / {x['batch4']['per_sequence_accepted_length']:.2f})  "
            f"{' '.join(f'{a:.2f}' for a in x['acceptance_per_position'])}  {x['outputs_match_target']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ksweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="distilled raw-layout checkpoint (default: tiny8, self-distilled)")
    parser.add_argument("--ks", default="1,2,4,8", help="comma-separated K values (default 1,2,4,8)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--probe", type=int, help=argparse.SUPPRESS)  # internal: one cold-compile probe
    args = parser.parse_args(argv)
    if args.probe is not None:
        print(PROBE_PREFIX + json.dumps(compile_probe(args.checkpoint, args.probe, args.threads)), flush=True)
        return 0
    checkpoint = args.checkpoint
    if checkpoint is None:
        from inkling_compiled.testing.synthetic import cached_checkpoint
        from inkling_compiled.training.distill import distill

        checkpoint = distill(cached_checkpoint("tiny8"))
    cfg = KSweepConfig(ks=tuple(int(k) for k in args.ks.split(",")), threads=args.threads)
    result = run_ksweep(checkpoint, cfg, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
