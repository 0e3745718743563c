"""The ``packaged`` section: the drafter packaged ahead of time by AOTInductor, its build, a fresh process to its first
draft, and with ``--full`` its per-call latency beside the compiled drafter, transformers' step and the GEMM floor."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inkling_compiled.runtime import Drafter
from inkling_compiled.testing.kernel_stats import aoti_package_stats
from inkling_compiled.testing.synthetic import default_cache_root

from . import step as S
from .harness import ONE_TIME, Context, error_text, progress, ratios, run_probe, table, time_variants
from .models import Models
from .probes import first_draft_text

K = 1  # the packaged drafter drafts one token per round: the draft step the latency section times
RATIOS = {"packaged_vs_compiled_draft": ("compiled", "packaged"),
          "packaged_vs_compiled_call": ("compiled_call", "packaged_call"),
          "packaged_vs_compiled_graph": ("cudagraph", "packaged_cudagraph"),
          "packaged_vs_transformers": ("hf_eager", "packaged"), "compiled_vs_transformers": ("hf_eager", "compiled"),
          "packaged_call_x_floor": ("packaged_call", "gemm_floor"), "packaged_x_floor": ("packaged", "gemm_floor"),
          "compiled_call_x_floor": ("compiled_call", "gemm_floor")}


@dataclass
class Packaged:
    preset: str
    k: int
    batch: int
    context: int
    device: str
    dtype: str
    threads: int
    torch: str = torch.__version__
    package: dict | None = None  # build seconds, bytes, per step its compile time, matches and kernels
    startup: dict[str, dict] = field(default_factory=dict)  # "package": bench.probes.first_draft
    latency: dict | None = None
    ratios: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def build_package(models: Models, batch: int, max_length: int, directory: Path, reuse: bool) -> dict:
    """The package's build record; ``reuse``: the kept one while this torch, these passes and this model still accept
    the package (``Drafter.load_compiled`` checks them)."""
    if reuse:
        with contextlib.suppress(Exception):  # missing, stale or damaged: built again
            Drafter.load_compiled(directory, models.mtp)
            return {**json.loads((directory / "bench.json").read_text()), "cached": str(directory)}
    shutil.rmtree(directory, ignore_errors=True)
    start = time.perf_counter()
    S.make_drafter(models, batch, max_length, compile=True).save_compiled(directory, batch_sizes=(batch,), rows=(K,))
    save_s = time.perf_counter() - start
    if reuse:  # kept for later runs (else a figure of this one's)
        ONE_TIME.add("the K = 1 package", save_s)
    manifest = json.loads((directory / "manifest.json").read_text())
    steps = {name: {"seconds": step["seconds"], "matches": step["matches"],
                    "kernels": aoti_package_stats(directory / step["file"]).to_dict()}
             for name, step in manifest["steps"].items()}
    record = {"save_s": save_s, "bytes": sum(f.stat().st_size for f in directory.iterdir()), "steps": steps}
    (directory / "bench.json").write_text(json.dumps(record))
    return record


def latency(models: Models, batch: int, context: int, max_length: int, package: Path, budget_s: float) -> dict:
    """Every variant timed together; whether the packaged drafts equal the compiled ones."""
    inputs = S.make_inputs(models, batch, context)
    drafters = {"eager": S.make_drafter(models, batch, max_length, compile=False),
                "compiled": S.make_drafter(models, batch, max_length, compile=True),
                "packaged": Drafter.load_compiled(package, models.mtp, cuda_graphs=False)}
    if models.device.type == "cuda":
        drafters["cudagraph"] = S.make_drafter(models, batch, max_length, compile=True, cuda_graphs=True)
        drafters["packaged_cudagraph"] = Drafter.load_compiled(package, models.mtp, cuda_graphs=True)
    variants, drafts = {}, {}
    for name, drafter in drafters.items():
        variants[name] = S.prefill(models, drafter, inputs)
        drafts[name] = drafter.draft(*inputs.new).drafts  # compiles, captures
    if models.device.type == "cpu":
        for name in ("compiled", "packaged"):
            variants[f"{name}_call"] = drafters[name].static_step(*inputs.new[1].shape)
    if models.hf_mtp is not None:
        variants["hf_eager"] = S.HFStep(models, inputs)
    variants["gemm_floor"] = S.gemm_floor(models, inputs, max_length)
    progress(f"packaged: timing {', '.join(variants)}")
    stats = time_variants(variants, device=models.device, budget_s=budget_s)
    return {"batch": batch, "context": context, "k": K, "variants": stats,
            "same_drafts": {name: bool(torch.equal(d, drafts["compiled"])) for name, d in drafts.items()}}


def measure(ctx: Context) -> Packaged:
    s, models = ctx.settings, ctx.models()
    if models.checkpoint is None:
        raise ValueError(f"the packaged section starts fresh processes from a checkpoint; {ctx.preset} has random "
                         "weights here (--weights checkpoint)")
    batch = s.batch_sizes[0]
    record = Packaged(ctx.preset, K, batch, s.context, s.device, s.dtype, s.threads)
    with tempfile.TemporaryDirectory(prefix="inkling-bench-packaged-") as work:
        package = Path(work) / "p" if s.full else (  # --full builds it afresh
            default_cache_root().parent / "bench-packages" / f"{models.checkpoint.name}-k{K}-b{batch}-l{s.max_length}")
        base = {"checkpoint": str(models.checkpoint), "device": s.device, "dtype": s.dtype, "batch": batch, "k": K,
                "context": s.context, "max_length": s.max_length, "threads": s.threads, "package": str(package)}
        parts = {"package": lambda: build_package(models, batch, s.max_length, package, reuse=not s.full),
                 "startup": lambda: {"package": run_probe("probes.first_draft", base, cache_dir=f"{work}/inductor",
                                                          timeout=s.probe_timeout)}}
        if s.runs("packaged_latency"):
            parts["latency"] = lambda: latency(models, batch, s.context, s.max_length, package, s.time_budget)
        for part, run in parts.items():
            progress(f"packaged: {ctx.preset} b{batch}: {part}")
            try:
                setattr(record, part, run())
            except Exception as e:  # noqa: BLE001 - report it, keep what the other parts measured
                progress(f"packaged: {part} FAILED: {type(e).__name__}: {e}")
                record.errors[part] = error_text(e)
                if part == "package":
                    break
    medians = {n: v.median_ms for n, v in (record.latency or {}).get("variants", {}).items()}
    record.ratios = {**ratios(medians, RATIOS),
                     **{f"startup_{how}_s": row["to_first_draft_s"] for how, row in record.startup.items()}}
    return record


def lines(out: dict) -> list[str]:
    found = [f"packaged drafter: {out['preset']} K={out['k']} batch {out['batch']} context {out['context']} "
             f"{out['device']} {out['dtype']} {out['threads']} thread(s), torch {out['torch']}"]
    if out["package"]:
        steps = ", ".join(f"{n} {v['seconds']:.1f} s" for n, v in out["package"]["steps"].items())
        found.append(f"package: {out['package']['save_s']:.1f} s to build ({steps}), {out['package']['bytes']} bytes"
                     + (f"; reused from {out['package']['cached']} (--full builds it afresh)"
                        if "cached" in out["package"] else ""))
    found += [f"start-up {how}: first draft {first_draft_text(r)}" for how, r in out["startup"].items()]
    if out["latency"]:
        rows = [["latency (ms)", "median", "p10-p90"]]
        rows += [[f"  {name}", f"{v['median_ms']:.4f}", f"{v['p10_ms']:.4f}-{v['p90_ms']:.4f}"]
                 for name, v in out["latency"]["variants"].items()]
        found += table(rows) + [f"  same drafts as compiled: {out['latency']['same_drafts']}"]
    found += table([[name, f"{value:.2f}"] for name, value in out["ratios"].items()]) if out["ratios"] else []
    return found + [f"{part} FAILED: {error}" for part, error in out["errors"].items()]
