"""The report image: one PNG of the figures drafters are compared by, drawn from a result dict alone with matplotlib
(the ``plots`` extra). A panel is drawn only where the run measured its data; the header names those left out. The
K panels read the ``depths`` section when the run has one, else the ``e2e`` section."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .e2e import LABELS as E2E_LABELS
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
OURS = "ours"
METHOD_STYLES = {OURS: {"color": "tab:green", "marker": "o"}, E2E_LABELS["ours_eager"]: {"color": "tab:gray",
                 "marker": "x"}, E2E_LABELS["hf_mtp"]: {"color": "tab:orange", "marker": "D"}}
STARTUP_PARTS = {"import_s": "imports", "load_s": "loading the models",
                 "first_call_s": "first draft: compile (or package load) + run"}

MISSING_HINT = ("plots: matplotlib is not installed, so no report image was drawn; install it with "
                "`pip install -e '.[plots]'` (`make bench` does), then draw this run with "
                "`python -m bench report {json}`")


@dataclass(frozen=True)
class Drawn:
    path: Path | None  # None: the run measured nothing a panel shows, no file was written
    panels: list[str]  # titles of the panels drawn, in order
    left_out: list[str]  # the kinds of panel this run has no data for


@dataclass(frozen=True)
class Panel:
    title: str
    draw: Callable  # draw(ax)


# ------------------------------------------------------------------------------------------------ the K sweep

@dataclass(frozen=True)
class SweepPoint:
    """One method at one K (drafts per round), end to end."""

    method: str
    k: int
    speedup_vs_target: float
    mean_accepted_length: float | None
    acceptance_per_position: list[float] | None  # fractions; None where only the total was counted


@dataclass(frozen=True)
class Sweep:
    points: list[SweepPoint]
    target_tokens_per_s: float
    baselines: dict[str, float]  # other ways of running the target alone: label -> tokens/s over target.generate's
    draft_round_ms: dict[int, list[tuple[int, dict]]]  # batch -> [(K, harness.Stats as a dict)], by K
    source: str  # "K sweep" or "e2e section": where the figures come from, for the panel titles

    def by_method(self) -> dict[str, list[SweepPoint]]:
        out: dict[str, list[SweepPoint]] = {}
        for p in sorted(self.points, key=lambda p: p.k):
            out.setdefault(p.method, []).append(p)
        return out


def sweep(result: dict) -> Sweep | None:
    """The K panels' data: the ``depths`` section if the run has one, else the ``e2e`` section; None if neither
    produced figures."""
    depths, e2e = result.get("depths"), result.get("e2e")
    if depths and "error" not in depths:
        ours = sorted(depths["ours"].values(), key=lambda p: p["k"])
        runs = [(OURS, p) for p in ours] + ([(E2E_LABELS["hf_mtp"], depths["hf_mtp"])] if depths["hf_mtp"] else [])
        rounds: dict[int, list[tuple[int, dict]]] = {}
        for p in ours:
            for batch, stats in p["draft_round_ms"].items():
                rounds.setdefault(int(batch), []).append((p["k"], stats))
        return Sweep([SweepPoint(method, p["k"], p["speedup_vs_target"], p["mean_accepted_length"],
                                 p["acceptance_per_position"]) for method, p in runs],
                     depths["target_tokens_per_s"], {}, dict(sorted(rounds.items())), "K sweep")
    if not e2e or "error" in e2e:
        return None
    methods, points = e2e["methods"], []
    for name, m in methods.items():
        if name.startswith("ours"):  # K = 1's acceptance per position is accepted / drafted; other Ks count a total
            per_position = [m["acceptance"]] if m["k"] == 1 and m["acceptance"] is not None else None
            method = E2E_LABELS["ours_eager"] if name == "ours_eager" else OURS
            points.append(SweepPoint(method, m["k"], m["speedup_vs_target"], m["tokens_per_round"], per_position))
    if "hf_mtp" in methods:
        m = methods["hf_mtp"]
        points.append(SweepPoint(E2E_LABELS["hf_mtp"], e2e["hf_mtp_depths"], m["speedup_vs_target"],
                                 m["tokens_per_round"], None))
    loop = methods.get("target_loop")
    baselines = {E2E_LABELS["target_loop"]: loop["speedup_vs_target"]} if loop else {}
    return Sweep(points, methods["target"]["tokens_per_s"], baselines, {}, "e2e section")


# ------------------------------------------------------------------------------------------------ panels

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
        floors = {"GEMM floor (the step's GEMMs alone)": ("-", [(e["variants"].get("gemm_floor") or {}).get(
                      "median_ms") for e in entries]),
                  "HBM floor (bytes read / copy bandwidth)": ("--", [(e.get("bandwidth") or {}).get(
                      "hbm_floor_ms") for e in entries])}
        for label, (style, ys) in floors.items():
            at = [(j, y) for j, y in enumerate(ys) if y is not None]
            for n, (j, y) in enumerate(at):  # one segment over each batch's bars, one legend entry
                ax.hlines(y, j - 0.45, j + 0.45, colors="black", linestyles=style, linewidth=1.2,
                          label=None if n else label)
                ax.annotate(ms(y), (j + 0.45, y), xytext=(2, 0), textcoords="offset points", va="center", fontsize=6)
            values += [y for _, y in at]
        _scale(ax, values)
        ax.set_xticks(range(len(entries)), [f"batch {e['batch']}, context {e['context']}" for e in entries])
        ax.set_ylabel("ms per step (median, p10-p90)")
        ax.legend(fontsize=6, loc="upper left", ncol=3)

    return Panel(f"{name}: one-token draft step ({shape}, {settings['device']} {settings['dtype']})", draw)


def _acceptance_panel(sw: Sweep) -> Panel:
    def draw(ax):
        for p in sw.points:
            if p.acceptance_per_position:
                ax.plot(range(1, p.k + 1), [100 * a for a in p.acceptance_per_position], label=f"{p.method}, K = "
                        f"{p.k}", **METHOD_STYLES.get(p.method, {}))
        for k, curve in VLLM_ACCEPTANCE.items():
            ax.plot(range(1, k + 1), curve, marker="s" if k > 1 else "*", **VLLM_STYLE,
                    label=f"{VLLM_LABEL}, {k} depth{'s' * (k > 1)}")
        ax.set_ylim(0, 100)
        ax.set_xticks(range(1, 1 + max(max(VLLM_ACCEPTANCE), *(p.k for p in sw.points))))
        ax.set_xlabel("draft position j")
        ax.set_ylabel("rounds with drafts 1..j all accepted (%)")
        ax.legend(fontsize=6)

    return Panel(f"acceptance per draft position ({sw.source})", draw)


def _against_k_panel(sw: Sweep) -> Panel:
    """tokens/s relative to the target alone (solid, left axis) and mean accepted length (dashed, right axis)."""
    def draw(ax):
        for method, pts in sw.by_method().items():
            ax.plot([p.k for p in pts], [p.speedup_vs_target for p in pts], label=f"{method}: tokens/s",
                    **METHOD_STYLES.get(method, {}))
        ax.axhline(1.0, color="black", linewidth=1,
                   label=f"target alone, target.generate ({sw.target_tokens_per_s:.1f} tok/s)")
        for label, x in sw.baselines.items():
            ax.axhline(x, color="black", linestyle=":", linewidth=1, label=label)
        ax.set_ylim(0, 1.3 * max([1.0, *sw.baselines.values(), *(p.speedup_vs_target for p in sw.points)]))
        ax.set_xlabel("K (drafts per round)")
        ax.set_ylabel("tokens/s / the target alone's (solid)")
        ax.legend(fontsize=6, loc="upper left")
        length = ax.twinx()
        for method, pts in sw.by_method().items():
            pts = [p for p in pts if p.mean_accepted_length is not None]
            length.plot([p.k for p in pts], [p.mean_accepted_length for p in pts], linestyle="--",
                        label=f"{method}: accepted length", **METHOD_STYLES.get(method, {}))
        ks = sorted(VLLM_MEAN_ACCEPTED_LENGTH)
        length.plot(ks, [VLLM_MEAN_ACCEPTED_LENGTH[k] for k in ks], marker="s", **VLLM_STYLE, label=VLLM_LABEL)
        top = max(ks[-1], *(p.k for p in sw.points))
        length.plot([1, top], [2, top + 1], color="lightgray", linestyle=":", label="upper bound K + 1")
        length.set_ylim(0, top + 1.5)
        length.tick_params(labelsize=7)
        length.set_ylabel("mean accepted length, tokens per target forward (dashed)", fontsize=8)
        length.legend(fontsize=6, loc="upper right")
        ax.set_xticks(range(1, top + 1))

    return Panel(f"tokens/s and accepted length against K ({sw.source})", draw)


def _draft_round_panel(sw: Sweep) -> Panel:
    def draw(ax):
        for batch, pts in sw.draft_round_ms.items():
            med, err = _whiskers([s for _, s in pts])
            ax.errorbar([k for k, _ in pts], med, yerr=err, marker="o", capsize=2, label=f"batch {batch}")
        ax.set_xticks(sorted({k for pts in sw.draft_round_ms.values() for k, _ in pts}))
        ax.set_xlabel("K (drafts per round)")
        ax.set_ylabel("ms per draft round (median, p10-p90)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6)

    return Panel("draft-round latency against K (compiled, all K depths)", draw)


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
        ax.set_xlabel("seconds from a fresh process to its first draft")
        ax.legend(fontsize=6, loc="lower right")

    return Panel("start-up of the draft step (each in a fresh process)", draw)


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
        ax.set_ylabel("ms per step (median, p10-p90)")
        ax.legend(fontsize=6)

    return Panel(f"{name}: weight-only quantized step (batch {quant['batch']})", draw)


def plan(result: dict) -> tuple[list[Panel], list[str]]:
    """The panels ``result`` has data for, in order, and the kinds of panel left out for want of data."""
    configs, sw, rows = result["configs"], sweep(result), _startup_rows(result)
    kinds = {
        "step latency (latency)": [_latency_panel(n, c, result["settings"]) for n, c in configs.items()
                                   if (c.get("latency") or {}).get("batches")],
        "acceptance per position (e2e or depths)": [_acceptance_panel(sw)] if sw and any(
            p.acceptance_per_position for p in sw.points) else [],
        "tokens/s and accepted length against K (e2e or depths)": [_against_k_panel(sw)] if sw else [],
        "draft-round latency against K (depths)": [_draft_round_panel(sw)] if sw and sw.draft_round_ms else [],
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
        ax.tick_params(labelsize=7)
        ax.xaxis.label.set_fontsize(8)
        ax.yaxis.label.set_fontsize(8)
        ax.grid(axis="y", alpha=0.3)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, format="png", dpi=DPI)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
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
