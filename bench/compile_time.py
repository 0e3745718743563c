"""Cold and warm compile of the one-token draft step, each in a fresh process: the ``compile`` section."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

from .harness import Context, error_text, fmt, keep_compiles, progress, run_probe, table


@dataclass
class Compile:
    batch: int
    cold: dict | None = None  # bench.probes.step_compile, fresh TORCHINDUCTOR_CACHE_DIR
    warm: dict | None = None  # the same again, same cache dir
    warm_cache_hit: bool | None = None
    error: str | None = None


def measure(ctx: Context) -> Compile:
    s = ctx.settings
    ctx.models()  # built (a checkpoint generated once) before the probes load them again
    record = Compile(min(s.batch_sizes))
    args = {"preset": ctx.preset, "weights": s.weights, "device": s.device, "dtype": s.dtype, "batch": record.batch,
            "context": s.context, "max_length": s.max_length, "threads": s.threads, "steps": s.recompile_steps}
    with tempfile.TemporaryDirectory(prefix="inkling-bench-inductor-", ignore_cleanup_errors=True) as cache_dir:
        try:
            for phase in ("cold", "warm"):
                progress(f"{ctx.preset}: {phase} compile of the draft step in a fresh process")
                found = run_probe("probes.step_compile", args, cache_dir=cache_dir, timeout=s.probe_timeout)
                setattr(record, phase, found)
                progress(f"{ctx.preset}: {phase} first call {found['first_call_s']:.1f} s "
                         f"(FX graph cache hit {found['fxgraph_cache_hit']})")
            record.warm_cache_hit = record.warm["fxgraph_cache_hit"] >= 1
        except Exception as e:  # noqa: BLE001 - recorded; the other sections go on
            progress(f"{ctx.preset}: compile FAILED: {e}")
            record.error = error_text(e)
        try:
            keep_compiles(cache_dir)  # the latency section's compiled step is the same graph
        except OSError as e:  # it compiles for itself then
            progress(f"{ctx.preset}: the probe's compiles not kept ({e})")
    return record


def lines(comp: dict) -> list[str]:
    if comp.get("error"):
        return [f"compile: FAILED: {comp['error']}"]
    cold, warm = comp.get("cold") or {}, comp.get("warm") or {}
    rows = [["compile (draft step, fresh process)", "cold", "warm"]]
    for label, key in (("first call: compile + run (s)", "first_call_s"), ("  Dynamo tracing (s)", "dynamo_s"),
                       ("  AOT + Inductor backend (s)", "backend_s"), ("  of which Inductor compile_fx (s)",
                       "inductor_s"), ("process wall incl. import + load (s)", "process_s")):
        rows.append([label, fmt(cold.get(key)), fmt(warm.get(key))])
    rows.append(["FX graph cache hit / miss",
                 *(f"{d.get('fxgraph_cache_hit', '-')} / {d.get('fxgraph_cache_miss', '-')}" for d in (cold, warm))])
    rows.append([f"recompiles over {cold.get('recompile_steps', '-')} steps (moving positions)",
                 str(cold.get("recompiles", "-")), str(warm.get("recompiles", "-"))])
    if cold.get("cuda_graph") or warm.get("cuda_graph"):
        rows.append(["CUDA-graph capture of the step (s)", *(fmt((d.get("cuda_graph") or {}).get("capture_s"), ".3f")
                                                             for d in (cold, warm))])
    out = table(rows)
    if warm and not comp.get("warm_cache_hit"):
        out.append("  WARNING: the warm run did not hit the FX graph cache")
    return out
