"""The ``latency`` section: the one-token draft step (docs/protocol.md §6.4) every way it runs, timed side by side."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple
from unittest import mock

import torch
from torch._inductor.graph import GraphLowering
from transformers.cache_utils import MtpCache

from inkling_compiled import passes as ic_passes
from inkling_compiled.model import torchao_schemes
from inkling_compiled.runtime import Drafter
from inkling_compiled.testing.kernel_stats import kernel_stats

from .floor import GemmFloor, record_gemms
from .harness import Context, Stats, error_text, fmt, ms, progress, random_rows, ratios, table, time_variants
from .models import Models

LABELS = {"eager": "ours eager", "compiled_nopasses": "ours compiled (stock Inductor)",
          "compiled": "ours compiled (+ our passes)", "compiled_call": "  same, compiled graph call only",
          "cudagraph": "ours compiled + CUDA graph", "hf_eager": "transformers MtpModel (eager)",
          "gemm_floor": "GEMM floor (the step's GEMMs alone)"}


class StepInputs(NamedTuple):
    """Draft-step rows as (ids, positions, hidden), [B, P] / [B, P] / [B, P, H]; row t carries token x_{t+1}."""

    context: tuple  # the P rows prefilled, positions 0..P-1
    new: tuple  # the one new row the step drafts from, position P


def make_inputs(models: Models, batch: int, context: int) -> StepInputs:
    """``context`` rows to prefill and one new row: the step's cost does not depend on their values."""
    rows = random_rows(models.mtp, batch, 0, context + 1, torch.Generator().manual_seed(0))
    return StepInputs(tuple(t[:, :context] for t in rows), tuple(t[:, context:] for t in rows))


@contextlib.contextmanager
def generated_code():
    """The wrapper source of every graph Inductor compiles inside the block (``run_and_get_code`` without its
    ``torch._dynamo.reset()``, which would drop the other variants' compiled steps)."""
    sources: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", lambda code: sources.append(code)):
        yield sources


def compile_options(passes: bool, fresh: bool) -> dict:
    """Our pass manager or nothing in the post-grad slot; ``fresh``: FX graph cache off so the passes really run.
    Distinct options objects also give each variant its own Dynamo cache entry."""
    return {"options": {"post_grad_custom_post_pass": ic_passes.pass_manager() if passes else None,
                        **({"fx_graph_cache": False} if fresh else {})}}


def make_drafter(models: Models, batch: int, max_length: int, *, compile: bool, passes: bool = True,
                 cuda_graphs: bool = False, fresh: bool = False) -> Drafter:
    return Drafter(models.mtp, batch, max_length, compile=compile, cuda_graphs=cuda_graphs, graph_rows=(1,),
                   compile_options=compile_options(passes, fresh) if compile else None, num_speculative_tokens=1)


def prefill(models: Models, drafter: Drafter, inputs: StepInputs):
    """Eager depth-0 prefill into the drafter's cache (no compile of the prefill shape); returns the drafter's step."""
    with torch.no_grad():
        models.mtp(*inputs.context, cache=drafter.cache, depth=0)
    return lambda: drafter.draft(*inputs.new, validate=False).tokens


def first_step(models: Models, drafter: Drafter, inputs: StepInputs) -> tuple[Callable, float]:
    """``drafter`` prefilled: its step and the seconds of the step's first call (a compile included), synchronized."""
    step = prefill(models, drafter, inputs)
    start = time.perf_counter()
    step()
    if models.device.type == "cuda":
        torch.cuda.synchronize(models.device)
    return step, time.perf_counter() - start


class HFStep:
    """transformers' own draft step as its ``MTPCandidateGenerator`` drives it: ``forward_layer(0)`` +
    ``_project_to_logits`` + argmax over an ``MtpCache``. Each call first puts the depth-0 cache layer back to its
    state right after the prefill (a shallow copy of its attributes: microseconds), so the context stays fixed."""

    def __init__(self, models: Models, inputs: StepInputs):
        self.mtp, self.new = models.hf_mtp, inputs.new
        self.cache = MtpCache(config=models.target.config.get_mtp_config())
        self.cache.activate_past_recording()
        with torch.no_grad():
            self.forward(*inputs.context)
        self.layer = self.cache.layers[0]
        self.snapshot = dict(self.layer.__dict__)

    def __call__(self):
        self.layer.__dict__.update({k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
                                    for k, v in self.snapshot.items()})
        return self.mtp._project_to_logits(self.forward(*self.new)[:, -1:]).argmax(-1)

    def forward(self, ids, positions, hidden):
        return self.mtp.forward_layer(0, hidden, positions + 1, self.cache, input_ids=ids)


def step_bytes(models: Models, batch: int, context: int) -> dict:
    """Bytes one depth-0 step must read at least: depth-0 weights, the real LM-head rows (an int8 head's where
    quantized), embedding rows and embed_norm, the visible K/V, the short-conv taps (writes not counted)."""
    c, mtp = models.config, models.mtp
    g, item = c.depths[0], models.dtype.itemsize
    layer = sum(torchao_schemes.nbytes(p) for p in mtp.layers[0].parameters())
    head = c.logits_vocab_size * c.hidden_size * item if mtp.quantized_head is None else mtp.quantized_head.nbytes
    embed = batch * c.hidden_size * item + (c.hidden_size * item if mtp.embed_norm_weight is not None else 0)
    visible = context + 1 if g.window is None else min(context + 1, g.window)
    kv = 2 * batch * visible * g.num_kv_heads * g.head_dim * item
    conv = batch * (c.conv_kernel_size - 1) * (2 * g.num_kv_heads * g.head_dim + 2 * c.hidden_size) * item
    return {"weights": layer, "lm_head": head, "embedding": embed, "kv_cache": kv, "conv_state": conv,
            "total": layer + head + embed + kv + conv}


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), median of CUDA-event timings."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = time_variants({"copy": lambda: dst.copy_(src)}, device=device, budget_s=0.5)["copy"].median_ms / 1e3
    return 2 * nbytes / seconds


def gemm_floor(models: Models, inputs: StepInputs, max_length: int) -> GemmFloor:
    """The eager step's GEMMs (on a drafter of its own) recorded and replayed alone."""
    step = prefill(models, make_drafter(models, inputs.new[0].shape[0], max_length, compile=False), inputs)
    return GemmFloor(record_gemms(step, models.mtp.parameters())[0], models.device)


# ------------------------------------------------------------------------------------------------ the section

@dataclass
class StepLatency:
    """One batch size: every variant's :class:`Stats` and the ratios between them."""

    batch: int
    context: int
    variants: dict[str, Stats] = field(default_factory=dict)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    gemms: list[dict] | None = None
    gemm_calls: int | None = None
    step_bytes: dict | None = None
    bandwidth: dict | None = None
    first_call_s: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class Latency:
    batches: dict[str, StepLatency] = field(default_factory=dict)
    kernels: dict | None = None  # generated code stock vs with passes (the first batch size, --full)


def measure(ctx: Context) -> Latency:
    s, models = ctx.settings, ctx.models()
    copy_bw = copy_bandwidth(models.device) if models.device.type == "cuda" else None
    record = Latency()
    for i, batch in enumerate(s.batch_sizes):
        kernels = {} if i == 0 and s.runs("kernels") and s.runs("compiled") else None
        record.batches[str(batch)] = StepLatency(batch, s.context)
        _batch(ctx, models, record, record.batches[str(batch)], copy_bw, kernels)
        record.kernels = record.kernels or kernels
        ctx.publish(record)
    return record


def _batch(ctx: Context, models: Models, record: Latency, entry: StepLatency, copy_bw: float | None,
           kernels: dict | None) -> None:
    """The variants without CUDA graphs timed and published first; then the CUDA-graph variant, when it builds,
    timed again with all the others, so one entry's figures always come from one interleaved run."""
    s, tag = ctx.settings, f"{models.preset} b{entry.batch}"
    inputs = make_inputs(models, entry.batch, s.context)
    variants = {"eager": prefill(models, make_drafter(models, entry.batch, s.max_length, compile=False), inputs)}

    def attempt(name, build):
        """``build()`` kept as the variant ``name``, or None with its error recorded."""
        try:
            variants[name] = build()
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
            progress(f"{tag}: {name} FAILED: {type(e).__name__}: {e}")
            entry.errors[name] = error_text(e)
        return variants.get(name)

    def compiled(name, passes, graphs=False):
        """The compiled drafter's step after its first call; with ``kernels``, the generated code's (its wrappers',
        docs/compile.md §6) and our passes' matches kept there; on CPU ``compiled``'s graph call alone too."""
        progress(f"{tag}: compiling {name}")
        drafter = make_drafter(models, entry.batch, s.max_length, compile=True, passes=passes, cuda_graphs=graphs,
                               fresh=kernels is not None)
        before = ic_passes.match_counts()
        with generated_code() as code:
            step, entry.first_call_s[name] = first_step(models, drafter, inputs)
        if kernels is not None and not graphs:
            after, side = ic_passes.match_counts(), "passes" if passes else "no_passes"
            kernels[side] = {**kernel_stats(code).to_dict(), "graphs": len(code)}
            kernels[f"matches_{side}"] = {k: after[k] - before.get(k, 0) for k in after}
        if name == "compiled" and models.device.type == "cpu":
            variants["compiled_call"] = drafter.static_step(*inputs.new[1].shape)
        return step

    if s.runs("compiled"):
        if s.runs("stock"):
            attempt("compiled_nopasses", lambda: compiled("compiled_nopasses", False))
        attempt("compiled", lambda: compiled("compiled", True))
    if models.hf_mtp is not None and s.runs("peer"):
        attempt("hf_eager", lambda: HFStep(models, inputs))
    if s.runs("floor") and attempt("gemm_floor", lambda: gemm_floor(models, inputs, s.max_length)):
        entry.gemms = variants["gemm_floor"].summary
        entry.gemm_calls = sum(g["count"] for g in entry.gemms)
    entry.step_bytes = step_bytes(models, entry.batch, s.context)
    graphs_next = models.device.type == "cuda" and s.runs("compiled") and s.runs("cudagraph")
    budget = s.time_budget / 2 if graphs_next else s.time_budget
    _time(entry, variants, models.device, budget, copy_bw, tag)
    if graphs_next:
        ctx.publish(record)
        if attempt("cudagraph", lambda: compiled("cudagraph", True, graphs=True)) is not None:
            _time(entry, variants, models.device, budget, copy_bw, tag)


def _time(entry: StepLatency, variants: dict, device: torch.device, budget: float, copy_bw: float | None,
          tag: str) -> None:
    progress(f"{tag}: timing {', '.join(variants)} ({budget:.0f} s)")
    entry.variants = time_variants(variants, device=device, budget_s=budget)
    med = {k: st.median_ms for k, st in entry.variants.items()}
    timed = [k for k in med if k != "gemm_floor"]
    entry.ratios = {"speedup_vs_peer": ratios(med, {k: ("hf_eager", k) for k in timed}),
                    "speedup_vs_eager": ratios(med, {k: ("eager", k) for k in timed}),
                    "x_floor": ratios(med, {k: (k, "gemm_floor") for k in timed})}
    if copy_bw is not None:
        ours, floor_ms = [k for k in timed if k != "hf_eager"], entry.step_bytes["total"] / copy_bw * 1e3
        entry.bandwidth = {"copy_gbps": copy_bw / 1e9, "step_bytes": entry.step_bytes["total"],
                           "hbm_floor_ms": floor_ms, "achieved_fraction": {k: floor_ms / med[k] for k in ours},
                           "x_hbm_floor": {k: med[k] / floor_ms for k in ours}}


def lines(latency: dict) -> list[str]:
    out = _kernel_lines(latency["kernels"]) if latency.get("kernels") else []
    for lat in latency["batches"].values():
        out += ["", *_latency_lines(lat)]
    return out


def _latency_lines(lat: dict) -> list[str]:
    v, r, bw = lat["variants"], lat["ratios"], lat.get("bandwidth")
    rows = [[f"latency, batch {lat['batch']} (ms)", "median", "p10-p90", "vs peer", "vs eager", "x floor"]
            + (["HBM frac"] if bw else [])]
    rows += [[label + (f" [{lat['gemm_calls']} GEMMs]" if name == "gemm_floor" else ""), ms(v[name]["median_ms"]),
              f"{ms(v[name]['p10_ms'])}-{ms(v[name]['p90_ms'])}",
              *(fmt(r.get(key, {}).get(name), ".2f", "x") for key in ("speedup_vs_peer", "speedup_vs_eager",
                                                                      "x_floor")),
              *([fmt(bw["achieved_fraction"].get(name), ".0%")] if bw else [])] for name, label in LABELS.items()
             if name in v]
    return [*table(rows), "  vs peer / vs eager: times faster than transformers' step / our eager step; x floor: "
            "times the GEMM-only floor",
            *(["  'graph call only' = the compiled function on the Drafter's static buffers, without Drafter.draft's "
               "copies / clones"] if "compiled_call" in v else []),
            *(f"  {name}: FAILED: {msg}" for name, msg in lat["errors"].items()),
            *([f"  step must read {bw['step_bytes'] / 1e6:.1f} MB; copy bandwidth {bw['copy_gbps']:.0f} GB/s -> "
               f"HBM floor {ms(bw['hbm_floor_ms'])} ms"] if bw else [])]


def _kernel_lines(k: dict) -> list[str]:
    sides = (k.get("no_passes") or {}, k.get("passes") or {})

    def matches(side, key):
        return (", ".join(f"{n} {c}" for n, c in (k.get(key) or {}).items() if c) or "none") if side else "-"

    rows = [["generated code of the compiled step", "stock", "+ passes"]]
    rows += [[label, *(str(d.get(key, "-")) for d in sides)] for label, key in (
        ("kernels (cpp_fused_ / triton)", "kernels"), ("CPU loop nests (passes over memory)", "loop_nests"),
        ("kernel launches", "kernel_launches"), ("launches (kernels + extern)", "launches"))]
    rows += [["extern calls", *(f"{d['extern_calls']} ({', '.join(d['extern_ops'])})" if d else "-" for d in sides)],
             ["pass matches", matches(sides[0], "matches_no_passes"), matches(sides[1], "matches_passes")]]
    return table(rows)
