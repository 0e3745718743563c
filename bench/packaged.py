"""The packaged (AOTInductor) drafter beside the compiled one (issue 15): start-up to the first draft in a fresh
process, and per-call latency, in one run.

:func:`run_packaged` packages the greedy round of one bucket (``batch`` sequences, one new row, K depths: the K-row
window; ``Drafter.save_compiled``), then measures

* ``startup``: three fresh processes, each timed from its spawn to the first draft returned (Python's start, imports,
  loading the MTP, building the drafter, an eager depth-0 prefill, the first draft): ``package``
  (``Drafter.load_compiled``), ``cold`` (``torch.compile``, a fresh Inductor cache dir) and ``warm`` (the same dir
  again: FX graph cache hit). A probe is ``python -m bench.packaged PROBE_JSON`` and imports only what a serving
  process needs; it reports its own phases (``import_s`` and the rest).
* ``latency``, every variant timed together in one interleaved run at a fixed context: our eager drafter, the
  compiled and the packaged drafter's ``draft``, their rounds alone on the static buffers (``*_call``, CPU),
  transformers' ``MtpModel`` step (K = 1: one depth, as ours) and the GEMM floor (the eager round's GEMMs alone).

Returned as a dict (``package``, ``startup``, ``latency``, ``ratios``, ``errors``: a part that fails is reported and the
others still run). ``python -m bench.packaged [--config tiny] [--k 1] [--json out.json]`` prints a table and the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFIX = "PACKAGED_PROBE: "
REPO_DIR = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ one fresh process

def probe(args: dict) -> dict:
    """Start-up of this fresh process to its first draft (``args["mode"]``: package, cold or warm)."""
    t_start = time.perf_counter()
    import torch
    from torch._dynamo.utils import counters

    from inkling_compiled import InklingMTP
    from inkling_compiled.runtime import Drafter

    t_import = time.perf_counter()
    torch.set_num_threads(int(args["threads"]))
    mtp = InklingMTP.from_pretrained(args["checkpoint"], dtype=getattr(torch, args["dtype"]),
                                     device=args["device"])
    t_model = time.perf_counter()
    batch, context, k = int(args["batch"]), int(args["context"]), int(args["k"])
    if args["mode"] == "package":
        drafter = Drafter.load_compiled(args["package"], mtp)
    else:
        drafter = Drafter(mtp, batch, int(args["max_length"]), num_speculative_tokens=k, graph_rows=(k,))
    t_ready = time.perf_counter()
    ids, positions, hidden = _rows(mtp, batch, context + 1)
    with torch.no_grad():
        mtp(ids[:, :-1], positions[:, :-1], hidden[:, :-1], cache=drafter.cache, depth=0)
    t_prefill = time.perf_counter()
    counters.clear()
    drafter.draft(ids[:, -1:], positions[:, -1:], hidden[:, -1:]).drafts.cpu()
    t_first = time.perf_counter()
    return {"mode": args["mode"], "import_s": t_import - t_start, "model_s": t_model - t_import,
            "ready_s": t_ready - t_model, "prefill_s": t_prefill - t_ready, "first_draft_s": t_first - t_prefill,
            "to_first_draft_s": time.time() - float(args["spawned_at"]),
            "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
            "fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
            "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
            "packaged_buckets": len(drafter.packaged_buckets)}


def _rows(mtp, batch: int, length: int, seed: int = 0):
    """Random committed rows 0..length-1 (real ids, unit-scale hiddens): the cost does not depend on their values."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, mtp.config.logits_vocab_size, (batch, length), generator=gen)
    hidden = torch.randn(batch, length, mtp.config.hidden_size, generator=gen)
    positions = torch.arange(length)[None].expand(batch, -1).contiguous()
    return ids.to(mtp.device), positions.to(mtp.device), hidden.to(device=mtp.device, dtype=mtp.dtype)


def spawn_probe(args: dict, inductor_cache: str, timeout: float) -> dict:
    """``probe(args)`` in a fresh interpreter with its own Inductor (and Triton) cache dir; ``process_s`` added."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_cache,
           "TRITON_CACHE_DIR": os.path.join(inductor_cache, "triton"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_DIR), os.environ.get("PYTHONPATH")) if p)}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "bench.packaged", json.dumps({**args, "spawned_at": time.time()})],
                          cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=timeout)
    found = [line for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
        raise RuntimeError(f"bench.packaged probe ({args['mode']}) failed (exit {done.returncode}): "
                           + " | ".join(tail))
    return {**json.loads(found[-1][len(PREFIX):]), "process_s": time.perf_counter() - t0}


def startup(base: dict, timeout: float, progress) -> dict[str, dict]:
    """By mode: package load, cold compile, warm compile (FX graph cache hit), each a fresh process."""
    rows = {}
    package_cache, compile_cache = (tempfile.mkdtemp(prefix="inkling-bench-inductor-") for _ in range(2))
    try:
        for mode, cache_dir in (("package", package_cache), ("cold", compile_cache), ("warm", compile_cache)):
            progress(f"start-up to the first draft, {mode} (fresh process)")
            rows[mode] = spawn_probe({**base, "mode": mode}, cache_dir, timeout)
            progress(f"  {mode}: first draft {rows[mode]['to_first_draft_s']:.2f} s after the spawn "
                     f"(imports {rows[mode]['import_s']:.2f} s)")
    finally:
        shutil.rmtree(package_cache, ignore_errors=True)
        shutil.rmtree(compile_cache, ignore_errors=True)
    return rows


# ------------------------------------------------------------------------------------------------ in this process

def make_drafter(models, k: int, batch: int, max_length: int, *, compile: bool):
    """The benchmark's drafter: K depths, the K-row window of one new row as its only graph bucket."""
    from inkling_compiled.runtime import Drafter

    from .step import compile_options

    return Drafter(models.mtp, batch, max_length, num_speculative_tokens=k, graph_rows=(k,), compile=compile,
                   compile_options=compile_options(passes=True, fresh=False) if compile else None)


def build_package(models, k: int, batch: int, max_length: int, directory: Path) -> dict:
    """Package the bucket's greedy round; seconds, bytes, and per step its compile time, matches and kernels."""
    from inkling_compiled.testing.kernel_stats import aoti_package_stats

    t0 = time.perf_counter()
    make_drafter(models, k, batch, max_length, compile=True).save_compiled(directory, batch_sizes=(batch,), rows=(k,))
    save_s = time.perf_counter() - t0
    manifest = json.loads((directory / "manifest.json").read_text())
    steps = {name: {"seconds": step["seconds"], "matches": step["matches"],
                    "kernels": aoti_package_stats(directory / step["file"]).to_dict()}
             for name, step in manifest["steps"].items()}
    return {"save_s": save_s, "bytes": sum(f.stat().st_size for f in directory.iterdir()), "steps": steps}


def latency(models, k: int, batch: int, s: argparse.Namespace, package: Path, progress) -> dict:
    """Every variant timed together; whether the packaged drafts equal the compiled ones."""
    import torch

    from inkling_compiled.runtime import Drafter

    from . import step as S
    from .timing import Variant, measure

    inputs = S.make_inputs(models, batch, s.context)
    drafters = {"eager": make_drafter(models, k, batch, s.max_length, compile=False),
                "compiled": make_drafter(models, k, batch, s.max_length, compile=True),
                "packaged": Drafter.load_compiled(package, models.mtp, cuda_graphs=False)}
    on_cuda = models.device.type == "cuda"
    if on_cuda:
        drafters["cudagraph"] = Drafter(models.mtp, batch, s.max_length, num_speculative_tokens=k, graph_rows=(k,),
                                        cuda_graphs=True)
        drafters["packaged_cudagraph"] = Drafter.load_compiled(package, models.mtp, cuda_graphs=True)
    variants, drafts = {}, {}
    for name, drafter in drafters.items():
        S.prefill(models, drafter, inputs)
        variants[name] = S.step_fn(drafter, inputs)
        drafts[name] = drafter.draft(inputs.ids, inputs.positions, inputs.hidden).drafts  # compiles, captures
    if not on_cuda:
        for name in ("compiled", "packaged"):
            variants[f"{name}_call"] = drafters[name].static_step(*inputs.positions.shape)
    if k == 1 and models.hf_mtp is not None:
        hf = S.HFStep(models, inputs)
        variants["hf_eager"] = Variant(hf, hf.rollback)
    variants["gemm_floor"], _ = S.gemm_floor(models, drafters["eager"], inputs)
    progress(f"timing {', '.join(variants)}")
    stats = measure(variants, device=models.device, warmup=s.warmup, rounds=s.rounds, per_round=s.per_round,
                    budget_s=s.time_budget)
    return {"batch": batch, "context": s.context, "k": k, "variants": {n: v.to_dict() for n, v in stats.items()},
            "same_drafts": {name: bool(torch.equal(drafts[name], drafts["compiled"])) for name in drafts}}


def ratios(out: dict) -> dict:
    """The figures the issue's goals name, from a result: medians over medians."""
    med = {n: v["median_ms"] for n, v in ((out.get("latency") or {}).get("variants") or {}).items()}
    pairs = {"packaged_vs_compiled_draft": ("compiled", "packaged"),
             "packaged_vs_compiled_call": ("compiled_call", "packaged_call"),
             "packaged_vs_compiled_graph": ("cudagraph", "packaged_cudagraph"),
             "packaged_vs_transformers": ("hf_eager", "packaged"), "compiled_vs_transformers": ("hf_eager", "compiled"),
             "packaged_call_x_floor": ("packaged_call", "gemm_floor"), "packaged_x_floor": ("packaged", "gemm_floor"),
             "compiled_call_x_floor": ("compiled_call", "gemm_floor")}
    found = {name: med[a] / med[b] for name, (a, b) in pairs.items() if a in med and b in med}
    found.update({f"startup_{mode}_s": row["to_first_draft_s"] for mode, row in (out.get("startup") or {}).items()})
    return found


# ------------------------------------------------------------------------------------------------ the section

def run_packaged(preset: str = "tiny", *, k: int = 1, batch: int = 1, context: int = 64, max_length: int = 1024,
                 device: str = "cpu", dtype: str = "float32", threads: int = 1, warmup: int = 20, rounds: int = 20,
                 per_round: int = 20, time_budget: float = 20.0, probe_timeout: float = 600.0,
                 progress=lambda message: None) -> dict:
    """Package, start-up and latency of the packaged drafter for ``preset`` (see the module doc)."""
    import torch

    from .models import load_models, parse_dtype

    if device == "cpu":
        torch.set_num_threads(threads)
    s = argparse.Namespace(context=context, max_length=max_length, warmup=warmup, rounds=rounds, per_round=per_round,
                           time_budget=time_budget)
    models = load_models(preset, device=device, dtype=parse_dtype(dtype), weights="checkpoint", progress=progress)
    out = {"preset": preset, "k": k, "batch": batch, "context": context, "threads": threads, "device": device,
           "dtype": dtype, "torch": torch.__version__, "package": None, "startup": {}, "latency": None, "errors": {}}
    work = Path(tempfile.mkdtemp(prefix="inkling-bench-packaged-"))
    package = work / "package"
    base = {"checkpoint": str(models.checkpoint), "device": device, "dtype": dtype, "batch": batch, "k": k,
            "context": context, "max_length": max_length, "threads": threads, "package": str(package)}
    parts = (("package", lambda: build_package(models, k, batch, max_length, package)),
             ("startup", lambda: startup(base, probe_timeout, progress)),
             ("latency", lambda: latency(models, k, batch, s, package, progress)))
    try:
        for part, run in parts:
            if part != "package" and out["package"] is None:
                break
            progress(f"{preset} K={k} b{batch}: {part}")
            try:
                out[part] = run()
            except Exception as e:  # noqa: BLE001 - report it, keep what the other parts measured
                progress(f"{part} FAILED: {type(e).__name__}: {e}")
                out["errors"][part] = f"{type(e).__name__}: {e}"[:2000]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["ratios"] = ratios(out)
    return out


def format_table(out: dict) -> str:
    lines = [f"packaged drafter: {out['preset']} K={out['k']} batch {out['batch']} context {out['context']} "
             f"{out['device']} {out['dtype']} {out['threads']} thread(s), torch {out['torch']}"]
    if out["package"]:
        steps = ", ".join(f"{n} {v['seconds']:.1f} s" for n, v in out["package"]["steps"].items())
        lines.append(f"package: {out['package']['save_s']:.1f} s to build ({steps}), {out['package']['bytes']} bytes")
    for mode, row in out["startup"].items():
        lines.append(f"start-up {mode:8s} first draft {row['to_first_draft_s']:6.2f} s after the spawn: imports "
                     f"{row['import_s']:.2f}, model {row['model_s']:.2f}, drafter {row['ready_s']:.2f}, first draft "
                     f"{row['first_draft_s']:.2f} (FX cache hit/miss {row['fxgraph_cache_hit']}/"
                     f"{row['fxgraph_cache_miss']}, Dynamo graphs {row['dynamo_graphs']})")
    if out["latency"]:
        lines.append("latency (ms)                 median   p10-p90")
        for name, v in out["latency"]["variants"].items():
            lines.append(f"  {name:24s} {v['median_ms']:8.4f}  {v['p10_ms']:.4f}-{v['p90_ms']:.4f}")
        lines.append(f"  same drafts as compiled: {out['latency']['same_drafts']}")
    lines += [f"{name:32s} {value:8.2f}" for name, value in out["ratios"].items()]
    lines += [f"{part} FAILED: {error}" for part, error in out["errors"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("{"):  # one probe process
        print(PREFIX + json.dumps(probe(json.loads(argv[0]))), flush=True)
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.packaged", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny", help="synthetic preset (tiny, tiny8, small, full)")
    p.add_argument("--k", type=int, default=1, help="draft depths per round (num_speculative_tokens)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--time-budget", type=float, default=20.0, help="seconds of timing (at least two rounds)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    a = p.parse_args(argv)
    out = run_packaged(a.config, k=a.k, batch=a.batch, context=a.context, device=a.device, dtype=a.dtype,
                       threads=a.threads, time_budget=a.time_budget,
                       progress=lambda message: print(f"[bench.packaged] {message}", file=sys.stderr, flush=True))
    print(format_table(out))
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
