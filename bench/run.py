"""``python -m bench``: sub-commands ``run`` (the default: measure, print, write the JSON and the report image),
``report RESULT.json`` (a saved run's table and image), ``prebuild`` (internal: a run's second process); ``probe``
(internal: a fresh process's measurement) is bench/__main__.py's; sections: :data:`SECTIONS`."""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import transformers

from inkling_compiled import arguments
from inkling_compiled.checkpoint.reader import checkpoint_directory
from inkling_compiled.runtime import round_cache
from inkling_compiled.testing.synthetic import PRESETS, preset_config

from . import compile_time, e2e, multimodal, packaged, plots, quant, report, startup, step, tp
from .harness import ONE_TIME, OPT_IN, Context, Prebuild, Settings, error_text, plain, progress, write_json
from .models import load_models

SCHEMA_ID = "inkling-bench/4"  # 4: one e2e record (the K sweep and batches in it), startup.first_draft, multimodal
BENCH_DIR = Path(__file__).resolve().parent
RESULTS_MD = BENCH_DIR / "RESULTS.md"
OUT_DIR = BENCH_DIR / "out"  # git-ignored


@dataclass(frozen=True)
class Section:
    """A measurement module: ``measure(Context) -> dataclass`` and ``lines(its JSON dict) -> list[str]``."""

    name: str
    module: ModuleType
    help: str
    per_config: bool = False  # runs once per --config preset (on its models), else once per run
    cpu_only: bool = False


# The one table of sections, in the order they run and print
SECTIONS = (
    Section("compile", compile_time, "cold / warm compile of the draft step, each in a fresh process", True),
    Section("latency", step, "the one-token draft step per variant, transformers' step and the GEMM floor", True),
    Section("quant", quant, "fp32 / bf16 / int8 weight-only step against the fp32 GEMM floor (opt-in on tiny)", True),
    Section("packaged", packaged, "the AOTInductor-packaged drafter: build, start-up in fresh processes (K = 1)", True),
    Section("e2e", e2e, "end to end on the text target: ours at K = 1 and 8 vs the target and generate(use_mtp); "
            "with --full every K, draft rounds, batches 4 and 8 per row vs lockstep"),
    Section("multimodal", multimodal, "image prompts: acceptance from merged rows vs placeholder ids; the "
            "generate(custom_generate=...) wrapper's cost (--full)"),
    Section("tp", tp, "the tensor-parallel draft head on 1 and 2 gloo ranks: bytes per rank and per draft round, "
            "round latency; full-size communication beside transformers' and SGLang's schemes (--full)", cpu_only=True),
    Section("startup", startup, "import cost and a fresh process to its first packaged draft vs import torch; the "
            "K = 8 round (cached, packaged) vs K = 1 and its GEMM floor (tiny8; the choices with --full)",
            cpu_only=True),
)
# Parts of sections, for --skip
PARTS = {"kernels": "generated-code counts, stock vs passes (--full)", "stock": "the compiled step without our passes "
         "(--full)", "compiled": "every compiled variant", "cudagraph": "the CUDA-graph variant (CUDA)",
         "peer": "transformers' MtpModel and generate(use_mtp=True)", "floor": "the GEMM-only floor",
         "ksweep": "e2e at every K of --ks, batch 1, and their draft rounds (--full)",
         "kcompile": "the e2e Ks' cold compiles in fresh processes, smallest and largest (--full, with ksweep)",
         "perrow": "e2e batches 4 and 8 at every K, per row vs lockstep, the rollback's cost (--full)",
         "kround_choices": "the K = 8 round compiled as one graph, beside the cached packaged one (--full)"}
# option: (--quick, default, --full)
COUNTS = {"time_budget": (2.0, 6.0, 20.0), "recompile_steps": (3, 10, 20), "e2e_prompts": (1, 2, 4),
          "e2e_tokens": (16, 64, 64), "k_seconds": (0.3, 1.0, 2.0)}


def machine_info(threads: int) -> dict:
    info = Path("/proc/cpuinfo")
    cpus = [line.split(":", 1)[1].strip() for line in (info.read_text().splitlines() if info.exists() else [])
            if line.startswith("model name")]
    triton = importlib.util.find_spec("triton") and importlib.metadata.version("triton")  # optional: GPU kernels
    return {"cpu": cpus[0] if cpus else platform.processor() or platform.machine(), "cores": os.cpu_count() or 1,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "threads": threads,
            "platform": platform.platform(), "triton": triton or None}


# ------------------------------------------------------------------------------------------------ the command line

def _items(value: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in value.split(",") if x.strip())


def _names(known) -> Callable[[str], frozenset[str]]:
    def names(value: str) -> frozenset[str]:
        if not _items(value):  # an empty --only ran every section
            raise argparse.ArgumentTypeError(f"must name one or more of {', '.join(known)}, got {value!r}")
        unknown = sorted(set(_items(value)) - set(known))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown name(s) {unknown}; choose from {', '.join(known)}")
        return frozenset(_items(value))
    return names


def _seconds(positive: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, > 0 where ``positive``, else >= 0."""
    def seconds(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            x = math.nan
        if not math.isfinite(x) or x < 0 or positive and x == 0:
            raise argparse.ArgumentTypeError(f"must be a number {'>' if positive else '>='} 0, got {value!r}")
        return x
    return seconds


def _presets(value: str) -> tuple[str, ...]:
    """One or more synthetic presets, in the order given (the order the per-config sections run them)."""
    if not _items(value):
        raise argparse.ArgumentTypeError(f"must name one or more presets ({', '.join(PRESETS)}), got {value!r}")
    _names(list(PRESETS))(value)
    return tuple(dict.fromkeys(_items(value)))


def _device(value: str) -> str:
    """cpu or cuda[:N] (what the sections compare against), usable here (``arguments.device``: an absent CUDA or
    index is refused now, not in the first section)."""
    try:
        kind = torch.device(value).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu or cuda (cuda:N), got {value!r}")
    try:
        arguments.device(value, runs=True)
    except arguments.ArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return "cpu" if kind == "cpu" else value


def _checkpoint(value: str) -> Path:
    try:
        return checkpoint_directory("checkpoint", value)
    except arguments.ArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_ints(value: str) -> tuple[int, ...]:
    try:
        numbers = tuple(int(x) for x in _items(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {value!r}") from None
    if not numbers or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"must name one or more integers, each >= 1, got {value!r}")
    return tuple(dict.fromkeys(numbers))  # each once, in the order given (a repeat measured it twice)


def _world_sizes(value: str) -> tuple[int, ...]:
    sizes, runnable = _positive_ints(value), tp.world_sizes()
    if not set(sizes) <= set(runnable):
        raise argparse.ArgumentTypeError(f"the tp section's {tp.PRESET} preset splits over "
                                         f"{', '.join(map(str, runnable))} ranks (one process each), got {value!r}")
    return sizes


def add_run_options(p: argparse.ArgumentParser) -> None:
    names, ints = [s.name for s in SECTIONS], _positive_ints
    count, seconds = arguments.positive_int_option, _seconds(positive=True)
    p.add_argument("--full", action="store_true", help="every section and part, with longer timings (tens of "
                   "minutes on 2 cores; default: the headline figures in under 2 once a first run built its rounds)")
    p.add_argument("--quick", action="store_true", help="few iterations everywhere (a smoke test; rough "
                   "numbers; with --full: every section, few iterations)")
    p.add_argument("--only", type=_names(names), default=frozenset(), metavar="SECTIONS",
                   help="run only these sections (each even where it is off by default): "
                        + "; ".join(f"{s.name} ({s.help})" for s in SECTIONS))
    p.add_argument("--skip", type=_names([*names, *PARTS]), default=frozenset(), help="sections or parts to leave "
                   "out: the sections above; " + "; ".join(f"{k} ({v})" for k, v in PARTS.items()))
    p.add_argument("--with", dest="with_", type=_names(list(OPT_IN)), default=frozenset(), metavar="SECTIONS",
                   help="opt-in sections to run: " + "; ".join(f"{n} (off for {', '.join(sorted(v))})"
                                                             for n, v in OPT_IN.items()))
    p.add_argument("--config", dest="configs", type=_presets, default="tiny",
                   help="synthetic preset(s) for the step sections: tiny, small, full")
    p.add_argument("--device", type=_device, default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="default float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--batch-sizes", type=ints, default="1", help="comma-separated batch sizes of the latency section")
    p.add_argument("--context", type=count, default=64, help="rows prefilled before the timed step (the draft cache "
                   "holds 64 more)")
    p.add_argument("--weights", choices=("checkpoint", "random"),
                   help="checkpoint (shared by both libraries; tiny/small default) or random (full default)")
    p.add_argument("--threads", type=arguments.threads_option, help="torch intra-op threads on CPU (default 1)")
    p.add_argument("--time-budget", type=seconds, help="seconds of timing per latency run")
    p.add_argument("--recompile-steps", type=count, help="steps at moving positions in the compile probe")
    p.add_argument("--probe-timeout", type=seconds, default=600.0, help="seconds before a fresh-process probe is cut")
    p.add_argument("--e2e-prompts", type=count, help="prompts per end-to-end method")
    p.add_argument("--e2e-tokens", type=count, help="new tokens per prompt")
    p.add_argument("--e2e-target", choices=("text", "synthetic"), default="text",
                   help="text: the text target, held-out prompts; synthetic: the self-distilled tiny8, random prompts")
    p.add_argument("--e2e-ks", type=ints, default="1,8", help="K values of the e2e section's compiled drafters")
    p.add_argument("--e2e-checkpoint", type=_checkpoint, metavar="DIR", help="a distilled raw-layout checkpoint for "
                   "the end-to-end sections instead of building one here")
    p.add_argument("--distill-steps", type=count, help="self-distillation steps of the synthetic target")
    p.add_argument("--ks", type=ints, default="1,2,4,8", help="K values of the K sweep (beyond the target's depths: "
                   "left out)")
    p.add_argument("--k-seconds", type=_seconds(positive=False), help="seconds of draft-round timing per K and window "
                   "(0: none)")
    p.add_argument("--tp-world-sizes", type=_world_sizes, default="1,2", help="gloo ranks of the tp section")
    p.add_argument("--json", dest="json_path", type=Path, help="where the JSON goes (default: bench/out/)")
    p.add_argument("--record", nargs="?", const=RESULTS_MD, type=Path, metavar="FILE",
                   help="append an entry to bench/RESULTS.md (or FILE)")


def parse_args(argv=None) -> Settings:
    p = arguments.OneLineParser(prog="python -m bench run")
    add_run_options(p)
    s = p.parse_args(argv, namespace=Settings())
    # the draft cache holds --context + 64 rows: within the positions each preset is made for (model_max_length),
    # beyond which a run only fails allocating, section after section
    for preset in s.configs:
        longest = preset_config(preset)["text_config"]["model_max_length"]
        if s.context + 64 > longest:
            p.error(f"argument --context: the draft cache holds --context + 64 rows and {preset} has model_max_length "
                    f"{longest}: at most {longest - 64}, got {s.context}")
    if (s.with_ | s.only) & s.skip:
        p.error(f"section(s) both skipped and asked for with --with / --only: {sorted((s.with_ | s.only) & s.skip)}")
    if s.record is not None and (s.record.is_dir() or not s.record.parent.is_dir()):
        p.error(f"argument --record: {str(s.record)!r} must be a file in an existing directory")
    if s.record is not None and (problem := _appendable(s.record)):  # now, not after minutes of measuring
        p.error(f"argument --record: cannot append to {str(s.record)!r}: {problem}")
    if s.json_path is not None and s.json_path.is_dir():
        p.error(f"argument --json: {str(s.json_path)!r} is a directory; name the file")
    level = 0 if s.quick else 2 if s.full else 1
    for name, counts in COUNTS.items():
        setattr(s, name, counts[level] if getattr(s, name) is None else getattr(s, name))
    s.max_length = s.context + 64
    s.dtype = s.dtype or ("bfloat16" if s.device.startswith("cuda") else "float32")
    s.threads = s.threads or (1 if s.device == "cpu" else torch.get_num_threads())
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H-%M-%S")
    s.json_path = s.json_path or OUT_DIR / f"bench-{stamp}.json"
    return s


def _appendable(path: Path) -> str | None:
    """Why ``path`` cannot be appended to (opened for appending, a file it creates removed again), or None."""
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    if not existed:
        path.unlink()
    return None


# ------------------------------------------------------------------------------------------------ the runner

def run(argv=None) -> dict:
    """Parse ``argv``, run every section selected, print / write / record the results; returns the result."""
    s, threads_before, start = parse_args(argv), torch.get_num_threads(), time.perf_counter()
    if s.device == "cpu":
        torch.set_num_threads(s.threads)
    try:
        with ONE_TIME.recording():
            return _run(s, sys.argv[1:] if argv is None else list(argv), start)
    finally:
        torch.set_num_threads(threads_before)


def _run(s: Settings, given: list[str], start: float) -> dict:
    result = {"schema": SCHEMA_ID, "command": shlex.join(["python", "-m", "bench", "run", *given]),
              "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "wall_s": 0.0, "partial": True,
              "completed": [], "machine": machine_info(s.threads), "settings": s.summary(), "configs": {},
              "goals": [], "one_time_s": {}, "one_time_beside_s": 0.0}

    def save(done: str | None = None, partial: bool = True) -> None:
        result["completed"] += [done] if done else []
        result.update(wall_s=time.perf_counter() - start, goals=report.evaluate_goals(result), partial=partial,
                      one_time_s=dict(ONE_TIME.seconds), one_time_beside_s=ONE_TIME.beside)
        write_json(s.json_path, result)

    try:  # the first write, before anything is measured
        save()
    except OSError as e:
        raise SystemExit(f"python -m bench run: error: argument --json: cannot write {s.json_path}: "
                         f"{e.strerror or e}") from None
    progress(f"results go to {s.json_path} (rewritten after every section)")
    target = functools.cache(lambda: e2e.build_target(s))
    selected = [section for section in SECTIONS if _selected(s, section)]
    ahead = built_ahead(s, selected)
    # on CPU only (what it builds is CPU code), with the round cache on (tests turn it off), on a core left free
    second = Prebuild(ahead, given) if ahead and s.device == "cpu" and round_cache.cache_root() is not None and \
        (os.cpu_count() or 1) > s.threads else None
    try:
        for section in selected:
            prebuilt = functools.partial(second.wait, section.name) if second else (lambda: None)
            for preset in s.configs if section.per_config else (None,):
                if s.runs(section.name, preset):
                    _section(s, section, preset, result, target, save, prebuilt)
    finally:
        if second:
            second.close()
    save(partial=False)
    text = format_table(result)
    print(text, flush=True)
    progress(f"wrote {s.json_path}")
    if s.record:
        try:
            report.append_results(s.record, result, text)
            progress(f"appended an entry to {s.record}")
        except OSError as e:  # a disk that filled while measuring: the run is in the JSON still
            progress(f"could not append to {s.record}: {e.strerror or e}; the run is in {s.json_path}")
    print(plots.report_line(result, s.json_path), flush=True)
    return result


def built_ahead(s: Settings, selected: list[Section]) -> list[str]:
    """The sections whose one-time builds a second process does ahead: those with a ``prebuild`` after the first
    section to run, which builds for itself (ahead of it, a second process would only make it wait)."""
    running = [section for section in selected if s.runs(section.name)]
    return [section.name for section in running[1:] if hasattr(section.module, "prebuild")]


def _selected(s: Settings, section: Section) -> bool:
    if s.only and section.name not in s.only | s.with_ or section.name in s.skip:  # --with adds to --only
        return False
    if section.cpu_only and s.device != "cpu":
        progress(f"{section.name}: runs on CPU only; left out on this device")
        return False
    return True


@functools.cache
def _models(preset: str, device: str, dtype: str, weights: str | None, peer: bool):
    progress(f"{preset}: loading models ({weights or 'default'} weights, {device}, {dtype})")
    return load_models(preset, device=device, dtype=getattr(torch, dtype), weights=weights, peer=peer)


def _section(s: Settings, section: Section, preset: str | None, result: dict, target, save, prebuilt) -> None:
    """One section (for one preset) measured and saved; a failure is recorded and the run goes on."""
    home = result["configs"].setdefault(preset, {}) if preset else result
    models = functools.partial(_models, preset, s.device, s.dtype, s.weights, s.runs("peer"))

    def publish(record) -> None:
        home[section.name] = plain(record)
        save()

    if preset and "model" not in home:
        home["model"] = models().describe()
    try:
        home[section.name] = plain(section.module.measure(Context(s, preset, models, target, publish, prebuilt)))
    except Exception as e:  # noqa: BLE001 - keep the other sections' figures
        progress(f"{section.name}{' ' + preset if preset else ''}: FAILED: {type(e).__name__}: {e}")
        home[section.name] = {"error": error_text(e)}
    save(f"{preset}/{section.name}" if preset else section.name)


def format_table(result: dict) -> str:
    s, m = result["settings"], result["machine"]
    lines = [f"inkling_compiled benchmark | {m['cpu']} ({m['cores']} cores{', ' + m['gpu'] if m.get('gpu') else ''}) "
             f"| torch {m['torch']} | transformers {m['transformers']} | {s['threads']} thread(s)"]
    by_name = {section.name: section for section in SECTIONS}

    def sections(records: dict) -> list[str]:
        return [line for name, record in records.items() if name in by_name for line in ["", *(
            [f"{name}: FAILED: {record['error']}"] if list(record) == ["error"] else by_name[name].module.lines(
                record))]]

    for preset, cfg in result["configs"].items():
        model, d = cfg["model"], cfg["model"]["depth0"]
        attention = f"sliding W {d['window']}" if d["sliding"] else "full attention"
        lines += ["", f"== {preset}: H {model['hidden_size']}, V {model['vocab_size']}, depth 0 {d['heads']}x"
                  f"{d['head_dim']} heads ({d['kv_heads']} kv, {attention}) | {model['weights']} weights | "
                  f"{s['device']} {s['dtype']} | context {s['context']} ==", *sections(cfg)]
    return "\n".join([*lines, *sections(result), "", *report.headline_lines(result), "",
                      *report.goal_lines(result["goals"]), "", report.wall_line(result)])


# ------------------------------------------------------------------------------------------------ sub-commands

class ReportError(Exception):
    """What ``python -m bench report`` refuses: one line, exit status 2 (as for a bad argument)."""


def load_result(path: Path) -> dict:
    """A saved result; ReportError naming the problem when it is not one of this schema."""
    try:
        result = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReportError(f"{path}: not a readable JSON file ({e})") from None
    if (schema := result.get("schema") if isinstance(result, dict) else None) != SCHEMA_ID:
        raise ReportError(f"{path} is not a `python -m bench run` result of schema {SCHEMA_ID} (its schema: "
                          f"{schema!r})")
    return result


def report_command(a: argparse.Namespace) -> int:
    result = load_result(a.result)
    out = a.out or a.result.with_suffix(".png")
    try:
        table = format_table(result)
        drawn = None if a.no_image else plots.draw_report(result, out)
    except ImportError:  # matplotlib, the plots extra
        raise ReportError(plots.MISSING_HINT.format(json=a.result)) from None
    except OSError as e:
        raise ReportError(f"cannot write {out}: {e.strerror or e}; choose another place with --out") from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:  # edited contents
        raise ReportError(f"{a.result} does not hold what a `python -m bench run` of schema {SCHEMA_ID} writes "
                          f"(edited?): {type(e).__name__} {e}") from None
    print(f"{a.result}: {'partial' if result['partial'] else 'complete'}, completed {result['completed']}")
    print(table)
    if drawn is None:
        return 0
    print(drawn.path or f"nothing to draw (not measured: {'; '.join(drawn.left_out)})")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "run")  # `python -m bench --quick` is `python -m bench run --quick`
    p = arguments.OneLineParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    add_run_options(sub.add_parser("run", help="measure (the default sub-command; `make bench`)"))
    shown = sub.add_parser("report", help="the table and the report image of a saved result")
    shown.add_argument("result", type=Path, help="a JSON a run wrote (bench/out/bench-*.json or --json)")
    shown.add_argument("--out", type=Path, help="where the PNG goes (default: beside the JSON)")
    shown.add_argument("--no-image", action="store_true", help="only the table")
    second = sub.add_parser("prebuild", help="internal: a run's second process")
    second.add_argument("sections")
    second.add_argument("started", type=float)
    second.add_argument("argv", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.command == "prebuild":
        Prebuild.serve(a.sections.split(","), parse_args(a.argv), {s.name: s.module for s in SECTIONS}, a.started)
        return 0
    if a.command == "report":
        try:
            return report_command(a)
        except ReportError as e:
            return arguments.refused("python -m bench report", e)
    run(argv[1:])
    return 0
