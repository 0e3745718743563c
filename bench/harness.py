"""What every section shares (listed in bench/README.md), so that each measures, records and prints alike."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import benchmark

from inkling_compiled.atomic_files import write_files_atomically

from . import PROBE_PREFIX

REPO_DIR = Path(__file__).resolve().parent.parent
_T0, _WHO = time.perf_counter(), ""


def progress(message: str) -> None:
    print(f"[bench{_WHO} {time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


class OneTimeBuilds(logging.Handler):
    """The seconds a run spends on what a machine builds once and then caches, by kind, so that the run can report its
    measurement apart: the packaged K-depth rounds built into the user's round cache (from ``round_cache``'s log
    records, each also shown as a progress line) and what sections :meth:`add` (the text target, the K = 1 package)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.seconds: dict[str, float] = {}
        self.beside = 0.0  # what the second process (Prebuild) built while this one measured
        self.user_cache: Path | None = None

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def emit(self, record: logging.LogRecord) -> None:
        try:
            progress(record.getMessage())
            if hasattr(record, "build_s") and self.user_cache and Path(record.directory).is_relative_to(
                    self.user_cache):  # not a section's own build into an empty directory
                self.add("packaged K-depth rounds", record.build_s)
        except Exception:  # noqa: BLE001 - logging's contract: a handler never raises into the code that logs
            self.handleError(record)

    @contextlib.contextmanager
    def recording(self):
        """Counting, from zero, while the block runs."""
        from inkling_compiled.runtime import round_cache

        self.seconds, self.beside, self.user_cache = {}, 0.0, round_cache.cache_root()
        logger = logging.getLogger(round_cache.__name__)
        level, logger.level = logger.level, logging.INFO
        logger.addHandler(self)
        try:
            yield self
        finally:
            logger.removeHandler(self)
            logger.setLevel(level)


ONE_TIME = OneTimeBuilds()


# ------------------------------------------------------------------------------------------------ timing

@dataclass
class Stats:
    """One variant's per-call samples in milliseconds (on CPU each a mean over about half a millisecond of calls)."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    n: int

    @classmethod
    def of(cls, samples_ms: list[float]) -> Stats:
        if not samples_ms:
            raise ValueError("no samples")
        s = sorted(samples_ms)
        return cls(statistics.median(s), *(s[round(p * (len(s) - 1))] for p in (0.1, 0.9)), s[0], len(s))


def samples_ms(fn: Callable[[], object], device: torch.device, seconds: float, timer=time.perf_counter) -> list[float]:
    """Per-call ms of ``fn`` over about ``seconds``: ``do_bench``'s on CUDA; on CPU samples of about 0.5 ms, short
    enough that the median skips another process's time slice (``timer=time.thread_time``: CPU time)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return list(do_bench(fn, warmup=max(1, int(seconds * 100)), rep=max(1, int(seconds * 1e3)),
                             return_mode="all"))
    measure = benchmark.Timer("fn()", globals={"fn": fn}, timer=timer)
    number = max(1, int(5e-4 / max(measure.timeit(1).times[0], 1e-7)))
    found, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(found) < 3:
        found.append(1e3 * measure.timeit(number).times[0])
    return found


def time_variants(variants: dict[str, Callable[[], object]], *, device: torch.device, budget_s: float,
                  rounds: int = 3) -> dict[str, Stats]:
    """Every variant timed in ``rounds`` rounds whose order rotates, so drift on a shared machine hits all alike."""
    names, found = list(variants), {name: [] for name in variants}
    with torch.no_grad():
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                found[name] += samples_ms(variants[name], device, budget_s / (rounds * len(names)))
    return {name: Stats.of(s) for name, s in found.items()}


def ratios(medians: dict[str, float], pairs: dict[str, tuple[str, str]]) -> dict[str, float]:
    """``name -> medians[a] / medians[b]`` for each pair both of whose medians were measured."""
    return {name: medians[a] / medians[b] for name, (a, b) in pairs.items() if a in medians and b in medians}


def random_rows(mtp, batch: int, start: int, rows: int, gen: torch.Generator):
    """Draft-step inputs for ``mtp`` at rows start..start+rows-1: random real ids, unit-scale hiddens, on its device."""
    ids = torch.randint(3, mtp.config.logits_vocab_size, (batch, rows), generator=gen)
    positions = torch.arange(start, start + rows)[None].expand(batch, rows).contiguous()
    hidden = torch.randn(batch, rows, mtp.config.hidden_size, generator=gen)
    return ids.to(mtp.device), positions.to(mtp.device), hidden.to(device=mtp.device, dtype=mtp.dtype)


# ------------------------------------------------------------------------------------------------ probes

def _bench(*args: str, cache_dir: str | None = None) -> dict:
    """subprocess's arguments for ``python -m bench ARGS`` (its own Inductor / Triton cache dir when given)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_DIR), os.environ.get("PYTHONPATH")]))}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    if cache_dir is not None:
        env.update(TORCHINDUCTOR_CACHE_DIR=cache_dir, TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"))
    return {"args": [sys.executable, "-m", "bench", *args], "cwd": REPO_DIR, "env": env, "text": True}


def run_probe(function: str, args: dict, *, cache_dir: str | None, timeout: float) -> dict:
    """``bench.<function>(args)`` in a fresh interpreter (``args["spawned_at"]``: the spawn's wall clock) and the
    dict it returns, with ``process_s`` (spawn to exit)."""
    start = time.perf_counter()
    done = subprocess.run(**_bench("probe", function, json.dumps({**args, "spawned_at": time.time()}),
                                   cache_dir=cache_dir), capture_output=True, timeout=timeout)
    found = [line for line in done.stdout.splitlines() if line.startswith(PROBE_PREFIX)]
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
        raise RuntimeError(f"probe {function} failed (exit {done.returncode}): " + " | ".join(tail))
    return {**json.loads(found[-1][len(PROBE_PREFIX):]), "process_s": time.perf_counter() - start}


def keep_compiles(cache_dir: str) -> None:
    """A probe's Inductor cache merged into this process's (each file it lacks, atomically), so that the run's own
    compiles of the probe's graphs hit the FX graph cache instead of compiling them again."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as own_cache_dir

    source, target = Path(cache_dir), Path(own_cache_dir())
    for path in source.rglob("*"):
        copy = target / path.relative_to(source)
        if path.is_file() and not path.is_symlink() and not copy.exists():
            write_files_atomically(copy.parent, {copy.name: functools.partial(shutil.copy2, path)})


class Prebuild:
    """The one-time builds of later sections (the text target, packaged K-depth rounds: minutes on a machine's first
    run, none later) done ahead by a second process, at a lower priority and with one compile thread, on the cores
    the run's timing threads leave; a section :meth:`wait`s for its builds where it needs them (``Context.prebuilt``).
    """

    def __init__(self, sections: list[str], argv: list[str]):
        self.sections, self.waited = sections, set()
        self.done: dict[str, float | None] = {}  # section -> seconds it built (None: its prebuild failed)
        started = time.time() - (time.perf_counter() - _T0)  # the run's clock, in wall seconds
        child = _bench("prebuild", ",".join(sections), str(started), *argv)
        child["env"]["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        self.process = subprocess.Popen(**{**child, "cwd": os.getcwd()}, stdout=subprocess.PIPE)  # argv's paths

    @staticmethod
    def serve(sections: list[str], settings: Settings, modules: dict, started: float) -> None:
        """The second process's side (``python -m bench prebuild``): each section module's ``prebuild(settings)`` in
        turn, a line to the run as each is done with the seconds it built; progress lines on the run's clock
        (``started``: its wall-clock start). A TERM from the run ends it through its cleanups."""
        global _T0, _WHO
        _T0, _WHO = time.perf_counter() - (time.time() - started), " 2nd process"
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
        os.nice(10)  # the run's measurements first
        torch.set_num_threads(settings.threads)  # what the entries' code is built for, as in the run
        for name in sections:
            with ONE_TIME.recording() as built:  # shows the round builds as progress lines
                try:
                    modules[name].prebuild(settings)
                    found = sum(built.seconds.values())
                except Exception as e:  # noqa: BLE001 - the section then builds for itself; the others go on
                    progress(f"{name}: building ahead FAILED: {error_text(e)}")
                    found = None
            print(PROBE_PREFIX + json.dumps({name: found}), flush=True)

    def wait(self, section: str) -> None:
        """Until the second process has reported ``section``, one it builds ahead (or ended: the section then
        builds what it needs itself); the seconds waited count as one-time builds where it built something."""
        if section in self.waited or section not in self.sections:
            return
        self.waited.add(section)
        start = time.perf_counter()
        while section not in self.done and (line := self.process.stdout.readline()):
            if line.startswith(PROBE_PREFIX):
                self.done.update(json.loads(line[len(PROBE_PREFIX):]))
        waited, built = time.perf_counter() - start, self.done.get(section)
        if built:
            ONE_TIME.add("waiting for the second process", waited)
            ONE_TIME.beside += max(0.0, built - waited)
            progress(f"{section}: the second process built for {built:.1f} s; waited {waited:.1f} s")
        elif built is None:
            why = "it failed" if section in self.done else f"the second process ended, exit {self.process.wait()}"
            progress(f"{section}: not built ahead ({why}); the section builds what it needs itself")

    def close(self) -> None:
        """Let it finish when every section was reported (it is exiting), else stop it: TERM first, so that a build
        it leaves half done is removed by its own cleanups (they are in temporary directories)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=60 if set(self.sections) <= set(self.done) else 0)
        if self.process.returncode is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        if self.process.returncode is None:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


# ------------------------------------------------------------------------------------------------ records

def _to_json(value) -> object:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else str(value)


def plain(record) -> object:
    """A record (dataclasses, dicts, lists) as the JSON holds it (string keys, lists for tuples)."""
    return json.loads(json.dumps(record, default=_to_json))


def write_json(path: Path, value) -> None:
    """Whole or not at all: a run killed while writing leaves the previous copy."""
    text = json.dumps(value, indent=1, default=_to_json) + "\n"
    write_files_atomically(path.parent, {path.name: lambda tmp: tmp.write_text(text)})


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


# ------------------------------------------------------------------------------------------------ tables

def ms(x: float | None) -> str:
    return fmt(x, ".4f" if x < 0.1 else ".3f" if x < 10 else ".1f") if x is not None else "-"


def fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    """``x`` formatted, or "-" when not measured."""
    return "-" if x is None else f"{x:{spec}}{suffix}"


def yes(x: bool | None) -> str:
    return "-" if x is None else "yes" if x else "NO"


def table(rows: list[list[str]], indent: str = "") -> list[str]:
    """Columns aligned: the first to the left, the others to the right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [(indent + "  ".join([r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:], widths[1:]))])).rstrip()
            for r in rows]


# ------------------------------------------------------------------------------------------------ a run's settings

# Parts of sections the default (headline) run leaves out; ``--full`` runs them
FULL_ONLY = frozenset({"kernels", "stock", "ksweep", "tp", "multimodal", "kcompile", "perrow", "packaged_latency",
                       "e2e_eager", "target_loop", "kround_choices"})
# Sections a preset runs only when asked with --with (tiny: one compile per scheme, for a step not memory-bound)
OPT_IN = {"quant": frozenset({"tiny"})}


class Settings(argparse.Namespace):
    """Everything a run does: the command line, resolved once (:func:`bench.run.parse_args`)."""

    def runs(self, part: str, preset: str | None = None) -> bool:
        """Whether ``part`` (a section or a part of one) runs for ``preset``; one named by --only / --with always."""
        if part in self.skip:
            return False
        if part in self.with_ | self.only:
            return True
        return (self.full or part not in FULL_ONLY) and preset not in OPT_IN.get(part, ())

    def summary(self) -> dict:
        return {"configs": list(self.configs), "device": self.device, "dtype": self.dtype,
                "batch_sizes": list(self.batch_sizes), "context": self.context, "max_length": self.max_length,
                "threads": self.threads, "full": self.full, "quick": self.quick, "skip": sorted(self.skip),
                "only": sorted(self.only), "opt_in": sorted(self.with_),
                "e2e_target": str(self.e2e_checkpoint or self.e2e_target), "e2e_ks": list(self.e2e_ks),
                "ks": list(self.ks), "tp_world_sizes": list(self.tp_world_sizes)}


@dataclass
class Context:
    """What a section's ``measure`` gets: the settings, the config it runs for (per-config sections), cached
    models and end-to-end target, and ``publish`` to save a partial record before a risky step."""

    settings: Settings
    preset: str | None
    models: Callable[[], object]
    e2e_target: Callable[[], object]
    publish: Callable[[object], None]
    prebuilt: Callable[[], None]  # waits for the section's builds in the second process (Prebuild), if any
