"""``python -m bench.run``: what an inference engineer wants to know before adopting inkling_compiled.

One run measures, side by side, on a seeded synthetic checkpoint generated locally (default: ``tiny``, CPU, fp32,
batch 1, context 64):

* compile: cold (fresh Inductor cache dir) and warm (same dir again) compile of the one-token draft step, each in
  its own subprocess, with the Dynamo / backend split, the FX graph cache counters, recompiles over N steps and, on
  CUDA, the CUDA-graph capture time;
* generated code: kernels, loop nests, extern calls and our passes' match counts, stock Inductor vs with passes;
* latency of the one-token draft step after an eager prefill of ``--context`` rows: our eager model, compiled
  without / with our passes, with CUDA graphs (CUDA), transformers' eager ``MtpModel`` step on the same weights, and
  the step's GEMMs alone (the floor); on CUDA also the bytes the step must read against measured copy bandwidth;
* end to end on a self-distilled tiny target: tokens/s and acceptance of our speculative generation vs the target
  alone vs transformers' ``generate(use_mtp=True)``.

It prints a table (progress on stderr), writes ``--json``, and appends an entry to ``bench/RESULTS.md``. Goals are
printed with the measured value and met / not met; they are targets, not asserts (the exit code is 0 either way).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import report
from .schema import SCHEMA_ID

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
RESULTS_MD = BENCH_DIR / "RESULTS.md"
SECTIONS = ("compile", "kernels", "stock", "compiled", "peer", "floor", "e2e")

_T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[bench {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------ machine

def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int) -> dict:
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    info = {"cpu": cpu_name(), "cores": os.cpu_count() or 1, "gpu": gpu, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "threads": threads,
            "platform": platform.platform()}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - optional
        info["triton"] = None
    return info


# ------------------------------------------------------------------------------------------------------ compile

def run_compile_probe(probe_args: dict, cache_dir: str, timeout: float) -> dict:
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    env["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "bench.compile_probe", json.dumps(probe_args)], cwd=REPO_DIR,
                          env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    from .compile_probe import PREFIX

    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
        raise RuntimeError(f"compile probe failed (exit {proc.returncode}): " + " | ".join(tail))
    result = json.loads(lines[-1][len(PREFIX):])
    result["process_s"] = wall
    return result


def compile_section(preset: str, checkpoint, args, device: str) -> dict:
    probe_args = {"preset": preset, "checkpoint": str(checkpoint) if checkpoint else None, "weights": args.weights,
                  "device": device, "dtype": args.dtype, "batch": min(args.batch_sizes), "context": args.context,
                  "max_length": args.max_length, "threads": args.threads, "steps": args.recompile_steps,
                  "passes": True}
    cache_dir = tempfile.mkdtemp(prefix="inkling-bench-inductor-")
    try:
        progress(f"{preset}: cold compile in a subprocess (fresh TORCHINDUCTOR_CACHE_DIR {cache_dir})")
        cold = run_compile_probe(probe_args, cache_dir, args.probe_timeout)
        progress(f"{preset}: cold first call {cold['first_call_s']:.1f} s; warm compile (same cache dir)")
        warm = run_compile_probe(probe_args, cache_dir, args.probe_timeout)
        progress(f"{preset}: warm first call {warm['first_call_s']:.1f} s "
                 f"(fxgraph_cache_hit {warm['fxgraph_cache_hit']})")
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return {"cold": cold, "warm": warm, "warm_cache_hit": warm.get("fxgraph_cache_hit", 0) >= 1,
            "batch": probe_args["batch"]}


# ------------------------------------------------------------------------------------------------------ latency

def latency_section(models, batch: int, args, kernels: dict | None) -> dict:
    from . import step as S
    from .timing import Variant, measure

    dev = models.device
    inputs = S.make_inputs(models, batch, args.context)
    eager = S.make_drafter(models, batch, args.max_length, compile=False)
    S.prefill(models, eager, inputs)
    variants = {"eager": S.step_fn(eager, inputs)}
    first_call, errors = {}, {}

    def attempt(name, fn):
        """One variant failing (a compile or capture error on some machine) must not lose the others."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            progress(f"{models.preset} b{batch}: {name} FAILED: {type(e).__name__}: {e}")
            errors[name] = f"{type(e).__name__}: {e}"[:1000]
            return None

    if "compiled" not in args.skip:
        plan = [("compiled", True, False)]
        if "stock" not in args.skip:
            plan.insert(0, ("compiled_nopasses", False, False))
        if dev.type == "cuda":
            plan.append(("cudagraph", True, True))
        for name, passes, graphs in plan:
            progress(f"{models.preset} b{batch}: compiling {name} (in process, FX graph cache off so passes run)")
            cv = attempt(name, lambda passes=passes, graphs=graphs: S.build_compiled(
                models, inputs, args.max_length, passes=passes, cuda_graphs=graphs))
            if cv is None:
                continue
            variants[name] = S.step_fn(cv.drafter, inputs)
            first_call[name] = cv.first_call_s
            if name == "compiled" and dev.type == "cpu":
                raw = S.graph_call_fn(cv.drafter, inputs)
                if raw is not None:
                    variants["compiled_call"] = raw
            if kernels is not None and not graphs:
                side = "passes" if passes else "no_passes"
                kernels[side] = cv.kernels
                kernels[f"matches_{side}"] = cv.matches
    if models.hf_mtp is not None and "peer" not in args.skip:
        hf = attempt("hf_eager", lambda: S.HFStep(models, inputs))
        if hf is not None:
            variants["hf_eager"] = Variant(hf, hf.rollback)
    gemms = None
    if "floor" not in args.skip:
        built = attempt("gemm_floor", lambda: S.gemm_floor(models, eager, inputs))
        if built is not None:
            variants["gemm_floor"], gemms = built
    progress(f"{models.preset} b{batch}: timing {', '.join(variants)}")
    stats = measure(variants, device=dev, warmup=args.warmup, rounds=args.rounds, per_round=args.per_round,
                    budget_s=args.time_budget)
    med = {k: s.median_ms for k, s in stats.items()}
    ratios = {"speedup_vs_peer": {}, "speedup_vs_eager": {}, "x_floor": {}}
    for name, m in med.items():
        if "hf_eager" in med and name != "gemm_floor":
            ratios["speedup_vs_peer"][name] = med["hf_eager"] / m
        if name != "gemm_floor":
            ratios["speedup_vs_eager"][name] = med["eager"] / m
        if "gemm_floor" in med and name != "gemm_floor":
            ratios["x_floor"][name] = m / med["gemm_floor"]
    sbytes = S.step_bytes(models, batch, args.context)
    bandwidth = None
    if dev.type == "cuda":
        bw = args._copy_bw or S.copy_bandwidth(dev)
        args._copy_bw = bw
        floor_ms = sbytes["total"] / bw * 1e3
        bandwidth = {"copy_gbps": bw / 1e9, "step_bytes": sbytes["total"], "hbm_floor_ms": floor_ms,
                     "achieved_fraction": {k: floor_ms / m for k, m in med.items() if k != "gemm_floor"},
                     "x_hbm_floor": {k: m / floor_ms for k, m in med.items() if k != "gemm_floor"}}
    return {"batch": batch, "context": args.context, "max_length": args.max_length,
            "variants": {k: s.to_dict() for k, s in stats.items()}, "ratios": ratios, "gemms": gemms,
            "gemm_calls": sum(g["count"] for g in gemms) if gemms else None, "step_bytes": sbytes,
            "bandwidth": bandwidth, "first_call_s": first_call, "errors": errors}


def config_section(preset: str, args) -> dict:
    from .models import load_models, parse_dtype

    progress(f"{preset}: loading models ({args.weights or 'default'} weights, {args.device}, {args.dtype})")
    peer = "peer" not in args.skip
    models = load_models(preset, device=args.device, dtype=parse_dtype(args.dtype), weights=args.weights, peer=peer,
                         progress=progress)
    out = {"model": models.describe(), "compile": None, "kernels": None, "latency": {}}
    if "compile" not in args.skip:
        try:
            out["compile"] = compile_section(preset, models.checkpoint, args, args.device)
        except Exception as e:  # noqa: BLE001 - report and go on with the other sections
            progress(f"{preset}: compile section failed: {e}")
            out["compile"] = {"error": str(e)[:2000], "cold": None, "warm": None}
    kernels = {} if "kernels" not in args.skip and "compiled" not in args.skip else None
    for i, batch in enumerate(args.batch_sizes):
        out["latency"][str(batch)] = latency_section(models, batch, args, kernels if i == 0 else None)
    if kernels:
        kernels.setdefault("no_passes", None)
        kernels.setdefault("passes", None)
        kernels.setdefault("matches_no_passes", {})
        kernels.setdefault("matches_passes", {})
        kernels["batch"] = args.batch_sizes[0]
    out["kernels"] = kernels or None
    del models
    return out


# ------------------------------------------------------------------------------------------------------ e2e

def e2e_section(args) -> dict:
    from inkling_compiled.testing.synthetic import cached_checkpoint
    from inkling_compiled.training.distill import distill, load_metrics

    from .e2e import E2EConfig, run_e2e

    progress("e2e: tiny target checkpoint + self-distilled MTP (cached after the first run)")
    base = cached_checkpoint("tiny")
    distilled = distill(base, progress=True, **({"steps": args.distill_steps} if args.distill_steps else {}))
    cfg = E2EConfig(prompts=args.e2e_prompts, new_tokens=args.e2e_tokens, compiled="compiled" not in args.skip,
                    hf_mtp="peer" not in args.skip)
    return run_e2e(distilled, device=args.device, cfg=cfg, progress=progress,
                   distill_metrics=_slim(load_metrics(distilled)))


def _slim(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "loss_history"}


# ------------------------------------------------------------------------------------------------------ CLI

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny",
                   help="synthetic preset(s) for the step sections, comma-separated: tiny, small, full (default tiny)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes for the latency section (default 1)")
    p.add_argument("--context", type=int, default=64, help="rows prefilled before the timed step (default 64)")
    p.add_argument("--max-length", type=int, default=None, help="draft cache capacity (default context + 64)")
    p.add_argument("--weights", choices=("checkpoint", "random"), default=None,
                   help="checkpoint (shared by both libraries; default for tiny/small) or random on the device "
                        "(default for full)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads on CPU (default 1: steadier on a shared machine)")
    p.add_argument("--skip", default="", help=f"comma-separated sections to skip: {', '.join(SECTIONS)} "
                   "(stock = the compiled variant without our passes; compiled = every compiled variant)")
    for s in SECTIONS:
        p.add_argument(f"--no-{s}", action="append_const", dest="skip_flags", const=s, help=f"same as --skip {s}")
    p.add_argument("--quick", action="store_true", help="few iterations everywhere (smoke test, numbers are rough)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--per-round", type=int, default=None)
    p.add_argument("--time-budget", type=float, default=None, help="seconds of timing per batch size (default 20)")
    p.add_argument("--recompile-steps", type=int, default=None, help="steps at moving positions in the compile probe")
    p.add_argument("--probe-timeout", type=float, default=600.0)
    p.add_argument("--e2e-prompts", type=int, default=None)
    p.add_argument("--e2e-tokens", type=int, default=None)
    p.add_argument("--distill-steps", type=int, default=None, help="self-distillation Adam steps (default: distill's)")
    p.add_argument("--json", dest="json_path", default=None, help="write the full result as JSON here")
    p.add_argument("--results-md", default=str(RESULTS_MD), help="append an entry here ('' to skip)")
    args = p.parse_args(argv)

    args.configs = [c.strip() for c in args.config.split(",") if c.strip()]
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()} | set(args.skip_flags or [])
    unknown = args.skip - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s) to skip: {sorted(unknown)}; choose from {SECTIONS}")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.max_length = args.max_length or args.context + 64
    if args.max_length <= args.context + 1:
        p.error("--max-length must exceed --context + 1")
    quick = args.quick
    defaults = dict(warmup=(2, 10), rounds=(2, 20), per_round=(3, 20), time_budget=(5.0, 20.0),
                    recompile_steps=(3, 20), e2e_prompts=(1, 4), e2e_tokens=(16, 64))
    for k, (q, full) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, q if quick else full)
    args.threads = args.threads or (1 if args.device == "cpu" else torch.get_num_threads())
    args._copy_bw = None
    return args


def run(argv=None) -> dict:
    """Parse ``argv``, run every section not skipped, print / write / append the results; returns the result dict."""
    args = parse_args(argv)
    threads_before = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads_before)


def _run(args, argv) -> dict:
    start = time.perf_counter()
    given = sys.argv[1:] if argv is None else list(argv)
    command = "python -m bench.run" + (" " + shlex.join(given) if given else "")
    result = {
        "schema": SCHEMA_ID, "command": command,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "wall_s": None, "machine": machine_info(args.threads),
        "settings": {"configs": args.configs, "device": args.device, "dtype": args.dtype,
                     "batch_sizes": args.batch_sizes, "context": args.context, "max_length": args.max_length,
                     "threads": args.threads, "quick": args.quick, "skip": sorted(args.skip)},
        "configs": {}, "e2e": None, "goals": [],
    }

    def finish(partial: bool) -> None:
        result["wall_s"] = time.perf_counter() - start
        result["goals"] = report.evaluate_goals(result)
        result["partial"] = partial
        if args.json_path:  # also after every section, so a run cut short by a time limit keeps what it measured
            Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")

    for preset in args.configs:
        try:
            result["configs"][preset] = config_section(preset, args)
        except Exception as e:  # noqa: BLE001 - keep the other configs' results
            progress(f"{preset}: FAILED: {type(e).__name__}: {e}")
            result["configs"][preset] = {"model": {"preset": preset}, "compile": None, "kernels": None,
                                         "latency": {}, "error": f"{type(e).__name__}: {e}"[:2000]}
        finish(partial=True)
    if "e2e" not in args.skip:
        try:
            result["e2e"] = e2e_section(args)
        except Exception as e:  # noqa: BLE001
            progress(f"e2e: FAILED: {type(e).__name__}: {e}")
            result["e2e"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    finish(partial=False)
    table = report.format_table(result)
    print(table, flush=True)
    if args.json_path:
        progress(f"wrote {args.json_path}")
    if args.results_md:
        report.append_results(Path(args.results_md), result, table)
        progress(f"appended an entry to {args.results_md}")
    return result


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
