"""``python -m bench.run``: what an inference engineer wants to know before adopting inkling_compiled.

One run measures, side by side, on a seeded synthetic checkpoint generated locally (default: ``tiny``, CPU, fp32,
batch 1, context 64):

* compile: cold (fresh Inductor cache dir) and warm (same dir again) compile of the one-token draft step, each in
  its own subprocess, with the Dynamo / backend split, the FX graph cache counters, recompiles over N steps and, on
  CUDA, the CUDA-graph capture time;
* latency of the one-token draft step after an eager prefill of ``--context`` rows: our eager model, compiled
  without / with our passes, with CUDA graphs (CUDA; built and timed last, so a capture failure loses nothing
  else), transformers' eager ``MtpModel`` step on the same weights, and the step's GEMMs alone (the floor); on CUDA
  also the bytes the step must read against measured copy bandwidth;
* kernels: the generated code of those in-process compiles, stock Inductor vs with passes (definitions, launches,
  loop nests, extern calls, our passes' match counts);
* packaged: the drafter's round packaged ahead of time with AOTInductor (``bench.packaged``, K = 1, the first batch
  size): build time, start-up to the first draft in a fresh process (package / cold compile / warm FX-cache hit) and
  per-call latency of the packaged round beside the compiled one, transformers' ``MtpModel`` and the GEMM floor;
* quant (not on tiny unless ``--with quant``): the compiled step in fp32, bf16 and int8 weight-only (depths, depths
  + head; torchao's int8, and on CUDA its float8, depths + our head; ``bench.quant``) against the fp32 step's GEMM
  floor, at the first batch size;
* end to end on the text target (a tiny Inkling trained on Python standard-library source, its 8 MTP depths
  self-distilled; ``inkling_compiled.training.text_target``, built once and cached) with held-out source lines as
  prompts: tokens/s and acceptance of our speculative generation (K = 1) vs the target alone vs transformers'
  ``generate(use_mtp=True)``; ``--e2e-target synthetic`` runs it on the self-distilled random ``tiny8`` target;
* depths (the K sweep, ``bench.ksweep``) on the same target and prompts: for K = 1, 2, 4, 8 tokens/s, speed-up vs
  the target alone and vs ``generate(use_mtp=True)``, mean accepted length and acceptance per position, batch 1
  and a left-padded batch of 4 (per-row acceptance; an eager drafter unless ``--full-sweep``), draft-round latency
  (batch 1; and 4 with ``--full-sweep``) and, each K in a fresh subprocess (the smallest and largest K; every K
  with ``--full-sweep``), the cold compile of its drafter (CPU
  seconds, ratio to K = 1, recompiles over 64 rounds).

It prints a table (progress on stderr) and writes the JSON (``bench.records.Result``) to ``--json``, by default a
new file under the git-ignored ``bench/out/``, after every section (``partial: true`` until the end), so a run cut
short keeps what it measured; at the end it draws the report image beside the JSON (:mod:`bench.plots`, with
matplotlib; without it, it says how to get it) and prints its path last. ``python -m bench.report RESULT.json``
draws it again from any saved JSON. ``--record`` appends an entry to ``bench/RESULTS.md`` (or the file it names).
Goals are printed with the measured value and met / not met; they are targets, not asserts (the exit code is 0
either way).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import plots, report
from .records import SCHEMA_ID

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
RESULTS_MD = BENCH_DIR / "RESULTS.md"
OUT_DIR = BENCH_DIR / "out"  # git-ignored
SECTIONS = {
    "compile": "cold / warm compile in subprocesses",
    "latency": "the timed step variants (and with them the kernels)",
    "kernels": "generated-code counts of the in-process compiles",
    "stock": "the compiled variant without our passes",
    "compiled": "every compiled variant",
    "cudagraph": "the CUDA-graph variant (CUDA only)",
    "peer": "transformers' MtpModel (step and e2e)",
    "floor": "the GEMM-only floor",
    "quant": "fp32 / bf16 / int8 weight-only draft step against the fp32 GEMM floor (by default not on tiny)",
    "e2e": "end-to-end speculative generation, K = 1",
    "depths": "the K sweep: end to end per K (batch 1 and 4) and draft-round latency",
    "kcompile": "the K sweep's cold compile per K (a subprocess each)",
    "perrow": "per-row acceptance vs lockstep: tokens per target forward and tokens/s at batch 1, 4, 8 (K = 1, 4)",
    "packaged": "the drafter packaged with AOTInductor: start-up in fresh processes, per-call latency (K = 1)",
}
# Sections a preset runs only when asked with --with: on tiny the quant section's compiles (one per scheme) would
# multiply the default run's time, for a step too small to be memory-bound
OPT_IN = {"quant": frozenset({"tiny"})}
CPU_ONLY = {"depths": "ksweep", "perrow": "perrow"}  # section -> its module

_T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[bench {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Settings:
    """Everything a run does, resolved once from the command line (defaults filled in, values checked)."""

    configs: tuple[str, ...]
    device: str
    dtype: str
    batch_sizes: tuple[int, ...]
    context: int
    max_length: int
    weights: str | None
    threads: int
    skip: frozenset[str]
    with_: frozenset[str]
    quick: bool
    warmup: int
    rounds: int
    per_round: int
    time_budget: float
    recompile_steps: int
    probe_timeout: float
    e2e_prompts: int
    e2e_tokens: int
    e2e_target: str
    ks: tuple[int, ...]
    k_rounds: int
    full_sweep: bool
    distill_steps: int | None
    e2e_checkpoint: Path | None
    json_path: Path
    record: Path | None

    def runs(self, section: str, preset: str | None = None) -> bool:
        """Whether ``section`` runs (for ``preset``: the opt-in ones only where asked)."""
        if section in self.skip:
            return False
        return section in self.with_ or preset not in OPT_IN.get(section, ())

    def summary(self) -> dict:
        """``records.Settings``"""
        return {"configs": list(self.configs), "device": self.device, "dtype": self.dtype,
                "batch_sizes": list(self.batch_sizes), "context": self.context, "max_length": self.max_length,
                "threads": self.threads, "quick": self.quick, "skip": sorted(self.skip), "opt_in": sorted(self.with_),
                "e2e_target": str(self.e2e_checkpoint or self.e2e_target), "ks": list(self.ks),
                "full_sweep": self.full_sweep}


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


def compile_section(preset: str, checkpoint, s: Settings) -> dict:
    """``records.Compile``"""
    batch = min(s.batch_sizes)
    probe_args = {"preset": preset, "checkpoint": str(checkpoint) if checkpoint else None, "weights": s.weights,
                  "device": s.device, "dtype": s.dtype, "batch": batch, "context": s.context,
                  "max_length": s.max_length, "threads": s.threads, "steps": s.recompile_steps, "passes": True}
    out = {"batch": batch, "cold": None, "warm": None, "warm_cache_hit": None, "error": None}
    cache_dir = tempfile.mkdtemp(prefix="inkling-bench-inductor-")
    try:
        progress(f"{preset}: cold compile in a subprocess (fresh TORCHINDUCTOR_CACHE_DIR {cache_dir})")
        out["cold"] = run_compile_probe(probe_args, cache_dir, s.probe_timeout)
        progress(f"{preset}: cold first call {out['cold']['first_call_s']:.1f} s; warm compile (same cache dir)")
        out["warm"] = run_compile_probe(probe_args, cache_dir, s.probe_timeout)
        out["warm_cache_hit"] = out["warm"]["fxgraph_cache_hit"] >= 1
        progress(f"{preset}: warm first call {out['warm']['first_call_s']:.1f} s "
                 f"(fxgraph_cache_hit {out['warm']['fxgraph_cache_hit']})")
    except Exception as e:  # noqa: BLE001 - report and go on with the other sections
        progress(f"{preset}: compile section failed: {e}")
        out["error"] = str(e)[:2000]
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------------------ latency

def latency_section(models, batch: int, s: Settings, copy_bw: float | None, kernels: dict | None,
                    publish) -> dict:
    """``records.Latency`` for one batch size. The variants without CUDA graphs are timed first and ``publish``ed;
    the CUDA-graph variant is built last and, when it builds, every variant is timed again together with it (the
    budget split between the two timings), so the figures of one entry always come from one interleaved run."""
    from . import step as S
    from .timing import Variant

    dev = models.device
    inputs = S.make_inputs(models, batch, s.context)
    eager = S.make_drafter(models, batch, s.max_length, compile=False)
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

    def build(name, passes, cuda_graphs):
        progress(f"{models.preset} b{batch}: compiling {name} (in process, FX graph cache off so passes run)")
        cv = attempt(name, lambda: S.build_compiled(models, inputs, s.max_length, passes=passes,
                                                    cuda_graphs=cuda_graphs))
        if cv is not None:
            variants[name] = S.step_fn(cv.drafter, inputs)
            first_call[name] = cv.first_call_s
            if kernels is not None and not cuda_graphs:
                side = "passes" if passes else "no_passes"
                kernels[side], kernels[f"matches_{side}"] = cv.kernels, cv.matches
        return cv

    if s.runs("compiled"):
        if s.runs("stock"):
            build("compiled_nopasses", False, False)
        cv = build("compiled", True, False)
        if cv is not None and dev.type == "cpu":
            variants["compiled_call"] = cv.drafter.static_step(*inputs.positions.shape)
    if models.hf_mtp is not None and s.runs("peer"):
        hf = attempt("hf_eager", lambda: S.HFStep(models, inputs))
        if hf is not None:
            variants["hf_eager"] = Variant(hf, hf.rollback)
    gemms = None
    if s.runs("floor"):
        built = attempt("gemm_floor", lambda: S.gemm_floor(models, eager, inputs))
        if built is not None:
            variants["gemm_floor"], gemms = built
    graphs_next = dev.type == "cuda" and s.runs("compiled") and s.runs("cudagraph")
    budget = s.time_budget / 2 if graphs_next else s.time_budget
    entry = _timed(models, batch, s, variants, budget, copy_bw)
    entry.update(gemms=gemms, gemm_calls=sum(g["count"] for g in gemms) if gemms else None,
                 first_call_s=first_call, errors=errors)
    if graphs_next:
        publish(entry)
        if build("cudagraph", True, True) is not None:
            entry.update(_timed(models, batch, s, variants, budget, copy_bw))
    return entry


def _timed(models, batch: int, s: Settings, variants: dict, budget: float, copy_bw: float | None) -> dict:
    """Time ``variants`` together; their stats and the ratios between them."""
    from . import step as S
    from .timing import measure

    progress(f"{models.preset} b{batch}: timing {', '.join(variants)}")
    stats = measure(variants, device=models.device, warmup=s.warmup, rounds=s.rounds, per_round=s.per_round,
                    budget_s=budget)
    med = {k: st.median_ms for k, st in stats.items()}
    ours = [k for k in med if k != "gemm_floor"]
    ratios = {"speedup_vs_peer": {k: med["hf_eager"] / med[k] for k in ours if "hf_eager" in med},
              "speedup_vs_eager": {k: med["eager"] / med[k] for k in ours},
              "x_floor": {k: med[k] / med["gemm_floor"] for k in ours if "gemm_floor" in med}}
    sbytes = S.step_bytes(models, batch, s.context)
    bandwidth = None
    if copy_bw is not None:
        floor_ms = sbytes["total"] / copy_bw * 1e3
        bandwidth = {"copy_gbps": copy_bw / 1e9, "step_bytes": sbytes["total"], "hbm_floor_ms": floor_ms,
                     "achieved_fraction": {k: floor_ms / med[k] for k in ours},
                     "x_hbm_floor": {k: med[k] / floor_ms for k in ours}}
    return {"batch": batch, "context": s.context, "max_length": s.max_length,
            "variants": {k: st.to_dict() for k, st in stats.items()}, "ratios": ratios, "step_bytes": sbytes,
            "bandwidth": bandwidth}


def config_section(preset: str, s: Settings, copy_bw: float | None, out: dict, save) -> None:
    """Fill ``out`` (``records.Config``) section by section, calling ``save(done)`` after each."""
    from .models import load_models, parse_dtype

    progress(f"{preset}: loading models ({s.weights or 'default'} weights, {s.device}, {s.dtype})")
    models = load_models(preset, device=s.device, dtype=parse_dtype(s.dtype), weights=s.weights,
                         peer=s.runs("peer"), progress=progress)
    out["model"] = models.describe()
    save(f"{preset}/models")
    if s.runs("compile"):
        out["compile"] = compile_section(preset, models.checkpoint, s)
        save(f"{preset}/compile")
    for i, batch in enumerate(s.batch_sizes if s.runs("latency") else ()):
        kernels = None
        if i == 0 and s.runs("kernels") and s.runs("compiled"):
            kernels = out["kernels"] = {"batch": batch, "no_passes": None, "passes": None, "matches_no_passes": {},
                                        "matches_passes": {}}

        def publish(entry, batch=batch):
            out["latency"][str(batch)] = entry
            save(f"{preset}/latency/{batch}/no-graphs")

        out["latency"][str(batch)] = latency_section(models, batch, s, copy_bw, kernels, publish)
        save(f"{preset}/latency/{batch}")
    if s.runs("quant", preset):
        try:
            out["quant"] = quant_section(preset, s)
        except Exception as e:  # noqa: BLE001 - keep the config's other sections
            progress(f"{preset} quant: FAILED: {type(e).__name__}: {e}")
            out["quant"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        save(f"{preset}/quant")
    if s.runs("packaged"):
        from .packaged import run_packaged

        out["packaged"] = run_packaged(preset, k=1, batch=s.batch_sizes[0], context=s.context,
                                       max_length=s.max_length, device=s.device, dtype=s.dtype, threads=s.threads,
                                       warmup=s.warmup, rounds=s.rounds, per_round=s.per_round,
                                       time_budget=s.time_budget, progress=progress)
        save(f"{preset}/packaged")


def quant_section(preset: str, s: Settings) -> dict:
    """``records.Quant``: every scheme of ``bench.quant.schemes`` (the device's) at the first batch size, in one
    timed run."""
    from .quant import quant_record, quant_rows, schemes

    batch, errors = s.batch_sizes[0], {}
    rows = quant_rows(preset, device=s.device, weights=s.weights, batch=batch, context=s.context,
                      max_length=s.max_length, variants=tuple(schemes(s.device).values()), warmup=s.warmup,
                      rounds=s.rounds, per_round=s.per_round, budget_s=s.time_budget, errors=errors,
                      progress=progress)
    return quant_record(rows, batch, errors, s.device)


# ------------------------------------------------------------------------------------------------------ e2e

TEXT_PROMPT_LEN = 32  # bytes of held-out source per prompt


@dataclass(frozen=True)
class E2ETarget:
    """The distilled checkpoint both end-to-end sections run on, with its prompts (None: random ids)."""

    checkpoint: Path
    label: str
    prompts: torch.Tensor | None
    metrics: dict | None  # distill.json without the loss history (and, for the text target, its build figures)


@functools.cache
def e2e_target(s: Settings) -> E2ETarget:
    """The text target (built on first use, ~3 minutes, then cached), a checkpoint given with --e2e-checkpoint (a
    text target's own gets held-out prompts too), or the self-distilled synthetic tiny8."""
    from inkling_compiled.training import text_target

    from .e2e import distilled_checkpoint

    count = max(s.e2e_prompts, 4)  # the K sweep's left-padded batch takes 4
    if s.e2e_checkpoint is not None:
        path = s.e2e_checkpoint
    elif s.e2e_target == "text":
        progress("e2e: the text target (trained on stdlib source, MTP self-distilled; ~3 min once, then cached)")
        path = text_target.build(text_target.RECIPE)
    else:
        path = distilled_checkpoint(s.distill_steps, progress, preset="tiny8")
    if text_target.is_built(path):
        metrics = text_target.load_metrics(path)
        built = {k: metrics[k] for k in ("heldout_bits_per_byte", "heldout_text_agreement", "train_seconds",
                                         "build_seconds", "parameters", "corpus")}
        label = (f"text target: stdlib source, {metrics['parameters'] / 1e3:.0f} k parameters, "
                 f"{metrics['heldout_bits_per_byte']:.2f} held-out bits/byte; held-out prompts")
        return E2ETarget(path, label, text_target.heldout_prompts(count, TEXT_PROMPT_LEN),
                         {**metrics["distill"], "text_target": built})
    try:
        from inkling_compiled.training.distill import load_metrics

        metrics = {k: v for k, v in load_metrics(path).items() if k != "loss_history"}
    except FileNotFoundError:  # a checkpoint that was not distilled here
        metrics = None
    return E2ETarget(path, f"distilled synthetic target {path.name}, random prompts", None, metrics)


def e2e_section(s: Settings) -> dict:
    """``records.E2E``"""
    from .e2e import E2EConfig, run_e2e

    target = e2e_target(s)
    cfg = E2EConfig(prompts=s.e2e_prompts, new_tokens=s.e2e_tokens, compiled=s.runs("compiled"),
                    hf_mtp=s.runs("peer"))
    return run_e2e(target.checkpoint, device=s.device, cfg=cfg, progress=progress, distill_metrics=target.metrics,
                   prompts=target.prompts, target_label=target.label)


def depths_section(s: Settings) -> dict:
    """``records.Depths``: the K sweep on the end-to-end target (CPU)."""
    from .ksweep import KSweepConfig, run_ksweep

    target = e2e_target(s)
    cfg = KSweepConfig(ks=s.ks, prompts=s.e2e_prompts, new_tokens=s.e2e_tokens, latency_rounds=s.k_rounds,
                       threads=s.threads, cold_compile=s.runs("kcompile"), hf_mtp=s.runs("peer"),
                       batch4_compiled=s.full_sweep, cold_compile_every_k=s.full_sweep)
    result = run_ksweep(target.checkpoint, cfg, prompts=target.prompts, progress=progress)
    result["target"] = target.label
    return result


def perrow_section(s: Settings) -> dict:
    """``records.PerRow``: per-row acceptance against lockstep on the end-to-end target (CPU; random prompts of its
    vocabulary, the same for both modes)."""
    from .perrow import PerRowConfig, run_perrow

    cfg = PerRowConfig(new_tokens=min(32, s.e2e_tokens), threads=s.threads, contexts=(64,))
    return run_perrow(e2e_target(s).checkpoint, cfg, progress=progress)


# ------------------------------------------------------------------------------------------------------ CLI

def _positive_ints(p: argparse.ArgumentParser, flag: str, value: str, what: str) -> tuple[int, ...]:
    """A comma-separated list of integers >= 1; the parser's error naming ``flag`` otherwise."""
    try:
        numbers = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        p.error(f"{flag} must be comma-separated integers, got {value!r}")
    if not numbers or min(numbers) < 1:
        p.error(f"{flag} must name {what}, got {value!r}")
    return numbers


def parse_args(argv=None) -> Settings:
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
    p.add_argument("--skip", default="", help="comma-separated sections to skip: "
                   + "; ".join(f"{name} ({what})" for name, what in SECTIONS.items()))
    p.add_argument("--with", dest="with_", default="", metavar="SECTIONS",
                   help="comma-separated sections to run where they are off by default: "
                   + "; ".join(f"{name} (off for {', '.join(sorted(presets))})" for name, presets in OPT_IN.items()))
    p.add_argument("--quick", action="store_true", help="few iterations everywhere (smoke test, numbers are rough)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--per-round", type=int, default=None)
    p.add_argument("--time-budget", type=float, default=None, help="seconds of timing per batch size (default 20)")
    p.add_argument("--recompile-steps", type=int, default=None, help="steps at moving positions in the compile probe")
    p.add_argument("--probe-timeout", type=float, default=600.0)
    p.add_argument("--e2e-prompts", type=int, default=None)
    p.add_argument("--e2e-tokens", type=int, default=None)
    p.add_argument("--e2e-target", choices=("text", "synthetic"), default="text",
                   help="end-to-end target (e2e and depths): the text target trained on stdlib source, held-out "
                        "prompts (default), or the self-distilled random tiny8, random prompts")
    p.add_argument("--ks", default="1,2,4,8", help="K values of the K sweep (default 1,2,4,8; those beyond the "
                   "target's depths are left out)")
    p.add_argument("--k-rounds", type=int, default=None, help="timed draft rounds per K and window (default 200)")
    p.add_argument("--full-sweep", action="store_true",
                   help="the K sweep's batch of 4 with compiled drafters too, and its draft-round latency (about as "
                        "many compiles again as batch 1's; default: an eager drafter for the batch of 4), and a cold "
                        "compile probe for every K (default: the smallest and largest)")
    p.add_argument("--distill-steps", type=int, default=None,
                   help="self-distillation Adam steps of the synthetic e2e target (default: distill's)")
    p.add_argument("--e2e-checkpoint", default=None, metavar="DIR",
                   help="run e2e and the K sweep on this distilled raw-layout checkpoint (e.g. one carried to "
                        "another machine; a text target's gets held-out prompts) instead of building one here")
    p.add_argument("--json", dest="json_path", default=None,
                   help="where the JSON goes (default: a new file under bench/out/, which git ignores)")
    p.add_argument("--record", nargs="?", const=str(RESULTS_MD), default=None, metavar="FILE",
                   help="append an entry to bench/RESULTS.md (or FILE); without it the tracked tree is not touched")
    a = p.parse_args(argv)

    skip = frozenset(x.strip() for x in a.skip.split(",") if x.strip())
    if skip - SECTIONS.keys():
        p.error(f"unknown section(s) to skip: {sorted(skip - SECTIONS.keys())}; choose from {', '.join(SECTIONS)}")
    with_ = frozenset(x.strip() for x in a.with_.split(",") if x.strip())
    if with_ - OPT_IN.keys():
        p.error(f"--with names section(s) that are not opt-in: {sorted(with_ - OPT_IN.keys())}; choose from "
                f"{', '.join(OPT_IN)}")
    if with_ & skip:
        p.error(f"section(s) both skipped and asked for with --with: {sorted(with_ & skip)}")
    batch_sizes = _positive_ints(p, "--batch-sizes", a.batch_sizes, "at least one batch size >= 1")
    ks = _positive_ints(p, "--ks", a.ks, "one or more K values, each >= 1")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    max_length = a.max_length or a.context + 64
    if max_length <= a.context + 1:
        p.error("--max-length must exceed --context + 1")
    defaults = dict(warmup=(2, 10), rounds=(2, 20), per_round=(3, 20), time_budget=(5.0, 20.0),
                    recompile_steps=(3, 20), e2e_prompts=(1, 4), e2e_tokens=(16, 64), k_rounds=(30, 200))
    counts = {k: getattr(a, k) if getattr(a, k) is not None else (quick if a.quick else full)
              for k, (quick, full) in defaults.items()}
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H-%M-%S")
    return Settings(
        configs=tuple(c.strip() for c in a.config.split(",") if c.strip()), device=a.device,
        dtype=a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"), batch_sizes=batch_sizes,
        context=a.context, max_length=max_length, weights=a.weights,
        threads=a.threads or (1 if a.device == "cpu" else torch.get_num_threads()), skip=skip, with_=with_,
        quick=a.quick, probe_timeout=a.probe_timeout, distill_steps=a.distill_steps, e2e_target=a.e2e_target,
        ks=ks, full_sweep=a.full_sweep,
        e2e_checkpoint=Path(a.e2e_checkpoint) if a.e2e_checkpoint else None,
        json_path=Path(a.json_path) if a.json_path else OUT_DIR / f"bench-{stamp}.json",
        record=Path(a.record) if a.record else None, **counts)


def run(argv=None) -> dict:
    """Parse ``argv``, run every section not skipped, print / write / record the results; returns the result."""
    s = parse_args(argv)
    threads_before = torch.get_num_threads()
    if s.device == "cpu":
        torch.set_num_threads(s.threads)
    try:
        return _run(s, sys.argv[1:] if argv is None else list(argv))
    finally:
        torch.set_num_threads(threads_before)


def write_json(path: Path, result: dict) -> None:
    """Whole or not at all: a run killed while writing leaves the previous copy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)


def _run(s: Settings, given: list[str]) -> dict:
    start = time.perf_counter()
    result = {
        "schema": SCHEMA_ID, "command": "python -m bench.run" + (" " + shlex.join(given) if given else ""),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "wall_s": 0.0, "partial": True,
        "completed": [], "machine": machine_info(s.threads), "settings": s.summary(), "configs": {}, "e2e": None,
        "goals": [],
    }

    def save(done: str | None = None, partial: bool = True) -> None:
        if done:
            result["completed"].append(done)
        result["wall_s"] = time.perf_counter() - start
        result["goals"] = report.evaluate_goals(result)
        result["partial"] = partial
        write_json(s.json_path, result)

    save()
    progress(f"results go to {s.json_path} (rewritten after every section)")
    from .step import copy_bandwidth

    copy_bw = copy_bandwidth(torch.device(s.device)) if s.device.startswith("cuda") and s.runs("latency") else None
    for preset in s.configs:
        if not (s.runs("compile") or s.runs("latency") or s.runs("quant", preset)):
            continue
        out = result["configs"][preset] = {"model": None, "compile": None, "kernels": None, "latency": {}}
        try:
            config_section(preset, s, copy_bw, out, save)
        except Exception as e:  # noqa: BLE001 - keep the other configs' results
            progress(f"{preset}: FAILED: {type(e).__name__}: {e}")
            out["error"] = f"{type(e).__name__}: {e}"[:2000]
        save(f"{preset}")
    for name in CPU_ONLY:
        if s.runs(name) and s.device != "cpu":
            progress(f"{name}: runs on CPU only (bench.{CPU_ONLY[name]}); left out on this device")
    for name, section in (("e2e", e2e_section), ("depths", depths_section), ("perrow", perrow_section)):
        if not s.runs(name) or name in CPU_ONLY and s.device != "cpu":
            continue
        try:
            result[name] = section(s)
        except Exception as e:  # noqa: BLE001 - record it and go on
            progress(f"{name}: FAILED: {type(e).__name__}: {e}")
            result[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        save(name)
    save(partial=False)
    table = report.format_table(result)
    print(table, flush=True)
    progress(f"wrote {s.json_path}")
    if s.record:
        report.append_results(s.record, result, table)
        progress(f"appended an entry to {s.record}")
    print(plots.report_line(result, s.json_path), flush=True)
    return result


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
