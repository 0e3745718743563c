"""The report image: one PNG of the figures drafters are compared by, drawn from a result dict alone with matplotlib
(the ``plots`` extra). A panel is drawn only where the run measured its data; the header names those left out."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from inkling_compiled.atomic_files import write_files_atomically

from .e2e import LABELS
from .harness import ms
from .step import LABELS as VARIANT_LABELS

COLUMNS = 2
PANEL_W, PANEL_H, HEADER_H = 7, 4.5, 1  # inches; chosen so that inches x DPI are whole pixels
DPI = 100

# vLLM on the full-size Inkling, gsm8k, temperature 0 (docs/protocol.md §6.8): acceptance per position (%) by the
# number of depths drafted, and mean accepted length
VLLM_ACCEPTANCE = {1: [83.39], 8: [76.17, 61.58, 51.25, 42.43, 36.40, 30.94, 27.22, 23.65]}
VLLM_MEAN_ACCEPTED_LENGTH = {1: 1.83, 8: 4.50}
VLLM_LABEL = "vLLM, full-size Inkling, gsm8k (published)"
VLLM_STYLE = {"color": "black", "linestyle": "--", "markerfacecolor": "none", "linewidth": 1}

VARIANT_COLORS = {"eager": "tab:gray", "compiled_nopasses": "tab:blue", "compiled": "tab:green",
                  "compiled_call": "tab:olive", "cudagraph": "tab:red", "hf_eager": "tab:orange"}
METHOD_LINES = {"ours_compiled": "ours", "ours_eager": "ours, eager drafter", "hf_mtp": LABELS["hf_mtp"]}
METHOD_STYLES = {"ours": {"color": "tab:green", "marker": "o"}, "ours, eager drafter": {"color": "tab:gray",
                 "marker": "x"}, LABELS["hf_mtp"]: {"color": "tab:orange", "marker": "D"}}
FLOORS = {  # label: (line style, the floor's ms in a latency entry, None where not measured)
    "GEMM floor (the step's GEMMs alone)": ("-", lambda e: (e["variants"].get("gemm_floor") or {}).get("median_ms")),
    "HBM floor (bytes read / copy bandwidth)": ("--", lambda e: (e.get("bandwidth") or {}).get("hbm_floor_ms"))}
STARTUP_PARTS = {"import_s": "imports", "load_s": "loading the models",
                 "first_call_s": "first draft: compile (or package load) + run"}

MISSING_HINT = ("plots: matplotlib is not installed, so no report image was drawn; install it with "
                "`pip install -e '.[plots]'` (`make bench` does), then draw this run with "
                "`python -m bench report {json}`")


class Drawn(NamedTuple):
    path: Path | None  # None: the run measured nothing a panel shows, no file was written
    panels: list[str]  # titles of the panels drawn, in order
    left_out: list[str]  # the kinds of panel this run has no data for


class Panel(NamedTuple):
    title: str
    draw: Callable  # draw(ax); the axis labels and the legend follow
    xlabel: str
    ylabel: str
    legend: dict | None = None  # ax.legend's placement


def by_method(e2e: dict | None) -> dict[str, list[dict]]:
    """The K panels' lines: the e2e section's batch-1 methods that draft (ours compiled, ours eager, transformers'),
    each by K; {} when the section did not run or failed."""
    lines: dict[str, list[dict]] = {}
    for name, m in sorted((e2e or {}).get("methods", {}).items(), key=lambda item: item[1]["k"] or 0):
        for prefix in (p for p in METHOD_LINES if name.startswith(p)):
            lines.setdefault(METHOD_LINES[prefix], []).append(m)
    return lines


def _whiskers(stats: list[dict]) -> tuple[list[float], list[list[float]]]:
    """Medians and their p10 / p90 distances (matplotlib's asymmetric ``yerr``) of ``harness.Stats`` dicts."""
    med = [s["median_ms"] for s in stats]
    return med, [[m - s["p10_ms"] for m, s in zip(med, stats)], [s["p90_ms"] - m for m, s in zip(med, stats)]]


def _stat_bars(ax, xs: list[float], stats: list[dict], width: float, **kw) -> list[float]:
    """Bars at the medians with p10-p90 whiskers, each labelled with its median; returns every value drawn."""
    med, err = _whiskers(stats)
    ax.bar(xs, med, width, yerr=err, capsize=2, error_kw={"linewidth": 0.8}, **kw)
    for x, m, s in zip(xs, med, stats):  # above the whisker, where nothing else is drawn
        ax.annotate(ms(m), (x, s["p90_ms"]), xytext=(0, 2), textcoords="offset points", ha="center",
                    va="bottom", rotation=90, fontsize=6)
    return [*med, *(s[k] for s in stats for k in ("p10_ms", "p90_ms"))]


def _scale(ax, values: list[float]) -> None:
    """Log scale where the values span more than 30x (eager vs compiled on CPU), with room for the labels."""
    lo, hi = min(values), max(values)
    if lo > 0 and hi / lo > 30:
        ax.set_yscale("log")
        ax.set_ylim(lo / 2, hi * 40)
    else:
        ax.set_ylim(0, hi * 1.6)


def _latency_panel(name: str, cfg: dict, settings: dict) -> Panel:
    entries = sorted(cfg["latency"]["batches"].values(), key=lambda e: e["batch"])
    variants = [v for v in VARIANT_LABELS if v != "gemm_floor" and any(v in e["variants"] for e in entries)]
    m = cfg["model"]
    shape = f"H {m['hidden_size']}, V {m['vocab_size']}" if m else "models not described"

    def draw(ax):
        width, values = 0.8 / len(variants), []
        for i, v in enumerate(variants):
            at = [(j, e["variants"][v]) for j, e in enumerate(entries) if v in e["variants"]]
            values += _stat_bars(ax, [j - 0.4 + (i + 0.5) * width for j, _ in at], [s for _, s in at], width,
                                 color=VARIANT_COLORS[v], label=VARIANT_LABELS[v].strip())
        for label, (style, floor) in FLOORS.items():
            at = [(j, floor(e)) for j, e in enumerate(entries) if floor(e) is not None]
            for n, (j, y) in enumerate(at):  # one segment over each batch's bars, one legend entry
                ax.hlines(y, j - 0.45, j + 0.45, colors="black", linestyles=style, linewidth=1.2,
                          label=None if n else label)
                ax.annotate(ms(y), (j + 0.45, y), xytext=(2, 0), textcoords="offset points", va="center", fontsize=6)
            values += [y for _, y in at]
        _scale(ax, values)
        ax.set_xticks(range(len(entries)), [f"batch {e['batch']}, context {e['context']}" for e in entries])

    return Panel(f"{name}: one-token draft step ({shape}, {settings['device']} {settings['dtype']})", draw, "",
                 "ms per step (median, p10-p90)", {"loc": "upper left", "ncol": 3})


def _acceptance_panel(lines: dict[str, list[dict]]) -> Panel:
    def draw(ax):
        for method, runs in lines.items():
            for m in runs:
                ax.plot(range(1, m["k"] + 1), [100 * a for a in m["acceptance_per_position"]],
                        label=f"{method}, K = {m['k']}", **METHOD_STYLES[method])
        for k, curve in VLLM_ACCEPTANCE.items():
            ax.plot(range(1, k + 1), curve, marker="s" if k > 1 else "*", **VLLM_STYLE,
                    label=f"{VLLM_LABEL}, {k} depth{'s' * (k > 1)}")
        ax.set_ylim(0, 100)
        ax.set_xticks(range(1, 1 + max(max(VLLM_ACCEPTANCE), *(m["k"] for runs in lines.values() for m in runs))))

    return Panel("acceptance per draft position (e2e, batch 1)", draw, "draft position j",
                 "rounds with drafts 1..j all accepted (%)")


def _against_k_panel(e2e: dict, lines: dict[str, list[dict]]) -> Panel:
    """tokens/s relative to the target alone (solid, left axis) and mean accepted length (dashed, right axis)."""
    loop, points = e2e["methods"].get("target_loop"), [m for runs in lines.values() for m in runs]

    def draw(ax):
        length = ax.twinx()
        for method, runs in lines.items():
            for axis, key, style, what in ((ax, "speedup_vs_target", "-", "tokens/s"),
                                           (length, "accepted_length", "--", "accepted length")):
                axis.plot([m["k"] for m in runs], [m[key] for m in runs], linestyle=style, label=f"{method}: {what}",
                          **METHOD_STYLES[method])
        ax.axhline(1.0, color="black", linewidth=1, label="target alone, target.generate "
                   f"({e2e['methods']['target']['tokens_per_s']:.1f} tok/s)")
        if loop:
            ax.axhline(loop["speedup_vs_target"], color="black", linestyle=":", linewidth=1,
                       label=LABELS["target_loop"])
        ax.set_ylim(0, 1.3 * max([1.0, *(m["speedup_vs_target"] for m in [*points, *filter(None, [loop])])]))
        ks = sorted(VLLM_MEAN_ACCEPTED_LENGTH)
        length.plot(ks, [VLLM_MEAN_ACCEPTED_LENGTH[k] for k in ks], marker="s", **VLLM_STYLE, label=VLLM_LABEL)
        top = max(ks[-1], *(m["k"] for m in points))
        length.plot([1, top], [2, top + 1], color="lightgray", linestyle=":", label="upper bound K + 1")
        length.set_ylim(0, top + 1.5)
        length.tick_params(labelsize=7)
        length.set_ylabel("mean accepted length, tokens per target forward (dashed)", fontsize=8)
        length.legend(fontsize=6, loc="upper right")
        ax.set_xticks(range(1, top + 1))

    return Panel("tokens/s and accepted length against K (e2e, batch 1)", draw, "K (drafts per round)",
                 "tokens/s / the target alone's (solid)", {"loc": "upper left"})


def _draft_round_panel(rounds: dict[str, dict]) -> Panel:
    def draw(ax):
        ks = [int(k) for k in rounds]
        for key, label in (("one_row_ms", "1 new row"), ("all_rows_ms", "K + 1 new rows (all accepted)")):
            med, err = _whiskers([r[key] for r in rounds.values()])
            ax.errorbar(ks, med, yerr=err, marker="o", capsize=2, label=label)
        ax.set_xticks(ks)
        ax.set_ylim(bottom=0)

    return Panel("draft-round latency against K (batch 1, all K depths)", draw, "K (drafts per round)",
                 "ms per draft round (median, p10-p90)")


def _startup_rows(result: dict) -> list[tuple[str, dict]]:
    rows = []
    for name, cfg in result["configs"].items():
        comp = cfg.get("compile") or {}
        if comp.get("cold"):
            rows.append((f"{name}: cold compile", comp["cold"]))
        if comp.get("warm"):
            rows.append((f"{name}: FX-cache " + ("hit" if comp["warm_cache_hit"] else "MISSED"), comp["warm"]))
        probe = ((cfg.get("packaged") or {}).get("startup") or {}).get("package")
        if probe:  # bench.probes.first_draft in the parts of a compile probe
            rows.append((f"{name}: packaged (AOTInductor)",
                         {"import_s": probe["import_s"], "load_s": probe["model_s"],
                          "first_call_s": probe["ready_s"] + probe["prefill_s"] + probe["first_draft_s"]}))
    return rows


def _startup_panel(rows: list[tuple[str, dict]]) -> Panel:
    def draw(ax):
        ys, left = range(len(rows)), [0.0] * len(rows)
        for key, label in STARTUP_PARTS.items():
            widths = [r[key] for _, r in rows]
            ax.barh(ys, widths, left=left, height=0.6, label=label)
            left = [a + b for a, b in zip(left, widths)]
        for y, total in zip(ys, left):
            ax.text(total, y, f" {total:.1f} s", va="center", fontsize=7)
        ax.set_yticks(ys, [label for label, _ in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 1.2 * max(left))

    return Panel("start-up of the draft step (each in a fresh process)", draw,
                 "seconds from a fresh process to its first draft", "", {"loc": "lower right"})


def _quant_panel(name: str, quant: dict) -> Panel:
    schemes = quant["schemes"]

    def draw(ax):
        values = _stat_bars(ax, list(range(len(schemes))), [s["step"] for s in schemes.values()], 0.6,
                            color="tab:cyan")
        ax.hlines(quant["fp32_floor_ms"], -0.5, len(schemes) - 0.5, colors="black", linewidth=1.2,
                  label="fp32 GEMM floor")
        ax.set_xticks(range(len(schemes)), [f"{n}\n{s['step_bytes'] / 1e6:.1f} MB read" for n, s in schemes.items()],
                      fontsize=7)
        _scale(ax, [*values, quant["fp32_floor_ms"]])

    return Panel(f"{name}: weight-only quantized step (batch {quant['batch']})", draw, "",
                 "ms per step (median, p10-p90)")


def plan(result: dict) -> tuple[list[Panel], list[str]]:
    """The panels ``result`` has data for, in order, and the kinds of panel left out for want of data."""
    configs, e2e, rows = result["configs"], result.get("e2e"), _startup_rows(result)
    lines = by_method(e2e)
    kinds = {
        "step latency (latency)": [_latency_panel(n, c, result["settings"]) for n, c in configs.items()
                                   if (c.get("latency") or {}).get("batches")],
        "acceptance per position (e2e)": [_acceptance_panel(lines)] if lines else [],
        "tokens/s and accepted length against K (e2e)": [_against_k_panel(e2e, lines)] if lines else [],
        "draft-round latency against K (e2e, --full)": [_draft_round_panel(e2e["rounds"])] if lines
        and e2e.get("rounds") else [],
        "start-up (compile, packaged)": [_startup_panel(rows)] if rows else [],
        "quantized step (quant)": [_quant_panel(n, c["quant"]) for n, c in configs.items()
                                   if c.get("quant") and "error" not in c["quant"]]}
    return [p for drawn in kinds.values() for p in drawn], [kind for kind, drawn in kinds.items() if not drawn]


# ------------------------------------------------------------------------------------------------ the figure

def figure_size(panels: int) -> tuple[int, int]:
    """Pixels (width, height) of a report with ``panels`` panels."""
    return int(COLUMNS * PANEL_W * DPI), int((math.ceil(panels / COLUMNS) * PANEL_H + HEADER_H) * DPI)


def _header(result: dict, left_out: list[str]) -> str:
    m, s = result["machine"], result["settings"]
    partial = f" | PARTIAL: cut short after {', '.join(result['completed']) or 'nothing'}" if result["partial"] else ""
    lines = [f"inkling_compiled benchmark | {result['date']} | {m['cpu']} ({m['cores']} cores"
             f"{', ' + m['gpu'] if m.get('gpu') else ''}) | torch {m['torch']} | transformers {m['transformers']} | "
             f"{s['device']} {s['dtype']}, {s['threads']} thread(s){partial}", result["command"]]
    return "\n".join(lines + (["not measured in this run, left out: " + "; ".join(left_out)] if left_out else []))


def draw_report(result: dict, path: Path) -> Drawn:
    """Draw the report of ``result`` into the PNG ``path`` (written whole or not at all; no file when no panel has
    data). Raises ImportError without matplotlib."""
    panels, left_out = plan(result)
    if not panels:
        return Drawn(None, [], left_out)
    from matplotlib.figure import Figure  # the optional plots extra, imported only to draw

    width, height = figure_size(len(panels))
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    fig.suptitle(_header(result, left_out), fontsize=8, x=0.01, ha="left")
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(math.ceil(len(panels) / COLUMNS), COLUMNS, i + 1)
        panel.draw(ax)
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel(panel.xlabel, fontsize=8)
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.legend(fontsize=6, **(panel.legend or {}))
        ax.tick_params(labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    path = Path(path)
    write_files_atomically(path.parent, {path.name: lambda tmp: fig.savefig(tmp, format="png", dpi=DPI)})
    return Drawn(path, [p.title for p in panels], left_out)


def report_line(result: dict, json_path: Path) -> str:
    """The line that ends a benchmark run: where its report image is (beside its JSON), or how to get one."""
    try:
        drawn = draw_report(result, Path(json_path).with_suffix(".png"))
    except ImportError:
        return MISSING_HINT.format(json=json_path)
    if drawn.path is None:
        return "report: nothing to draw (no section of this run produced a figure)"
    return f"report: {drawn.path}"
