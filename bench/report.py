"""The goals (a data table: each a figure read from a result, a bound, and what a run needs to measure it), the
headline summary and the ``bench/RESULTS.md`` entry, all from the result dict alone."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .harness import fmt, table


def _get(node: dict, *path):
    """``node[path[0]][path[1]]...``, None where any step is missing (a section skipped, failed or partial)."""
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def median(result: dict, preset: str, variant: str) -> float | None:
    return _get(result, "configs", preset, "latency", "batches", "1", "variants", variant, "median_ms")


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _largest_k_batch4(r: dict) -> float | None:
    ks = _get(r, "e2e", "batched", "ks") or {}
    largest = max(ks, key=int, default=None)
    return _get(ks, largest, "4", "per_row", "vs_batch1") if largest else None


def _k_compile_ratio(r: dict) -> float | None:
    probes = [p["cold_compile"] for p in (_get(r, "e2e", "rounds") or {}).values()
              if "cpu_s" in (p.get("cold_compile") or {})]
    return probes[-1]["ratio_to_first"] if len(probes) > 1 else None


def _tp_share(r: dict) -> float | None:
    full = _get(r, "tp", "full")
    return full["parameter_bytes"]["8"] / (full["unsharded_bytes"] / 8) if full else None


@dataclass(frozen=True)
class Goal:
    id: str
    text: str
    op: str  # how the value compares with the bound
    bound: float
    unit: str
    value: tuple | Callable[[dict], float | None]  # a path into the result, or a function of it
    needs: str  # what a run needs to measure it
    cpu: bool = False  # a CPU figure: not measured on another device


OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt}
_TINY = ("configs", "tiny")
GOALS = (
    Goal("cpu_tiny_vs_transformers", "CPU batch 1 fp32 tiny: compiled step faster than transformers' eager MtpModel "
         "step", ">=", 10, "x", lambda r: _over(median(r, "tiny", "hf_eager"), median(r, "tiny", "compiled"))
         if r["settings"]["dtype"] == "float32" else None, "--device cpu --dtype float32, tiny, batch 1, the peer",
         True),
    Goal("small_vs_gemm_floor", "small (H 1024, V 32000) batch 1: compiled step over the GEMM-only floor", "<=", 1.1,
         "x", lambda r: _over(median(r, "small", "cudagraph") or median(r, "small", "compiled"),
                              median(r, "small", "gemm_floor")), "--config small"),
    Goal("e2e_faster_than_target", "end to end K = 1: our speculative generation over the target alone", ">", 1, "x",
         ("e2e", "methods", "ours_compiled_k1", "speedup_vs_target"), "the e2e section"),
    Goal("gpu_full_vs_hbm_floor", "GPU full dims batch 1: CUDA-graph step over the HBM floor", "<=", 1.15, "x",
         lambda r: _over(median(r, "full", "cudagraph"), _get(r, "configs", "full", "latency", "batches", "1",
                                                                "bandwidth", "hbm_floor_ms")),
         "--device cuda --config full"),
    Goal("cpu_tiny_cold_compile", "cold compile of the draft step on CPU (tiny)", "<=", 20, " s",
         (*_TINY, "compile", "cold", "first_call_s"), "the compile section on CPU with tiny", True),
    Goal("cpu_tiny_warm_compile", "warm compile (FX graph cache hit) of the draft step on CPU (tiny)", "<=", 3, " s",
         (*_TINY, "compile", "warm", "first_call_s"), "the compile section on CPU with tiny", True),
    Goal("cpu_tiny_packaged_startup", "fresh process to the first packaged draft on CPU (tiny), imports included",
         "<=", 3, " s", (*_TINY, "packaged", "ratios", "startup_package_s"), "the packaged section on CPU with tiny",
         True),
    Goal("cpu_tiny_packaged_vs_transformers", "CPU tiny: packaged draft over transformers' MtpModel step", ">=", 15,
         "x", (*_TINY, "packaged", "ratios", "packaged_vs_transformers"),
         "--full (the packaged latency) on CPU with tiny", True),
    Goal("perrow_batch4_tokens_per_forward", "per-row acceptance: batch 4's tokens per target forward over batch "
         "1's (largest K)", ">=", 0.9, "x", _largest_k_batch4, "--full (the e2e section's batched part, CPU)"),
    Goal("startup_first_draft_vs_import_torch", "fresh process to the first packaged draft (tiny8, K = 8, CPU) over "
         "a fresh `import torch` alone", "<=", 1.3, "x", ("startup", "ratios", "first_draft_vs_import_torch"),
         "the startup section (CPU)"),
    Goal("startup_import_package", "`import inkling_compiled` on top of `import torch`", "<=", 0.5, " s",
         ("startup", "first_draft", "import_package_s"), "the startup section (CPU)"),
    Goal("startup_round_k_vs_round_1", "CPU K = 8 draft round over the K = 1 round (tiny8, batch 1)", "<=", 3, "x",
         ("startup", "ratios", "round_k_vs_round_1"), "the startup section (CPU)"),
    Goal("startup_round_k_vs_floor", "CPU K = 8 draft round over its GEMM floor (tiny8, batch 1)", "<=", 2, "x",
         ("startup", "ratios", "round_k_vs_floor"), "the startup section (CPU)"),
    Goal("k_sweep_compile_ratio", "cold compile of the largest K's drafter over the smallest K's (CPU seconds)", "<=",
         2, "x", _k_compile_ratio, "--full (the e2e section's rounds part)"),
    Goal("tp_head_share", "tensor-parallel greedy head at full dims, T = 8: a [B, V] gather over our [T, B, 2] pairs",
         ">=", 1000, "x", ("tp", "full", "head_ratio"), "the tp section"),
    Goal("tp_bytes_per_rank", "tensor-parallel full dims, T = 8: one rank's parameter bytes (embedding aside) over "
         "1/T of the unsharded model's", "<=", 1.05, "x", _tp_share, "the tp section"),
)


def evaluate_goals(result: dict) -> list[dict]:
    """Each goal with its measured value; ``met`` is None when this run did not measure it."""
    found = []
    for g in GOALS:
        if g.cpu and result["settings"]["device"] != "cpu":
            value = None
        else:
            value = _get(result, *g.value) if isinstance(g.value, tuple) else g.value(result)
        found.append({"id": g.id, "text": f"{g.text} {g.op} {g.bound:g}{g.unit.strip()}", "value": value,
                      "unit": g.unit, "met": None if value is None else OPS[g.op](value, g.bound),
                      "note": "" if value is not None else f"needs {g.needs}"})
    return found


def goal_lines(goals: list[dict]) -> list[str]:
    lines = ["goals (targets, not asserts)"]
    for g in goals:
        tag = "n/a" if g["met"] is None else "met" if g["met"] else "NOT MET"
        lines.append(f"  [{tag:>7}] {g['text']}: {fmt(g['value'], '.3g', g['unit'])}"
                     + (f"  ({g['note']})" if g["note"] else ""))
    return lines


def headline_lines(result: dict) -> list[str]:
    """The figures a newcomer asks for first, each beside what it is compared with."""
    rows = [["headline", "ours", "compared with", ""]]
    step, hf, floor = (median(result, "tiny", v) for v in ("compiled", "hf_eager", "gemm_floor"))
    if step:
        rows.append(["tiny draft step, ms (compiled)", fmt(step, ".3f"), f"transformers {fmt(hf, '.3f')}",
                     f"GEMM floor {fmt(floor, '.4f')}"])
    cold, warm = (_get(result, *_TINY, "compile", phase) or {} for phase in ("cold", "warm"))
    if cold.get("first_call_s"):
        rows.append(["compile of the step, s", f"cold {cold['first_call_s']:.1f}",
                     f"warm {fmt(warm.get('first_call_s'), '.1f')}", ""])
    methods = _get(result, "e2e", "methods") or {}
    target, hf_mtp = (_get(methods, name, "tokens_per_s") for name in ("target", "hf_mtp"))
    for name, m in methods.items():
        if name.startswith("ours_compiled_k"):
            rows.append([f"end to end K = {m['k']}, tok/s", f"{m['tokens_per_s']:.1f}",
                         f"target {fmt(target, '.1f')} ({m['speedup_vs_target']:.2f}x)",
                         f"generate(use_mtp=True) {fmt(hf_mtp, '.1f')}"
                         + (f" ({m['tokens_per_s'] / hf_mtp:.2f}x)" if hf_mtp else "")])
    startup = _get(result, *_TINY, "packaged", "startup", "package", "to_first_draft_s")
    if startup:  # beside spawn to the first compiled step: interpreter and imports, models, compile + run
        phases = ("import_s", "load_s", "first_call_s")
        cold_s, warm_s = (sum(p[k] for k in phases) if p else None for p in (cold, warm))
        rows.append(["start-up to the first draft, s", f"packaged {startup:.1f}", f"cold compile {fmt(cold_s, '.1f')}",
                     f"warm {fmt(warm_s, '.1f')}"])
    return table(rows) if len(rows) > 1 else []


def wall_line(result: dict) -> str:
    """The run's wall time, and apart from it what this machine built once for later runs (they skip it)."""
    built = {kind: s for kind, s in (result.get("one_time_s") or {}).items() if s >= 0.5}  # a later run's: none
    beside = result.get("one_time_beside_s") or 0.0
    if not built and beside < 2.0:  # a second process with nothing to build: its imports and loads
        return f"wall time {result['wall_s']:.0f} s"
    total = sum(built.values())
    parts = [", ".join(f"{kind} {s:.0f} s" for kind, s in built.items())] if built else []
    parts += [f"and {beside:.0f} s in a second process beside the measuring"] if beside >= 2.0 else []
    return (f"wall time {result['wall_s']:.0f} s: measuring {result['wall_s'] - total:.0f} s, one-time builds "
            f"{total:.0f} s ({'; '.join([*parts, 'cached: later runs skip them'])})")


def append_results(path: Path, result: dict, text: str) -> None:
    m = result["machine"]
    entry = [f"## {result['date']}", "", f"- command: `{result['command']}`",
             f"- machine: {m['cpu']}, {m['cores']} cores" + (f", {m['gpu']}" if m.get("gpu") else "")
             + f"; torch {m['torch']}, transformers {m['transformers']}, python {m['python']}", "", "```", text,
             "```", ""]
    new = not path.exists()
    with open(path, "a") as f:
        if new:
            f.write("# Benchmark results\n\nAppended by `python -m bench run --record` (one entry per run).\n\n")
        f.write("\n".join(entry) + "\n")
