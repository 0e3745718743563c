"""Goals, the stdout table and the ``bench/RESULTS.md`` entry, all computed from the result dict alone; and
``python -m bench.report RESULT.json``, which draws the report image (:mod:`bench.plots`) of any saved result."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .ksweep import format_lines as format_depths
from .packaged import format_table as packaged_table
from .perrow import format_table as perrow_table

VARIANT_LABELS = {
    "eager": "ours eager",
    "compiled_nopasses": "ours compiled (stock Inductor)",
    "compiled": "ours compiled (+ our passes)",
    "compiled_call": "  same, compiled graph call only",
    "cudagraph": "ours compiled + CUDA graph",
    "hf_eager": "transformers MtpModel (eager)",
    "gemm_floor": "GEMM floor (the step's GEMMs alone)",
}
E2E_LABELS = {
    "target": "target.generate (greedy)",
    "target_loop": "target alone, minimal greedy loop",
    "hf_mtp": "transformers generate(use_mtp=True)",
    "ours_eager": "ours, eager drafter",
    "ours_compiled": "ours, compiled drafter",
}


# ---------------------------------------------------------------------------------------------------------- goals

def _latency(result: dict, preset: str, batch: int = 1) -> dict | None:
    cfg = result.get("configs", {}).get(preset)
    lat = (cfg or {}).get("latency") or {}
    return lat.get(str(batch))


def _median(lat: dict | None, variant: str) -> float | None:
    v = ((lat or {}).get("variants") or {}).get(variant)
    return v["median_ms"] if v else None


def _best_ours(lat: dict | None) -> tuple[str | None, float | None]:
    for name in ("cudagraph", "compiled"):
        m = _median(lat, name)
        if m is not None:
            return name, m
    return None, None


def _goal(gid: str, text: str, target: str, value: float | None, met: bool | None, unit: str, note: str = "") -> dict:
    return {"id": gid, "text": text, "target": target, "value": value, "unit": unit, "met": met, "note": note}


def evaluate_goals(result: dict) -> list[dict]:
    """Each goal of the issue with its measured value; ``met`` is None when this run did not measure it."""
    s = result["settings"]
    cpu, fp32 = s["device"] == "cpu", s["dtype"] == "float32"
    goals = []

    lat = _latency(result, "tiny") if cpu and fp32 else None
    hf, ours = _median(lat, "hf_eager"), _median(lat, "compiled")
    value = hf / ours if hf and ours else None
    goals.append(_goal("cpu_tiny_vs_transformers",
                       "CPU batch 1 fp32 tiny: compiled step >= 10x faster than transformers' eager MtpModel step",
                       ">= 10x", value, None if value is None else value >= 10, "x",
                       "" if value is not None else "needs --device cpu --dtype float32 with tiny, batch 1, the "
                       "compiled variant and the peer"))

    lat = _latency(result, "small")
    name, ours = _best_ours(lat)
    floor = _median(lat, "gemm_floor")
    value = ours / floor if ours and floor else None
    goals.append(_goal("small_vs_gemm_floor", "small (H 1024, V 32000) batch 1: compiled step <= 1.1x the GEMM-only "
                       "floor", "<= 1.1x", value, None if value is None else value <= 1.1, "x",
                       f"variant: {name}" if value is not None else "needs --config small (latency section)"))

    e2e = result.get("e2e") or {}
    methods = e2e.get("methods") or {}
    best = methods.get("ours_compiled") or methods.get("ours_eager")
    base = methods.get("target")
    value = best["tokens_per_s"] / base["tokens_per_s"] if best and base else None
    goals.append(_goal("e2e_tiny_faster_than_target", "end to end (K = 1): our speculative generation faster than "
                       "the target alone (target.generate)", "> 1x", value, None if value is None else value > 1,
                       "x", "" if value is not None else "needs the e2e section"))

    lat = _latency(result, "full") if s["device"].startswith("cuda") else None
    cg = _median(lat, "cudagraph")
    hbm = ((lat or {}).get("bandwidth") or {}).get("hbm_floor_ms")
    value = cg / hbm if cg and hbm else None
    goals.append(_goal("gpu_full_vs_hbm_floor", "GPU full dims batch 1: CUDA-graph step <= 1.15x the HBM floor",
                       "<= 1.15x", value, None if value is None else value <= 1.15, "x",
                       "" if value is not None else "needs --device cuda --config full"))

    comp = ((result.get("configs", {}).get("tiny") or {}).get("compile") or {}) if cpu else {}
    cold = (comp.get("cold") or {}).get("first_call_s")
    warm = (comp.get("warm") or {}).get("first_call_s")
    goals.append(_goal("cpu_tiny_cold_compile", "cold compile of the draft step on CPU (tiny) <= 20 s", "<= 20 s",
                       cold, None if cold is None else cold <= 20, "s",
                       "" if cold is not None else "needs the compile section on CPU with tiny"))
    goals.append(_goal("cpu_tiny_warm_compile", "warm compile (FX graph cache hit) of the draft step on CPU (tiny) "
                       "<= 3 s", "<= 3 s", warm, None if warm is None else warm <= 3, "s",
                       "" if warm is not None else "needs the compile section on CPU with tiny"))

    ratios = (((result.get("configs", {}).get("tiny") or {}).get("packaged") or {}).get("ratios") or {}) if cpu else {}
    start, speedup = ratios.get("startup_package_s"), ratios.get("packaged_vs_transformers")
    goals.append(_goal("cpu_tiny_packaged_startup", "fresh process to the first packaged draft on CPU (tiny), imports "
                       "included, <= 3 s", "<= 3 s", start, None if start is None else start <= 3, "s",
                       "" if start is not None else "needs the packaged section on CPU with tiny"))
    goals.append(_goal("cpu_tiny_packaged_vs_transformers", "CPU tiny: packaged draft >= 15x faster than "
                       "transformers' MtpModel step", ">= 15x", speedup, None if speedup is None else speedup >= 15,
                       "x", "" if speedup is not None else "needs the packaged section on CPU with tiny (fp32)"))

    batch4, k = None, None
    for key, entry in ((result.get("perrow") or {}).get("ks") or {}).items():  # the largest K's batch of 4
        row = {str(b): v for b, v in entry.items()}.get("4")
        if row and (k is None or int(key) > k):
            batch4, k = row["per_row"]["vs_batch1"], int(key)
    goals.append(_goal("perrow_batch4_tokens_per_forward", "per-row acceptance: batch 4 keeps >= 90 % of batch 1's "
                       "tokens per target forward (largest K of the perrow section)", ">= 0.9x", batch4,
                       None if batch4 is None else batch4 >= 0.9, "x",
                       f"K = {k}" if batch4 is not None else "needs the perrow section (CPU)"))

    probes = [p["cold_compile"] for p in ((result.get("depths") or {}).get("ours") or {}).values()
              if isinstance(p.get("cold_compile"), dict) and "cpu_s" in p["cold_compile"]]
    ratio = probes[-1]["ratio_to_first"] if len(probes) > 1 else None
    goals.append(_goal("k_sweep_compile_ratio", "cold compile of the largest K's drafter <= 2x the smallest K's (CPU "
                       "seconds)", "<= 2x", ratio, None if ratio is None else ratio <= 2, "x",
                       "" if ratio is not None else "needs the depths and kcompile sections"))
    return goals


# ---------------------------------------------------------------------------------------------------------- table

def _f(x, fmt="{:.3g}", none="-"):
    if x is None:
        return none
    if isinstance(x, float):
        return fmt.format(x)
    return str(x)


def _ms(x):
    if x is None:
        return "-"
    return f"{x:.4f}" if x < 0.1 else f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _rows(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        out.append(indent + "  ".join(cells).rstrip())
    return out


def _config_header(name: str, cfg: dict, settings: dict) -> str:
    m = cfg["model"]
    if m is None:
        return f"== {name}: models not built =="
    d = m["depth0"]
    kind = f"sliding W {d['window']}" if d["sliding"] else "full attention"
    return (f"== {name}: H {m['hidden_size']}, V {m['vocab_size']}, MLP {m['intermediate_size']}, depth 0 "
            f"{d['heads']}x{d['head_dim']} heads ({d['kv_heads']} kv, {kind}) | {m['weights']} weights | "
            f"{settings['device']} {settings['dtype']} | context {settings['context']} ==")


def _compile_lines(comp: dict) -> list[str]:
    cold, warm = comp.get("cold") or {}, comp.get("warm") or {}
    if comp.get("error"):
        return [f"compile: FAILED: {comp['error']}"]

    def g(d, k, fmt="{:.2f}"):
        v = d.get(k)
        return _f(v, fmt) if v is not None else "-"

    rows = [["compile (draft step, subprocess)", "cold", "warm"],
            ["first call: compile + run (s)", g(cold, "first_call_s"), g(warm, "first_call_s")],
            ["  Dynamo tracing (s)", g(cold, "dynamo_s"), g(warm, "dynamo_s")],
            ["  AOT + Inductor backend (s)", g(cold, "backend_s"), g(warm, "backend_s")],
            ["  of which Inductor compile_fx (s)", g(cold, "inductor_s"), g(warm, "inductor_s")],
            ["FX graph cache hit / miss", *(f"{d.get('fxgraph_cache_hit', '-')} / {d.get('fxgraph_cache_miss', '-')}"
                                            for d in (cold, warm))],
            [f"recompiles over {cold.get('recompile_steps', '-')} steps (moving positions)",
             str(cold.get("recompiles", "-")), str(warm.get("recompiles", "-"))],
            ["process wall incl. import + load (s)", g(cold, "process_s"), g(warm, "process_s")]]
    if cold.get("cuda_graph") or warm.get("cuda_graph"):
        rows.append(["CUDA-graph capture of the step (s)", g(cold.get("cuda_graph") or {}, "capture_s", "{:.3f}"),
                     g(warm.get("cuda_graph") or {}, "capture_s", "{:.3f}")])
    lines = _rows(rows, "")
    if warm and not comp.get("warm_cache_hit"):
        lines.append("  WARNING: the warm run did not hit the FX graph cache")
    return lines


def _kernel_lines(k: dict) -> list[str]:
    stock, ours = k.get("no_passes") or {}, k.get("passes") or {}

    def ext(d):
        return f"{d['extern_calls']} ({', '.join(d['extern_ops'])})" if d else "-"

    def matches(m):
        return ", ".join(f"{n} {c}" for n, c in m.items() if c) or "none"

    rows = [["generated code of the compiled step", "stock", "+ passes"],
            ["kernels (cpp_fused_ / triton)", str(stock.get("kernels", "-")), str(ours.get("kernels", "-"))],
            ["CPU loop nests (passes over memory)", str(stock.get("loop_nests", "-")),
             str(ours.get("loop_nests", "-"))],
            ["extern calls", ext(stock), ext(ours)],
            ["kernel launches", str(stock.get("kernel_launches", "-")), str(ours.get("kernel_launches", "-"))],
            ["launches (kernels + extern)", str(stock.get("launches", "-")), str(ours.get("launches", "-"))],
            ["pass matches", matches(k.get("matches_no_passes") or {}) if stock else "-",
             matches(k.get("matches_passes") or {}) if ours else "-"]]
    return _rows(rows, "")


def _latency_lines(lat: dict) -> list[str]:
    v, r = lat["variants"], lat.get("ratios", {})
    header = [f"latency, batch {lat['batch']} (ms)", "median", "p10-p90", "vs peer", "vs eager", "x floor"]
    bw = lat.get("bandwidth")
    if bw:
        header.append("HBM frac")
    rows = [header]
    for name in VARIANT_LABELS:  # in the table's order
        if name not in v:
            continue
        s = v[name]
        label = VARIANT_LABELS[name]
        if name == "gemm_floor":
            label += f" [{lat.get('gemm_calls', '?')} GEMMs]"
        row = [label, _ms(s["median_ms"]), f"{_ms(s['p10_ms'])}-{_ms(s['p90_ms'])}",
               _f((r.get("speedup_vs_peer") or {}).get(name), "{:.2f}x"),
               _f((r.get("speedup_vs_eager") or {}).get(name), "{:.2f}x"),
               _f((r.get("x_floor") or {}).get(name), "{:.2f}x")]
        if bw:
            row.append(_f((bw.get("achieved_fraction") or {}).get(name), "{:.0%}"))
        rows.append(row)
    lines = _rows(rows, "")
    lines.append("  vs peer / vs eager: how many times faster than transformers' step / our eager step; x floor: "
                 "times the GEMM-only floor")
    if "compiled_call" in v:
        lines.append("  'graph call only' = the compiled function on the Drafter's static buffers, without "
                     "Drafter.draft's copies / clones")
    for name, msg in (lat.get("errors") or {}).items():
        lines.append(f"  {name}: FAILED: {msg}")
    if bw:
        lines.append(f"  step must read {bw['step_bytes'] / 1e6:.1f} MB; copy bandwidth {bw['copy_gbps']:.0f} GB/s -> "
                     f"HBM floor {_ms(bw['hbm_floor_ms'])} ms")
    return lines


def _quant_lines(q: dict) -> list[str]:
    if q.get("error"):
        return [f"quant: FAILED: {q['error']}"]
    rows = [[f"quantized step, batch {q['batch']} (ms)", "median", "p10-p90", "x fp32 floor", "MB read", "compile s"]]
    for name, sch in q["schemes"].items():
        st = sch["step"]
        rows.append([name, _ms(st["median_ms"]), f"{_ms(st['p10_ms'])}-{_ms(st['p90_ms'])}",
                     f"{sch['x_fp32_floor']:.2f}x", f"{sch['step_bytes'] / 1e6:.2f}", _f(sch["compile_s"], "{:.1f}")])
    lines = _rows(rows, "")
    lines.append(f"  x fp32 floor: times the fp32 step's GEMMs alone ({_ms(q['fp32_floor_ms'])} ms), same run; "
                 "int8 schemes compile with the drafter's fast Inductor options")
    for name, msg in q["errors"].items():
        lines.append(f"  {name}: FAILED: {msg}")
    return lines


def _e2e_lines(e2e: dict) -> list[str]:
    if e2e.get("error"):
        return [f"end to end: FAILED: {e2e['error']}"]
    d = e2e.get("distill") or {}
    agree = d.get("agreement_after")
    lines = [f"end to end ({e2e.get('target', 'distilled tiny')}; greedy, batch 1, K = 1, {e2e['prompts']} prompts "
             f"x {e2e['new_tokens']} new tokens"
             + (f"; distilled depth agreement {', '.join(f'{a:.2f}' for a in agree)}" if agree else "") + ")"]
    rows = [["method", "tok/s", "ms/tok", "accept", "tok/round", "vs target", "same tokens"]]
    for name, m in e2e["methods"].items():
        rows.append([E2E_LABELS.get(name, name), f"{m['tokens_per_s']:.1f}", f"{m['ms_per_token']:.2f}",
                     _f(m.get("acceptance"), "{:.2f}"), _f(m.get("tokens_per_round"), "{:.2f}"),
                     f"{m['speedup_vs_target']:.2f}x",
                     "-" if m.get("outputs_match_target") is None else ("yes" if m["outputs_match_target"] else "NO")])
    lines += _rows(rows, "")
    if "hf_mtp" in e2e["methods"]:
        lines.append(f"  transformers drafts {e2e.get('hf_mtp_depths')} tokens per round (every depth), "
                     "ours 1 (depth 0)")
    return lines


def goal_lines(goals: list[dict]) -> list[str]:
    lines = ["goals (targets, not asserts)"]
    for g in goals:
        tag = "n/a" if g["met"] is None else "met" if g["met"] else "NOT MET"
        value = "-" if g["value"] is None else f"{g['value']:.3g}{g['unit']}"
        note = f"  ({g['note']})" if g["note"] else ""
        lines.append(f"  [{tag:>7}] {g['text']}: {value}{note}")
    return lines


def format_table(result: dict) -> str:
    s, m = result["settings"], result["machine"]
    lines = [f"inkling_compiled benchmark | {m['cpu']} ({m['cores']} cores{', ' + m['gpu'] if m.get('gpu') else ''}) | "
             f"torch {m['torch']} | transformers {m['transformers']} | {s['threads']} thread(s)"]
    for name, cfg in result["configs"].items():
        lines += ["", _config_header(name, cfg, s)]
        if cfg.get("compile"):
            lines += _compile_lines(cfg["compile"])
        if cfg.get("kernels"):
            lines += [""] + _kernel_lines(cfg["kernels"])
        for lat in (cfg.get("latency") or {}).values():
            lines += [""] + _latency_lines(lat)
        if cfg.get("quant"):
            lines += [""] + _quant_lines(cfg["quant"])
        if cfg.get("packaged"):
            lines += [""] + packaged_table(cfg["packaged"]).splitlines()
        if cfg.get("error"):
            lines.append(f"FAILED: {cfg['error']}")
    if result.get("e2e"):
        lines += [""] + _e2e_lines(result["e2e"])
    if result.get("perrow"):
        perrow = result["perrow"]
        lines += [""] + ([f"per-row vs lockstep: FAILED: {perrow['error']}"] if perrow.get("error")
                         else perrow_table(perrow).splitlines())
    if result.get("depths"):
        depths = result["depths"]
        lines += [""] + ([f"K sweep: FAILED: {depths['error']}"] if depths.get("error") else format_depths(depths))
    lines += [""] + goal_lines(result["goals"])
    lines.append(f"\nwall time {result['wall_s']:.0f} s")
    return "\n".join(lines)


def append_results(path: Path, result: dict, table: str) -> None:
    m = result["machine"]
    entry = [f"## {result['date']}", "",
             f"- command: `{result['command']}`",
             f"- machine: {m['cpu']}, {m['cores']} cores" + (f", {m['gpu']}" if m.get("gpu") else "") +
             f"; torch {m['torch']}, transformers {m['transformers']}, python {m['python']}",
             "", "```", table, "```", ""]
    new = not path.exists()
    with open(path, "a") as f:
        if new:
            f.write("# Benchmark results\n\nAppended by `python -m bench.run --record` (one entry per run; the JSON "
                    "of every run goes under bench/out/ or to `--json`).\n\n")
        f.write("\n".join(entry) + "\n")


# ---------------------------------------------------------------------------------------------------------- CLI

def load_result(path: Path) -> dict:
    """A saved result, checked against ``bench.records.Result`` (a partial one is fine); SystemExit naming the
    problem otherwise."""
    from .records import SCHEMA_ID, problems

    try:
        result = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path}: not a readable JSON file ({e})") from None
    found = problems(result)
    if found:
        schema = result.get("schema") if isinstance(result, dict) else None
        raise SystemExit(f"{path} is not a bench.run result of schema {SCHEMA_ID} (its schema: {schema!r}); "
                         f"{len(found)} problem(s), first: {'; '.join(found[:3])}")
    return result


def main(argv=None) -> int:
    from .plots import MISSING_HINT, MatplotlibMissing, draw_report

    p = argparse.ArgumentParser(prog="python -m bench.report",
                                description="Draw the report image (PNG) of a saved `python -m bench.run` result "
                                            "and print its path.")
    p.add_argument("result", type=Path, help="the JSON a run wrote (bench/out/bench-*.json or --json)")
    p.add_argument("--out", type=Path, default=None, help="where the PNG goes (default: beside the JSON, .png)")
    a = p.parse_args(argv)
    result = load_result(a.result)
    out = a.out or a.result.with_suffix(".png")
    try:
        drawn = draw_report(result, out)
    except MatplotlibMissing:
        raise SystemExit(MISSING_HINT.format(json=a.result)) from None
    except OSError as e:
        raise SystemExit(f"cannot write {out}: {e.strerror or e}; choose another place with --out") from None
    if drawn.path is None:
        raise SystemExit(f"{a.result}: nothing to draw (not measured: {'; '.join(drawn.left_out)})")
    print(drawn.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
