"""Start-up and K-depth rounds on CPU (issue 26): the four figures, measured side by side in one run.

* ``import_torch_s``: a fresh interpreter from its spawn to ``import torch`` done (the median of ``processes``);
* ``import_package_s``: in the same processes, ``import inkling_compiled, inkling_compiled.runtime`` after torch,
  and which of Inductor, Dynamo and transformers that imported (none, docs/architecture.md §1);
* ``first_draft_s``: a fresh interpreter from its spawn to its first packaged draft: imports, the MTP from its
  checkpoint directory, a default K-depth ``Drafter`` whose round the disk cache holds (built by the round figures
  below, ``runtime/round_cache.py``), an eager depth-0 prefill, the first draft; and which heavy modules it imported;
* the round: ``draft`` on one new row per round (the K-row window), positions advancing, batch 1, one thread: the
  default CPU drafter at K (its cached packaged round) and at K = 1 (its compiled step), the K-depth round as
  compiled steps (``cached_rounds=False``) beside them, and the GEMM floor of the K-depth round (its GEMMs alone).

With ``choices=True`` also the K-depth round compiled as one graph (the alternative to the cached packaged round,
docs/compile.md §12.1), with its compile time: minutes on a 2-core machine.

Goals (issue 26, rows of ``report.GOALS``): ``first_draft_s <= 1.3 x import_torch_s``; ``import_package_s <= 0.5
s``; the K = 8 round ``<= 3 x`` the K = 1 round and ``<= 2 x`` its GEMM floor. The ``startup`` section of ``python -m
bench`` (CPU; the choices with ``--full``), or alone: ``python -m bench.startup [--config tiny8] [--k 8] [--choices]
[--json out.json]``, which prints the figures and which goal each meets.

The fresh processes are ``python -m bench.startup <probe>``, not ``harness.run_probe``: that child imports torch
(and ``probes.py`` Dynamo) before the probe's function runs, which are the very imports timed here. This module
imports only the standard library at its top for the same reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "STARTUP_PROBE: "
REPO_DIR = Path(__file__).resolve().parents[1]
HEAVY = ("torch._dynamo", "torch._inductor", "transformers")
GOALS = {"first_draft_vs_import_torch": 1.3, "import_package_s": 0.5, "round_k_vs_round_1": 3.0,
         "round_k_vs_floor": 2.0}


@dataclass
class RoundFigures:
    """Median wall ms of one round, per variant, and the build seconds of the variants built here."""

    median_ms: dict[str, float]
    p10_ms: dict[str, float]
    p90_ms: dict[str, float]
    build_s: dict[str, float]
    same_drafts: dict[str, bool]  # each variant's drafts over the timed rounds equal the compiled steps' drafts


@dataclass
class StartupResult:
    preset: str
    k: int
    threads: int
    torch: str
    processes: int
    import_torch_s: float
    import_package_s: float
    package_imported: list[str]  # heavy modules `import inkling_compiled` loaded (expected: none)
    first_draft_s: float
    first_draft_import_s: float  # of it, the imports
    first_draft_imported: list[str]  # heavy modules the serving process loaded (expected: none)
    first_draft_packaged: bool  # its round came from the cache
    rounds: RoundFigures
    ratios: dict[str, float] = field(default_factory=dict)
    goals: dict[str, bool] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ fresh processes

def probe_imports(args: dict) -> dict:
    """This interpreter: spawn to ``import torch``, then the package's imports."""
    import_torch = time.time()
    import torch  # noqa: F401

    torch_done = time.time()
    import inkling_compiled  # noqa: F401
    import inkling_compiled.runtime  # noqa: F401

    return {"import_torch_s": torch_done - float(args["spawned_at"]), "torch_alone_s": torch_done - import_torch,
            "import_package_s": time.time() - torch_done, "imported": [m for m in HEAVY if m in sys.modules]}


def probe_first_draft(args: dict) -> dict:
    """This interpreter: spawn to the first draft of the default drafter (its round from the disk cache)."""
    import torch

    from inkling_compiled import InklingMTP
    from inkling_compiled.runtime import Drafter

    imported = time.time()
    torch.set_num_threads(int(args["threads"]))
    mtp = InklingMTP.from_pretrained(args["checkpoint"])
    drafter = Drafter(mtp, 1, int(args["max_length"]), num_speculative_tokens=int(args["k"]),
                      graph_rows=(int(args["k"]),))
    ids, positions, hidden = _rows(mtp, 0, int(args["context"]) + 1)
    with torch.no_grad():
        mtp(ids[:, :-1], positions[:, :-1], hidden[:, :-1], cache=drafter.cache, depth=0)
    drafter.draft(ids[:, -1:], positions[:, -1:], hidden[:, -1:]).drafts.tolist()
    return {"first_draft_s": time.time() - float(args["spawned_at"]),
            "import_s": imported - float(args["spawned_at"]), "imported": [m for m in HEAVY if m in sys.modules],
            "packaged": bool(drafter.packaged_buckets)}


def _spawn(probe: str, args: dict, env: dict, timeout: float) -> dict:
    command = [sys.executable, "-m", "bench.startup", probe, json.dumps({**args, "spawned_at": time.time()})]
    done = subprocess.run(command, cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=timeout)
    found = [line for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
        raise RuntimeError(f"bench.startup {probe} failed (exit {done.returncode}): " + " | ".join(tail))
    return json.loads(found[-1][len(PREFIX):])


# ------------------------------------------------------------------------------------------------ rounds

def _rows(mtp, start: int, length: int, seed: int = 0):
    """Committed rows start..start+length-1 of one sequence (real ids, unit-scale hiddens)."""
    import torch

    gen = torch.Generator().manual_seed(seed + start)
    ids = torch.randint(3, mtp.config.logits_vocab_size, (1, length), generator=gen)
    hidden = torch.randn(1, length, mtp.config.hidden_size, generator=gen).to(mtp.dtype)
    return ids, torch.arange(start, start + length)[None], hidden


def _decode_calls(mtp, context: int, max_length: int, calls: int) -> list:
    """One new row per round from ``context`` on, starting over before the cache's end."""
    rows = _rows(mtp, 0, max_length - 1)
    position = context
    out = []
    for _ in range(calls):
        if position >= max_length - 1:
            position = context
        out.append(tuple(t[:, position:position + 1] for t in rows))
        position += 1
    return out


def _one_graph_round(drafter):
    """``drafter``'s round compiled as one function (every depth in one graph), instead of its per-geometry steps."""
    import torch

    depths = [functools.partial(drafter._depth, drafter.model.layers[k], drafter.cache.depths[k])
              for k in range(drafter.num_speculative_tokens)]
    drafter.__dict__["_compiled_round"] = torch.compile(functools.partial(drafter._round, drafter._window, depths),
                                                        **drafter._compile_options)
    return drafter


def rounds(mtp, k: int, *, context: int, max_length: int, choices: bool, budget_s: float, progress) -> RoundFigures:
    """The round variants, each built (and its first call run) untimed, then timed in turns."""
    import torch

    from inkling_compiled.runtime import Drafter

    from .floor import GemmFloor, record_gemms

    def drafter(kk: int, **kwargs):
        return Drafter(mtp, 1, max_length, num_speculative_tokens=kk, graph_rows=(kk,), **kwargs)

    builders = {"round_1": lambda: drafter(1), "round_k": lambda: drafter(k),
                "round_k_steps": lambda: drafter(k, cached_rounds=False)}
    if choices:
        builders["round_k_one_graph"] = lambda: _one_graph_round(drafter(k, cached_rounds=False))
    built, build_s = {}, {}
    prompt = _rows(mtp, 0, context)
    for name, build in builders.items():
        progress(f"round: {name} (built and first run untimed)")
        start = time.perf_counter()
        d = build()
        with torch.no_grad():
            mtp(*prompt, cache=d.cache, depth=0)
            d.draft(*_decode_calls(mtp, context, max_length, 1)[0])
        build_s[name] = time.perf_counter() - start
        built[name] = d
    eager = drafter(k, compile=False)
    with torch.no_grad():
        mtp(*prompt, cache=eager.cache, depth=0)
    call = _decode_calls(mtp, context, max_length, 1)[0]
    gemms, _ = record_gemms(lambda: eager.draft(*call), mtp.parameters())
    floor = GemmFloor(gemms, mtp.device)

    calls = _decode_calls(mtp, context, max_length, 400)
    samples = {name: [] for name in (*built, "floor_k")}
    drafts = {name: [] for name in built}
    deadline = time.perf_counter() + budget_s
    turn = 0
    with torch.no_grad():
        while time.perf_counter() < deadline or turn < 2:
            for name, d in built.items():
                for call in calls[:100] if turn else calls:
                    t0 = time.perf_counter()
                    result = d.draft(*call, validate=False)
                    samples[name].append(1e3 * (time.perf_counter() - t0))
                    if not turn:
                        drafts[name].append(result.drafts.clone())
            for _ in range(100):
                t0 = time.perf_counter()
                floor()
                samples["floor_k"].append(1e3 * (time.perf_counter() - t0))
            turn += 1

    def q(s, p):
        s = sorted(s)
        return s[min(len(s) - 1, round(p * (len(s) - 1)))]

    reference = drafts["round_k_steps"]
    same = {name: all(torch.equal(a, b) for a, b in zip(drafts[name], reference)) for name in drafts
            if name.startswith("round_k")}
    return RoundFigures({n: statistics.median(s) for n, s in samples.items()},
                        {n: q(s, 0.1) for n, s in samples.items()}, {n: q(s, 0.9) for n, s in samples.items()},
                        build_s, same)


# ------------------------------------------------------------------------------------------------ the measurement

def measure_startup(preset: str = "tiny8", k: int = 8, *, context: int = 64, max_length: int = 512, threads: int = 1,
            processes: int = 5, choices: bool = False, budget_s: float = 20.0, timeout: float = 1800.0,
            progress=lambda message: None) -> StartupResult:
    """The four figures (module doc) for ``preset`` at K = ``k``; the round cache is a fresh temporary directory."""
    import torch

    from inkling_compiled import InklingMTP
    from inkling_compiled.runtime import round_cache
    from inkling_compiled.testing.synthetic import cached_checkpoint

    torch.set_num_threads(threads)
    checkpoint = cached_checkpoint(preset)
    cache = tempfile.mkdtemp(prefix="inkling-bench-rounds-")
    saved = os.environ.get(round_cache.ENV_VAR)
    os.environ[round_cache.ENV_VAR] = cache
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_DIR), os.environ.get("PYTHONPATH")]))}
    try:
        mtp = InklingMTP.from_pretrained(checkpoint)
        figures = rounds(mtp, k, context=context, max_length=max_length, choices=choices, budget_s=budget_s,
                         progress=progress)
        args = {"checkpoint": str(checkpoint), "k": k, "threads": threads, "context": context,
                "max_length": max_length}
        imports, first = [], []
        for i in range(processes):  # taking turns: drift on a shared machine hits both alike
            progress(f"fresh processes {i + 1}/{processes}: imports, first packaged draft")
            imports.append(_spawn("imports", {}, env, timeout))
            first.append(_spawn("first_draft", args, env, timeout))
    finally:
        if saved is None:
            os.environ.pop(round_cache.ENV_VAR, None)
        else:
            os.environ[round_cache.ENV_VAR] = saved
        shutil.rmtree(cache, ignore_errors=True)

    def median(rows, key):
        return statistics.median(r[key] for r in rows)

    result = StartupResult(
        preset=preset, k=k, threads=threads, torch=torch.__version__, processes=processes,
        import_torch_s=median(imports, "import_torch_s"), import_package_s=median(imports, "import_package_s"),
        package_imported=sorted({m for r in imports for m in r["imported"]}),
        first_draft_s=median(first, "first_draft_s"), first_draft_import_s=median(first, "import_s"),
        first_draft_imported=sorted({m for r in first for m in r["imported"]}),
        first_draft_packaged=all(r["packaged"] for r in first), rounds=figures)
    med = figures.median_ms
    result.ratios = {"first_draft_vs_import_torch": result.first_draft_s / result.import_torch_s,
                     "round_k_vs_round_1": med["round_k"] / med["round_1"],
                     "round_k_vs_floor": med["round_k"] / med["floor_k"],
                     "round_k_steps_vs_round_k": med["round_k_steps"] / med["round_k"]}
    result.ratios["floor_k_vs_round_1"] = med["floor_k"] / med["round_1"]  # what bounds round_k_vs_round_1
    result.ratios["overhead_per_depth_us"] = 1e3 * (med["round_k"] - med["floor_k"]) / k  # what round_k adds to floor
    if "round_k_one_graph" in med:
        result.ratios["round_k_one_graph_vs_round_k"] = med["round_k_one_graph"] / med["round_k"]
    result.goals = {name: (result.import_package_s if name == "import_package_s" else result.ratios[name]) <= bound
                    for name, bound in GOALS.items()}
    return result


def measure(ctx) -> StartupResult:
    """The ``startup`` section of ``python -m bench`` (``harness.Context``): tiny8, K = 8, the run's threads."""
    from .harness import progress

    s = ctx.settings
    return measure_startup(threads=s.threads, choices=s.runs("kround_choices"), budget_s=s.time_budget,
                           timeout=s.probe_timeout, progress=progress)


def lines(out: dict) -> list[str]:
    """The section's table from its JSON record (``dataclasses.asdict`` of a :class:`StartupResult`)."""
    r, ratios, goals = out["rounds"], out["ratios"], out["goals"]
    none = "none of " + ", ".join(HEAVY)
    found = [f"start-up and K-depth rounds: {out['preset']} K={out['k']}, CPU, {out['threads']} thread(s), "
             f"torch {out['torch']}, {out['processes']} fresh processes each",
             f"  import torch (spawn to done)          {out['import_torch_s']:7.2f} s",
             f"  import inkling_compiled (+ runtime)   {out['import_package_s']:7.3f} s on top "
             f"(imported: {', '.join(out['package_imported']) or none})",
             f"  spawn to first packaged draft         {out['first_draft_s']:7.2f} s (imports "
             f"{out['first_draft_import_s']:.2f} s; round from the cache: {out['first_draft_packaged']}; imported: "
             f"{', '.join(out['first_draft_imported']) or none})",
             "  round (ms)                 median   p10-p90      built in"]
    for name, value in r["median_ms"].items():
        built = f"{r['build_s'][name]:7.1f} s" if name in r["build_s"] else ""
        found.append(f"    {name:22s} {value:8.4f}  {r['p10_ms'][name]:.4f}-{r['p90_ms'][name]:.4f}  {built}")
    found.append(f"  same drafts as the compiled steps: {r['same_drafts']}")
    for name, value in ratios.items():
        goal = GOALS.get(name)
        verdict = "" if goal is None else f"  goal <= {goal}: {'met' if goals[name] else 'MISSED'}"
        found.append(f"  {name:32s} {value:7.2f}{verdict}")
    found.append(f"  {'import_package_s':32s} {out['import_package_s']:7.3f}  goal <= 0.5 s: "
                 f"{'met' if goals['import_package_s'] else 'MISSED'}")
    if not goals["round_k_vs_round_1"]:
        found.append(f"  bound: the K-depth round's GEMMs alone cost {ratios['floor_k_vs_round_1']:.2f}x the whole "
                     "K = 1 round, so no K-depth round gets below that ratio")
    if not goals["round_k_vs_floor"]:
        found.append(f"  bound: above its GEMMs the round spends {ratios['overhead_per_depth_us']:.0f} us per depth: "
                     "the depth's other kernels, its runner call and the round's Python")
    return found


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("imports", "first_draft"):  # one probe process
        probe = probe_imports if argv[0] == "imports" else probe_first_draft
        print(PREFIX + json.dumps(probe(json.loads(argv[1]))), flush=True)
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny8", help="synthetic preset")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--processes", type=int, default=5, help="fresh processes per start-up figure")
    p.add_argument("--choices", action="store_true", help="also the round compiled as one graph (minutes)")
    p.add_argument("--time-budget", type=float, default=20.0, help="seconds of round timing")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    result = dataclasses.asdict(measure_startup(
        a.config, a.k, processes=a.processes, choices=a.choices, budget_s=a.time_budget,
        progress=lambda message: print(f"[bench.startup] {message}", file=sys.stderr, flush=True)))
    print("\n".join(lines(result)))
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
