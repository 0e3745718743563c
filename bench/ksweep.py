"""The K sweep: K = 1, 2, 4, 8 chained MTP depths per round on one distilled checkpoint (issues 11 and 12).

:func:`run_ksweep` returns the ``depths`` section of ``python -m bench.run`` (``records.Depths``): for each K the
checkpoint's depths allow, from one run,

* end to end: greedy batch-1 tokens/s of ``speculative_generate`` with a compiled K-depth drafter, its speed-up over
  the target alone (``target.generate(do_sample=False)``) and over transformers' ``generate(use_mtp=True)`` (every
  depth of its ``MtpModel``, batch 1), ``mean_accepted_length`` and ``acceptance_per_position`` (docs/protocol.md
  §6.8), whether the tokens equal the target's; and the same for one left-padded batch of 4 (``batch4``; each row
  advances by its own accepted length, so its mean accepted length stays that of the rows on their own,
  ``per_sequence_accepted_length``; ``bench.perrow`` compares with lockstep). The batch of 4 runs an eager drafter
  unless ``batch4_compiled`` (its compiled graphs are as many again as batch 1's: minutes of compile on a 2-core
  CPU; the acceptance figures are the same either way);
* ``draft_round_ms``: draft-round latency of the compiled drafter (``Drafter.draft`` on one new verified row, the
  K-row window after a rejection, positions advancing), batch 1 (and 4 with ``batch4_compiled``), wall ms, with the
  median thread-CPU ms beside it (one intra-op thread: the work itself, without the time another process held the
  core), and batch 1's K + 1-row window (all drafts accepted);
* ``cold_compile`` (the smallest and largest K, every K with ``cold_compile_every_k``): the compile of the
  K-depth drafter's greedy decode windows (K and K + 1 rows, batch 1) in a
  fresh subprocess with an empty Inductor cache: wall and CPU seconds (the process and its C++ compiler children,
  the steadier figure on a shared machine), CPU seconds over the first K's, graphs compiled, our passes' matches and
  recompiles over 64 rounds at advancing positions with every accepted count.

The methods take turns prompt by prompt, so drift on a shared machine hits them alike; every drafter gets an
untimed warm-up (its compiles: ``compile_s``) first.

    python -m bench.ksweep [--checkpoint DIR] [--ks 1,2,4,8] [--json out.json]

(default checkpoint: the ``tiny8`` synthetic preset, self-distilled and cached; ``python -m bench.run`` runs the
sweep on the text target with held-out prompts).
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
from pathlib import Path

import torch

from .timing import Stats

PROBE_PREFIX = "KSWEEP_PROBE: "
PADDED_BATCH = 4


@dataclass
class KSweepConfig:
    ks: tuple[int, ...] = (1, 2, 4, 8)
    prompts: int = 4  # batch-1 prompts; the batch of PADDED_BATCH takes the first ones
    prompt_len: int = 8
    new_tokens: int = 64
    latency_rounds: int = 200
    seed: int = 0
    threads: int = 1
    cold_compile: bool = True
    cold_compile_every_k: bool = False  # False: the smallest and largest K only (each probe is a cold compile)
    hf_mtp: bool = True
    batch4_compiled: bool = False  # the batch of 4 with compiled drafters too (their own graphs: minutes of compile)
    compiled: bool = True  # False: eager drafters everywhere (the same tokens; for tests)


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
    return {"wall_s": wall, "cpu_s": cpu, "graphs": graphs, "matches": passes.match_counts(),
            "recompiles_over_64_rounds": counters["stats"]["unique_graphs"] - graphs}


def cold_compile(checkpoint, k: int, threads: int = 1) -> dict:
    """:func:`compile_probe` in a subprocess with an empty Inductor cache (what a first run on a machine costs)."""
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="ksweep-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
        out = subprocess.run([sys.executable, "-m", "bench.ksweep", "--probe", str(k), "--checkpoint", str(checkpoint),
                              "--threads", str(threads)], cwd=repo, env=env, capture_output=True, text=True,
                             check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith(PROBE_PREFIX)]
    if out.returncode or not lines:
        raise RuntimeError(f"compile probe for K={k} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(lines[-1][len(PROBE_PREFIX):])


# ------------------------------------------------------------------------------------------------ round latency

def round_latency(drafter, batch: int, rows: int, rounds: int, seed: int = 0) -> tuple[dict, float]:
    """(``records.Stats`` of the wall ms, median thread-CPU ms) of ``drafter.draft`` on ``rows`` verified rows per
    round, positions advancing (and starting over before the cache's end), after 10 untimed rounds."""
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
                wall.append(1e3 * (time.perf_counter() - w0))
                cpu.append(1e3 * (time.thread_time() - c0))
    return Stats.of(wall).to_dict(), statistics.median(cpu)


# ------------------------------------------------------------------------------------------------ acceptance

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


def hf_acceptance(rounds: list[list[int]], depths: int) -> tuple[list[float], float]:
    """(acceptance per position, tokens per round) of transformers' MTP rounds ``[drafted, accepted]`` (from
    :func:`bench.e2e.count_hf_matches`): position j counts the rounds whose first j + 1 drafts were accepted."""
    drafting = [r for r in rounds if r[0] > 0]
    if not drafting:
        return [0.0] * depths, 1.0
    per_position = [sum(1 for r in drafting if r[1] > j) / len(drafting) for j in range(depths)]
    return per_position, 1 + sum(r[1] for r in drafting) / len(drafting)


def left_padded_batch(prompts: torch.Tensor, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first :data:`PADDED_BATCH` prompts as one left-padded batch: row b loses its first b tokens to
    padding, so the sequences have different lengths."""
    ids = prompts[:PADDED_BATCH].clone()
    mask = torch.ones_like(ids)
    for b in range(1, ids.shape[0]):
        ids[b, :b], mask[b, :b] = pad_token_id, 0
    return ids, mask


# ------------------------------------------------------------------------------------------------ the sweep

def _timed(fn) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run_ksweep(checkpoint, cfg: KSweepConfig | None = None, *, prompts: torch.Tensor | None = None,
               compile_checkpoint=None, progress=lambda msg: None) -> dict:
    """``records.Depths`` on ``checkpoint`` (a distilled raw-layout directory), on CPU in fp32.

    ``prompts`` [N, P] (N >= max(cfg.prompts, 4); e.g. held-out text) replace seeded random ids of
    ``cfg.prompt_len``. K values beyond the checkpoint's depths are left out. The cold compiles run on
    ``compile_checkpoint`` (default ``checkpoint``): weights do not matter there.
    """
    from inkling_compiled import InklingMTP
    from inkling_compiled.runtime import Drafter, speculative_generate
    from inkling_compiled.testing.synthetic import greedy_generation_config, load_hf_target

    from .e2e import count_hf_matches, prompt_batch

    cfg = cfg or KSweepConfig()
    torch.set_num_threads(cfg.threads)
    target = load_hf_target(checkpoint, dtype=torch.float32).requires_grad_(False)
    mtp = InklingMTP.from_pretrained(checkpoint, target=target)
    ks = tuple(k for k in cfg.ks if k <= mtp.config.num_depths)
    if not ks:
        raise ValueError(f"none of K = {cfg.ks} fits the checkpoint's {mtp.config.num_depths} MTP depth(s)")
    count = max(cfg.prompts, PADDED_BATCH)
    prompts = prompt_batch(prompts, count, cfg.prompt_len, mtp.config.logits_vocab_size, cfg.seed)
    singles = [prompts[i:i + 1] for i in range(cfg.prompts)]
    pad = target.generation_config.pad_token_id or 0
    batch_ids, batch_mask = left_padded_batch(prompts, pad)
    gconfig = greedy_generation_config(target, cfg.new_tokens)
    gconfig_mtp = greedy_generation_config(target, cfg.new_tokens)
    gconfig_mtp.use_mtp = True
    max_length = prompts.shape[1] + cfg.new_tokens + 8
    hf_depths = target.config.get_text_config().num_mtp_layers

    def target_alone(p, mask=None):
        return target.generate(p, attention_mask=torch.ones_like(p) if mask is None else mask,
                               generation_config=gconfig)

    def hf_mtp(p):
        with count_hf_matches() as rounds:
            out = target.generate(p, attention_mask=torch.ones_like(p), generation_config=gconfig_mtp)
        return out, rounds

    drafters = {k: Drafter(mtp, 1, max_length, num_speculative_tokens=k, compile=cfg.compiled) for k in ks}
    batch4_compiled = cfg.compiled and cfg.batch4_compiled
    batch_drafters = {k: Drafter(mtp, PADDED_BATCH, max_length, num_speculative_tokens=k,
                                 compile=batch4_compiled) for k in ks}
    compile_s = {}
    with torch.no_grad():
        progress("ksweep: warm-up of the target" + (" and transformers' MTP" if cfg.hf_mtp else ""))
        reference = [target_alone(p) for p in singles]
        batch_reference = target_alone(batch_ids, batch_mask)
        if cfg.hf_mtp:
            hf_mtp(singles[0])
        for k, drafter in drafters.items():
            progress(f"ksweep: K={k} warm-up (compiles the decode and prefill windows, batch 1"
                     + (f" and {PADDED_BATCH})" if batch4_compiled else ")"))
            t0 = time.perf_counter()
            speculative_generate(target, drafter, singles[0], max_new_tokens=cfg.new_tokens)
            compile_s[k] = time.perf_counter() - t0
            speculative_generate(target, batch_drafters[k], batch_ids, batch_mask, max_new_tokens=cfg.new_tokens)
        progress(f"ksweep: end to end, {len(singles)} prompt(s) x {cfg.new_tokens} tokens, methods interleaved")
        seconds = {name: 0.0 for name in ["target", "hf_mtp", *ks]}
        outputs = {k: [] for k in ks}
        hf_rounds, same, hf_same = [], dict.fromkeys(ks, True), True
        for i, p in enumerate(singles):
            _, seconds_target = _timed(lambda p=p: target_alone(p))
            seconds["target"] += seconds_target
            if cfg.hf_mtp:
                (out, rounds), t = _timed(lambda p=p: hf_mtp(p))
                seconds["hf_mtp"] += t
                hf_rounds += rounds
                hf_same &= torch.equal(out, reference[i])
            for k in ks:
                out, t = _timed(lambda k=k, p=p: speculative_generate(target, drafters[k], p,
                                                                      max_new_tokens=cfg.new_tokens))
                seconds[k] += t
                outputs[k].append(out)
                same[k] &= torch.equal(out.sequences, reference[i])
        progress(f"ksweep: one left-padded batch of {PADDED_BATCH}, every K "
                 f"({'compiled' if batch4_compiled else 'eager'} drafters)")
        _, batch_target_s = _timed(lambda: target_alone(batch_ids, batch_mask))
        batched = {}
        for k in ks:
            batched[k] = _timed(lambda k=k: speculative_generate(target, batch_drafters[k], batch_ids, batch_mask,
                                                                 max_new_tokens=cfg.new_tokens))
        progress(f"ksweep: draft-round latency ({cfg.latency_rounds} rounds per window)")
        rounds_ms = {}
        for k in ks:
            rounds_ms[k] = {"1": round_latency(drafters[k], 1, 1, cfg.latency_rounds, cfg.seed),
                            "all": round_latency(drafters[k], 1, k + 1, cfg.latency_rounds, cfg.seed)}
            if batch4_compiled:
                rounds_ms[k][str(PADDED_BATCH)] = round_latency(batch_drafters[k], PADDED_BATCH, 1,
                                                                  cfg.latency_rounds, cfg.seed)

    tokens = len(singles) * cfg.new_tokens
    batch_tokens = PADDED_BATCH * cfg.new_tokens
    result = {"checkpoint": str(checkpoint), "device": "cpu", "prompts": len(singles),
              "prompt_len": prompts.shape[1], "new_tokens": cfg.new_tokens,
              "target_tokens_per_s": tokens / seconds["target"],
              "batch4_target_tokens_per_s": batch_tokens / batch_target_s, "ours": {}, "hf_mtp": None,
              "compile_checkpoint": None}
    hf_speedup = {}
    if cfg.hf_mtp:
        per_position, per_round = hf_acceptance(hf_rounds, hf_depths)
        result["hf_mtp"] = {
            "k": hf_depths, "tokens_per_s": tokens / seconds["hf_mtp"],
            "speedup_vs_target": seconds["target"] / seconds["hf_mtp"], "mean_accepted_length": per_round,
            "acceptance_per_position": per_position, "outputs_match_target": hf_same, "draft_round_ms": {},
            "compile_s": None}
        hf_speedup = {k: seconds["hf_mtp"] / seconds[k] for k in ks}
    for k in ks:
        pooled, (out, t) = _acceptance(outputs[k]), batched[k]
        padded = _acceptance([out])
        result["ours"][str(k)] = {
            "k": k, "tokens_per_s": tokens / seconds[k], "speedup_vs_target": seconds["target"] / seconds[k],
            "speedup_vs_hf_mtp": hf_speedup.get(k), "mean_accepted_length": pooled["mean_accepted_length"],
            "acceptance_per_position": pooled["acceptance_per_position"], "outputs_match_target": same[k],
            "draft_round_ms": {b: r[0] for b, r in rounds_ms[k].items() if b != "all"},
            "draft_round_cpu_ms": {b: r[1] for b, r in rounds_ms[k].items() if b != "all"},
            "draft_round_all_accepted_ms": rounds_ms[k]["all"][0], "compile_s": compile_s[k], "cold_compile": None,
            "batch4": {"compiled": batch4_compiled, "tokens_per_s": batch_tokens / t,
                       "speedup_vs_target": batch_target_s / t,
                       "mean_accepted_length": padded["mean_accepted_length"],
                       "acceptance_per_position": padded["acceptance_per_position"],
                       "per_sequence_accepted_length": padded["per_sequence_accepted_length"],
                       "outputs_match_target": torch.equal(out.sequences, batch_reference)}}
    if cfg.cold_compile:
        probed = cfg.ks if cfg.cold_compile_every_k else sorted({min(cfg.ks), max(cfg.ks)})
        add_cold_compiles(result, compile_checkpoint or checkpoint, probed, cfg.threads, progress)
    return result


def add_cold_compiles(result: dict, checkpoint, ks, threads: int, progress=lambda msg: None) -> None:
    """Fill ``cold_compile`` of the points of ``result["ours"]`` whose K is in ``ks`` (each K in its own subprocess,
    one at a time; a K that fails records its error)."""
    result["compile_checkpoint"] = str(checkpoint)
    first = None
    for key, point in result["ours"].items():
        if point["k"] not in ks:
            continue
        progress(f"ksweep: cold compile, K={key} (subprocess, empty Inductor cache)")
        try:
            probe = cold_compile(checkpoint, point["k"], threads)
        except Exception as e:  # noqa: BLE001 - keep the other Ks
            point["cold_compile"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        first = first or probe["cpu_s"]
        point["cold_compile"] = {**probe, "ratio_to_first": probe["cpu_s"] / first}


def format_lines(depths: dict) -> list[str]:
    """The sweep as plain-text rows (one per K) next to the baselines."""
    hf = depths.get("hf_mtp")
    lines = [f"K sweep ({depths.get('target', depths['checkpoint'])}; greedy, {depths['prompts']} prompt(s) x "
             f"{depths['new_tokens']} new tokens, batch 1, and one left-padded batch of {PADDED_BATCH})",
             f"  target alone (target.generate): {depths['target_tokens_per_s']:.1f} tok/s batch 1, "
             f"{depths.get('batch4_target_tokens_per_s') or 0:.1f} tok/s batch {PADDED_BATCH}"
             + (f"; transformers generate(use_mtp=True, {hf['k']} depths): {hf['tokens_per_s']:.1f} tok/s, "
                f"{hf['mean_accepted_length']:.2f} tok/round, per position "
                f"{' '.join(f'{a:.2f}' for a in hf['acceptance_per_position'])}" if hf else "")]
    compiled = next((p["batch4"]["compiled"] for p in depths["ours"].values() if p.get("batch4")), None)
    rows = [["K", "tok/s", "vs target", "vs hf", "accepted len", "acceptance per position", "same",
             f"b{PADDED_BATCH} tok/s" + {True: " (compiled)", False: " (eager)"}.get(compiled, ""), "vs target",
             "len (batch / per seq)", "same"]]
    for point in depths["ours"].values():
        b4 = point.get("batch4") or {}
        vs_hf = point.get("speedup_vs_hf_mtp")
        rows.append([str(point["k"]), f"{point['tokens_per_s']:.1f}", f"{point['speedup_vs_target']:.2f}x",
                     "-" if vs_hf is None else f"{vs_hf:.2f}x", f"{point['mean_accepted_length']:.2f}",
                     " ".join(f"{a:.2f}" for a in point["acceptance_per_position"]),
                     "yes" if point["outputs_match_target"] else "NO",
                     f"{b4['tokens_per_s']:.1f}" if b4 else "-", f"{b4['speedup_vs_target']:.2f}x" if b4 else "-",
                     f"{b4['mean_accepted_length']:.2f} / {b4['per_sequence_accepted_length']:.2f}" if b4 else "-",
                     ("yes" if b4["outputs_match_target"] else "NO") if b4 else "-"])
    lines += _aligned(rows)
    rows = [["K", "draft round ms b1 (cpu)", f"b{PADDED_BATCH} (cpu)", "b1 all accepted", "first calls s",
             "cold compile cpu s (wall)", "x first K", "graphs", "recompiles / 64 rounds"]]
    for point in depths["ours"].values():
        r, cpu = point["draft_round_ms"], point.get("draft_round_cpu_ms") or {}
        allacc, cold = point.get("draft_round_all_accepted_ms"), point.get("cold_compile") or {}
        ms = [f"{r[b]['median_ms']:.2f} ({cpu[b]:.2f})" if b in r and b in cpu else "-"
              for b in ("1", str(PADDED_BATCH))]
        if "error" in cold:
            compiled = ["FAILED", "-", "-", "-"]
        elif cold:
            compiled = [f"{cold['cpu_s']:.1f} ({cold['wall_s']:.1f})", f"{cold['ratio_to_first']:.2f}x",
                        str(cold["graphs"]), str(cold["recompiles_over_64_rounds"])]
        else:
            compiled = ["-"] * 4
        rows.append([str(point["k"]), *ms,
                     f"{allacc['median_ms']:.2f}" if allacc else "-",
                     "-" if point.get("compile_s") is None else f"{point['compile_s']:.1f}", *compiled])
    lines += _aligned(rows)
    if depths.get("compile_checkpoint"):
        lines.append(f"  cold compile: K and K + 1-row windows, batch 1, each K in a fresh process on "
                     f"{depths['compile_checkpoint']}; accepted len: tokens per target forward (docs/protocol.md "
                     f"§6.8)")
    return lines


def _aligned(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows]


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
    print("\n".join(format_lines(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
