"""The ``startup`` section (CPU): fresh processes from their spawn through ``import torch`` and ``import
inkling_compiled`` to their first packaged draft; the K-depth round's variants timed (docs/compile.md §12.1)."""

from __future__ import annotations

import functools
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch

from inkling_compiled import InklingMTP
from inkling_compiled.runtime import Drafter, round_cache
from inkling_compiled.testing.synthetic import cached_checkpoint

from .floor import GemmFloor, record_gemms
from .harness import Context, Settings, Stats, fmt, progress, random_rows, ratios, run_probe, table, time_variants
from .probes import first_draft_text, heavy_text

PRESET, K, CONTEXT, MAX_LENGTH = "tiny8", 8, 64, 512
RATIOS = {"round_k_vs_round_1": ("round_k", "round_1"), "round_k_vs_floor": ("round_k", "floor_k"),
          "round_k_steps_vs_round_k": ("round_k_steps", "round_k"), "floor_k_vs_round_1": ("floor_k", "round_1"),
          "round_k_one_graph_vs_round_k": ("round_k_one_graph", "round_k")}
NOTES = {"floor_k_vs_round_1": "the K-depth round's GEMMs alone over the whole K = 1 round: round_k_vs_round_1's "
         "bound", "overhead_per_depth_us": "what the round adds to its GEMMs per depth: the other kernels, the "
         "runner call, the round's Python"}


@dataclass
class Startup:
    preset: str
    k: int
    threads: int
    torch: str
    processes: int
    first_draft: dict  # bench.probes.first_draft of the default drafter: the fresh processes' medians
    rounds: dict[str, Stats]  # per variant, one new row per round, positions advancing, batch 1
    build_s: dict[str, float]  # a variant's build, prefill and first round
    same_drafts: dict[str, bool]  # each K-depth variant's drafts over the same rows equal the compiled steps'
    round_cache: str  # where round_k's packaged round came from
    ratios: dict[str, float]


def _medians(rows: list[dict]) -> dict:
    """Per figure of the fresh processes: a number's median, a list's union, a flag's all()."""
    return {key: sorted({m for r in rows for m in r[key]}) if isinstance(value, list) else
            all(r[key] for r in rows) if isinstance(value, bool) else statistics.median(r[key] for r in rows)
            for key, value in rows[0].items()}


def _rounds(drafter: Drafter, rows):
    """``drafter``'s round on the next row of ``rows`` per call from ``CONTEXT`` on, starting over at their end."""
    calls = itertools.cycle([[t[:, p:p + 1] for t in rows] for p in range(CONTEXT, rows[0].shape[1])])
    return lambda: drafter.draft(*next(calls), validate=False)


def _one_graph_round(drafter: Drafter) -> Drafter:
    """``drafter``'s round compiled as one function (every depth in one graph), instead of its per-geometry steps."""
    depths = [functools.partial(drafter._depth, drafter.model.layers[k], drafter.cache.depths[k])
              for k in range(drafter.num_speculative_tokens)]
    drafter.__dict__["_compiled_round"] = torch.compile(functools.partial(drafter._round, drafter._window, depths),
                                                        **drafter._compile_options)
    return drafter


def _drafter(mtp: InklingMTP, rows, k: int, **kwargs) -> Drafter:
    d = Drafter(mtp, 1, MAX_LENGTH, num_speculative_tokens=k, graph_rows=(k,), **kwargs)
    mtp(*(t[:, :CONTEXT] for t in rows), cache=d.cache, depth=0)
    return d


def _rows(mtp: InklingMTP):
    return random_rows(mtp, 1, 0, MAX_LENGTH - 1, torch.Generator().manual_seed(0))


@torch.no_grad()
def _round_variants(mtp: InklingMTP, choices: bool, budget_s: float, prebuilt: Callable[[], None]
                    ) -> tuple[dict, dict, dict]:
    """Each variant built and its first round run untimed (round_k's after ``prebuilt()``: a second process may be
    packaging it), the drafts compared over 400 rounds, then all timed."""
    rows = _rows(mtp)
    builders = {"round_1": lambda: _drafter(mtp, rows, 1),
                "round_k_steps": lambda: _drafter(mtp, rows, K, cached_rounds=False),
                "round_k": lambda: _drafter(mtp, rows, K)}
    if choices:
        builders["round_k_one_graph"] = lambda: _one_graph_round(_drafter(mtp, rows, K, cached_rounds=False))
    variants, build_s = {}, {}
    for name, build in builders.items():
        if name == "round_k":
            prebuilt()
        progress(f"startup: {name} (built and first run untimed)")
        start = time.perf_counter()
        variants[name] = _rounds(build(), rows)
        variants[name]()
        build_s[name] = time.perf_counter() - start
    drafts = {name: [variants[name]().drafts.clone() for _ in range(400)] for name in variants if name != "round_1"}
    same = {name: all(map(torch.equal, d, drafts["round_k_steps"])) for name, d in drafts.items()}
    eager = _rounds(_drafter(mtp, rows, K, compile=False), rows)
    variants["floor_k"] = GemmFloor(record_gemms(eager, mtp.parameters())[0], mtp.device)
    progress(f"startup: timing {', '.join(variants)}")
    return time_variants(variants, device=mtp.device, budget_s=budget_s), build_s, same


def measure(ctx: Context) -> Startup:
    """The round variants first (they leave the K-depth round in a fresh disk cache), then the fresh processes."""
    s = ctx.settings
    processes, checkpoint = 3 if s.quick else 5, cached_checkpoint(PRESET)
    args = {"checkpoint": str(checkpoint), "device": "cpu", "dtype": "float32", "batch": 1, "k": K,
            "context": CONTEXT, "max_length": MAX_LENGTH, "threads": s.threads}
    # --full builds the packaged round into an empty cache (its build time is a figure); the default run reads the
    # disk cache a user's drafter fills, so only a machine's first run pays the build (minutes on 2 cores)
    with tempfile.TemporaryDirectory(prefix="inkling-bench-rounds-") as cache, \
            mock.patch.dict("os.environ", {round_cache.ENV_VAR: cache} if s.full else {}):
        rounds, build_s, same = _round_variants(InklingMTP.from_pretrained(checkpoint), s.runs("kround_choices"),
                                                s.time_budget, ctx.prebuilt)
        first = []
        for i in range(processes):
            progress(f"startup: fresh process {i + 1}/{processes} to its first packaged draft")
            first.append(run_probe("probes.first_draft", args, cache_dir=None, timeout=s.probe_timeout))
    fresh, med = _medians(first), {name: v.median_ms for name, v in rounds.items()}
    found = {"first_draft_vs_import_torch": fresh["to_first_draft_s"] / fresh["import_torch_s"], **ratios(med, RATIOS),
             "overhead_per_depth_us": 1e3 * (med["round_k"] - med["floor_k"]) / K}
    return Startup(PRESET, K, s.threads, torch.__version__, processes, fresh, rounds, build_s, same,
                   "an empty directory" if s.full else "the disk cache (a first run builds it)", found)


@torch.no_grad()
def prebuild(s: Settings) -> None:
    """For :class:`bench.harness.Prebuild`: round_k's packaged round, when the round cache lacks it (--full measures
    its build into an empty cache instead)."""
    if s.full:
        return
    mtp = InklingMTP.from_pretrained(cached_checkpoint(PRESET))
    rows = _rows(mtp)
    drafter = _drafter(mtp, rows, K)
    if round_cache.missing(drafter):
        _rounds(drafter, rows)()


def lines(out: dict) -> list[str]:
    fresh = out["first_draft"]
    found = [f"start-up and K-depth rounds: {out['preset']} K={out['k']}, CPU, {out['threads']} thread(s), "
             f"torch {out['torch']}, medians of {out['processes']} fresh processes",
             f"  import torch (spawn to done)         {fresh['import_torch_s']:7.2f} s",
             f"  import inkling_compiled (+ runtime)  {fresh['import_package_s']:7.3f} s on top (imported: "
             f"{heavy_text(fresh['package_imported'])})",
             f"  spawn to the first packaged draft: {first_draft_text(fresh)}",
             f"  round_k's packaged round from {out['round_cache']}"]
    rows = [["  round (ms)", "median", "p10-p90", "built in"]]
    rows += [[f"    {name}", f"{v['median_ms']:.4f}", f"{v['p10_ms']:.4f}-{v['p90_ms']:.4f}",
              fmt(out["build_s"].get(name), ".1f", " s")] for name, v in out["rounds"].items()]
    found += table(rows) + [f"  same drafts as the compiled steps: {out['same_drafts']}"]
    return found + [f"  {name:30s} {value:8.2f}" + (f"  ({NOTES[name]})" if name in NOTES else "")
                    for name, value in out["ratios"].items()]
