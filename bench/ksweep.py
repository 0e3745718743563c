"""The K sweep (``depths`` section, ``--full``): for K = 1, 2, 4, 8 chained MTP depths per round on the end-to-end
target, tokens/s and acceptance at batch 1 and for one left-padded batch of 4, draft-round latency, and the cold
compile of the smallest and largest K in fresh processes. The batch of 4 drafts with eager drafters (the same
tokens; one compile per K fewer)."""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch

from inkling_compiled.runtime import Drafter, speculative_generate

from .e2e import generators, interleaved, load, prompt_batch
from .harness import Context, Stats, error_text, fmt, progress, random_rows, run_probe, samples_ms, table, yes
from .models import left_pad

PADDED_BATCH = 4


@dataclass
class KSweepConfig:
    ks: tuple[int, ...] = (1, 2, 4, 8)
    prompts: int = 4  # batch-1 prompts; the batch of PADDED_BATCH takes the first ones
    new_tokens: int = 64
    round_seconds: float = 1.0  # of timing per K and window
    threads: int = 1
    cold_compile: tuple[int, ...] = ()  # the Ks whose drafter compiles in a fresh process
    hf_mtp: bool = True
    compiled: bool = True  # False: eager drafters everywhere (the same tokens; for tests)


@dataclass
class Depths:
    target: str
    checkpoint: str
    prompts: int
    prompt_len: int
    new_tokens: int
    target_tokens_per_s: float
    batch4_target_tokens_per_s: float
    hf_mtp: dict | None = None
    ours: dict[str, dict] = field(default_factory=dict)


def pooled_acceptance(outputs) -> dict:
    """Acceptance figures pooled over several ``SpeculativeOutput`` (rounds weighted equally)."""
    k = outputs[0].num_speculative_tokens
    rows = sum(o.num_drafted for o in outputs) // k
    per_position = [sum(sum(r[j] for r in o.accepted_per_position_per_round) for o in outputs) / rows
                    for j in range(k)]
    return {"mean_accepted_length": sum(sum(o.emitted_per_round) for o in outputs) / rows,  # per (row, round)
            "acceptance_per_position": per_position, "per_sequence_accepted_length": 1 + sum(per_position),
            "rounds": sum(o.num_rounds for o in outputs)}


def hf_acceptance(rounds: list[list[int]], depths: int) -> tuple[list[float], float]:
    """(acceptance per position, tokens per round) of transformers' rounds ``[drafted, accepted]``: position j
    counts the rounds whose first j + 1 drafts were accepted."""
    drafting = [r for r in rounds if r[0] > 0]
    if not drafting:
        return [0.0] * depths, 1.0
    per_position = [sum(1 for r in drafting if r[1] > j) / len(drafting) for j in range(depths)]
    return per_position, 1 + sum(r[1] for r in drafting) / len(drafting)


def left_padded_batch(prompts: torch.Tensor, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first :data:`PADDED_BATCH` prompts, row b shortened by b tokens, as one left-padded batch."""
    return left_pad([prompts[b, b:] for b in range(PADDED_BATCH)], pad_token_id)


def round_latency(drafter: Drafter, batch: int, rows: int, seconds: float) -> tuple[dict, float]:
    """(:class:`Stats` of the wall ms, median thread-CPU ms) of ``drafter.draft`` on ``rows`` new verified rows
    per round, positions advancing (starting over before the cache's end)."""
    gen, calls, start = torch.Generator().manual_seed(0), [], 0
    for _ in range(64):
        start = 0 if start + rows >= drafter.max_length else start
        calls.append(random_rows(drafter.model, batch, start, rows, gen))
        start += rows
    cycle = itertools.cycle(calls)

    def draft():
        drafter.draft(*next(cycle), validate=False)

    with torch.no_grad():
        wall = samples_ms(draft, torch.device("cpu"), seconds)
        cpu = samples_ms(draft, torch.device("cpu"), seconds / 2, timer=time.thread_time)
    return Stats.of(wall), statistics.median(cpu)


def run_ksweep(checkpoint, cfg: KSweepConfig | None = None, *, prompts: torch.Tensor | None = None,
               target_label: str = "") -> Depths:
    """The sweep on ``checkpoint`` (a distilled raw-layout directory), CPU fp32; Ks beyond its depths left out."""
    cfg = cfg or KSweepConfig()
    torch.set_num_threads(cfg.threads)
    target, mtp = load(checkpoint)
    ks = tuple(k for k in cfg.ks if k <= mtp.config.num_depths)
    if not ks:
        raise ValueError(f"none of K = {cfg.ks} fits the checkpoint's {mtp.config.num_depths} MTP depth(s)")
    prompts = prompt_batch(prompts, max(cfg.prompts, PADDED_BATCH), 8, mtp.config.logits_vocab_size, 0)
    singles = [prompts[i:i + 1] for i in range(cfg.prompts)]
    batch_ids, batch_mask = left_padded_batch(prompts, target.generation_config.pad_token_id or 0)
    alone, transformers_mtp = generators(target, cfg.new_tokens)
    max_length = prompts.shape[1] + cfg.new_tokens + 8
    drafters = {k: Drafter(mtp, 1, max_length, num_speculative_tokens=k, compile=cfg.compiled) for k in ks}
    batch_drafters = {k: Drafter(mtp, PADDED_BATCH, max_length, num_speculative_tokens=k, compile=False)
                      for k in ks}

    def ours(k, batch=False):
        def run(ids, mask=None):
            out = speculative_generate(target, (batch_drafters if batch else drafters)[k], ids, mask,
                                       max_new_tokens=cfg.new_tokens)
            return out.sequences, out
        return run

    methods = {"target": alone, **({"hf_mtp": transformers_mtp} if cfg.hf_mtp else {}),
               **{f"ours_compiled_k{k}": ours(k) for k in ks}}
    figures = interleaved(methods, singles, "ksweep")  # batch 1; the warm-ups compile the drafters' windows
    with torch.no_grad():
        progress(f"ksweep: one left-padded batch of {PADDED_BATCH}, every K")
        padded, padded_s = {}, {}
        for name, fn in {"target": alone, **{k: ours(k, batch=True) for k in ks}}.items():
            fn(batch_ids, batch_mask)  # warm-up: the batch drafter's compiles
            start = time.perf_counter()
            padded[name] = fn(batch_ids, batch_mask)
            padded_s[name] = time.perf_counter() - start
        progress("ksweep: draft-round latency")
        rounds_ms = {k: {"1": round_latency(drafters[k], 1, 1, cfg.round_seconds),
                         "all": round_latency(drafters[k], 1, k + 1, cfg.round_seconds)} for k in ks}
    reference = [out for out, _ in figures["target"]["outputs"]]
    seconds = {name: f["seconds"] for name, f in figures.items()}

    def same(name: str) -> bool:
        return all(torch.equal(out, ref) for (out, _), ref in zip(figures[name]["outputs"], reference))

    tokens, batch_tokens = len(singles) * cfg.new_tokens, PADDED_BATCH * cfg.new_tokens
    record = Depths(target_label or f"distilled checkpoint {checkpoint}", str(checkpoint), len(singles),
                    prompts.shape[1], cfg.new_tokens, tokens / seconds["target"], batch_tokens / padded_s["target"])
    if cfg.hf_mtp:
        depths = target.config.get_text_config().num_mtp_layers
        per_position, per_round = hf_acceptance([r for _, rounds in figures["hf_mtp"]["outputs"] for r in rounds],
                                                depths)
        record.hf_mtp = {"k": depths, "tokens_per_s": tokens / seconds["hf_mtp"],
                         "speedup_vs_target": seconds["target"] / seconds["hf_mtp"], "mean_accepted_length": per_round,
                         "acceptance_per_position": per_position, "outputs_match_target": same("hf_mtp")}
    for k in ks:
        name = f"ours_compiled_k{k}"
        pooled = pooled_acceptance([out for _, out in figures[name]["outputs"]])
        batched = pooled_acceptance([padded[k][1]])
        record.ours[str(k)] = {
            "k": k, "tokens_per_s": tokens / seconds[name], "speedup_vs_target": seconds["target"] / seconds[name],
            "speedup_vs_hf_mtp": seconds["hf_mtp"] / seconds[name] if cfg.hf_mtp else None,
            "mean_accepted_length": pooled["mean_accepted_length"],
            "acceptance_per_position": pooled["acceptance_per_position"], "outputs_match_target": same(name),
            "draft_round_ms": {b: r[0] for b, r in rounds_ms[k].items() if b != "all"},
            "draft_round_cpu_ms": {b: r[1] for b, r in rounds_ms[k].items() if b != "all"},
            "draft_round_all_accepted_ms": rounds_ms[k]["all"][0], "compile_s": figures[name]["warmup_s"],
            "cold_compile": None,
            "batch4": {"tokens_per_s": batch_tokens / padded_s[k],
                       "speedup_vs_target": padded_s["target"] / padded_s[k],
                       **{key: batched[key] for key in ("mean_accepted_length", "acceptance_per_position",
                                                        "per_sequence_accepted_length")},
                       "outputs_match_target": torch.equal(padded[k][0], padded["target"][0])}}
    _cold_compiles(record, checkpoint, [k for k in cfg.cold_compile if str(k) in record.ours], cfg.threads)
    return record


def _cold_compiles(record: Depths, checkpoint, ks: list[int], threads: int) -> None:
    """Each K's drafter compiled in its own fresh process with an empty Inductor cache (a K that fails records
    its error), CPU seconds also as a ratio to the first K's."""
    first = None
    for k in ks:
        progress(f"ksweep: cold compile, K={k} (fresh process, empty Inductor cache)")
        point = record.ours[str(k)]
        try:
            with tempfile.TemporaryDirectory(prefix="ksweep-inductor-") as cache:
                found = run_probe("probes.k_compile", {"checkpoint": str(checkpoint), "k": k, "threads": threads},
                                  cache_dir=cache, timeout=1800)
        except Exception as e:  # noqa: BLE001 - keep the other Ks
            point["cold_compile"] = {"error": error_text(e)}
            continue
        first = first or found["cpu_s"]
        point["cold_compile"] = {**found, "ratio_to_first": found["cpu_s"] / first}


def measure(ctx: Context) -> Depths:
    s, target = ctx.settings, ctx.e2e_target()
    probed = sorted({min(s.ks), max(s.ks)}) if s.runs("kcompile") else ()
    cfg = KSweepConfig(ks=s.ks, prompts=s.e2e_prompts, new_tokens=s.e2e_tokens, round_seconds=s.k_seconds,
                       threads=s.threads, cold_compile=tuple(probed), hf_mtp=s.runs("peer"))
    return run_ksweep(target.checkpoint, cfg, prompts=target.prompts, target_label=target.label)


def lines(depths: dict) -> list[str]:
    hf = depths.get("hf_mtp")
    out = [f"K sweep ({depths['target']}; greedy, {depths['prompts']} prompt(s) x {depths['new_tokens']} new tokens, "
           f"batch 1, and one left-padded batch of {PADDED_BATCH})",
           f"  target alone (target.generate): {depths['target_tokens_per_s']:.1f} tok/s batch 1, "
           f"{depths['batch4_target_tokens_per_s']:.1f} tok/s batch {PADDED_BATCH}"
           + (f"; transformers generate(use_mtp=True, {hf['k']} depths): {hf['tokens_per_s']:.1f} tok/s, "
              f"{hf['mean_accepted_length']:.2f} tok/round, per position "
              f"{' '.join(f'{a:.2f}' for a in hf['acceptance_per_position'])}" if hf else "")]
    points = list(depths["ours"].values())
    rows = [["K", "tok/s", "vs target", "vs hf", "accepted len", "acceptance per position", "same",
             f"b{PADDED_BATCH} tok/s (eager)", "vs target", "len (batch / per seq)", "same"]]
    for p in points:
        b4 = p["batch4"]
        rows.append([str(p["k"]), f"{p['tokens_per_s']:.1f}", f"{p['speedup_vs_target']:.2f}x",
                     fmt(p["speedup_vs_hf_mtp"], ".2f", "x"), f"{p['mean_accepted_length']:.2f}",
                     " ".join(f"{a:.2f}" for a in p["acceptance_per_position"]), yes(p["outputs_match_target"]),
                     f"{b4['tokens_per_s']:.1f}", f"{b4['speedup_vs_target']:.2f}x",
                     f"{b4['mean_accepted_length']:.2f} / {b4['per_sequence_accepted_length']:.2f}",
                     yes(b4["outputs_match_target"])])
    out += table(rows, "  ")
    rows = [["K", "draft round ms b1 (cpu)", "b1 all accepted", "first calls s",
             "cold compile cpu s (wall)", "x first K", "graphs", "recompiles / 64 rounds"]]
    for p in points:
        r, cpu, cold = p["draft_round_ms"], p["draft_round_cpu_ms"], p["cold_compile"] or {}
        if "error" in cold:
            compiled = ["FAILED", "-", "-", "-"]
        elif cold:
            compiled = [f"{cold['cpu_s']:.1f} ({cold['wall_s']:.1f})", f"{cold['ratio_to_first']:.2f}x",
                        str(cold["graphs"]), str(cold["recompiles_over_64_rounds"])]
        else:
            compiled = ["-"] * 4
        rows.append([str(p["k"]), f"{r['1']['median_ms']:.2f} ({cpu['1']:.2f})",
                     f"{p['draft_round_all_accepted_ms']['median_ms']:.2f}",
                     fmt(p["compile_s"], ".1f"), *compiled])
    out += table(rows, "  ")
    out.append("  cold compile: K and K + 1-row windows, batch 1, each K in a fresh process; accepted len: tokens per "
               "target forward (docs/protocol.md §6.8)")
    return out
