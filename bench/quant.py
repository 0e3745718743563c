"""The one-token draft step in fp32 / bf16 / int8 weight-only (depths; depths + head; torchao's int8, and on CUDA
its float8, with our head), each compiled with the options a user gets, against the fp32 step's GEMM floor in one
timed run: the ``quant`` section (opt-in on tiny: ``--with quant``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from inkling_compiled.model import torchao_schemes
from inkling_compiled.runtime import Drafter
from inkling_compiled.runtime.drafter import FAST_PATH_OFF

from . import step as S
from .harness import Context, Stats, error_text, fmt, ms, progress, table, time_variants
from .models import Models, load_models


def _torchao(config_name: str):
    """A ``quantize_`` scheme: a fresh instance of the named ``torchao.quantization`` config (the optional extra)."""
    def make():
        return getattr(torchao_schemes.import_quantization(), config_name)()
    return make


# (name, dtype, quantize_ scheme (a name, a torchao config factory) or None, quantize_head, fast Inductor options)
VARIANTS = (
    ("fp32", torch.float32, None, False, False),
    ("bf16", torch.bfloat16, None, False, False),
    ("int8_depths", torch.bfloat16, "int8", False, False),
    ("int8_depths_fast", torch.bfloat16, "int8", False, True),
    ("int8_head", torch.bfloat16, "int8", True, False),
    ("int8_head_fast", torch.bfloat16, "int8", True, True),
    # torchao's int8 weight-only depth linears (fp32 scales) beside ours; the head is our int8 copy in both
    ("torchao_int8_head_fast", torch.bfloat16, _torchao("Int8WeightOnlyConfig"), True, True),
    # float8 weights and dynamically quantized float8 activations: a real GEMM kernel on sm89+ GPUs only
    ("torchao_float8_head_fast", torch.bfloat16, _torchao("Float8DynamicActivationFloat8WeightConfig"), True, True),
)
FLOOR = "fp32_gemm_floor"
# The benchmark's schemes (``Quant``): each the variant a user gets by default, so the quantized ones
# with the fast options a quantized model compiles with; ``DEVICE_SCHEMES``: those only a device has kernels for
SCHEMES = {"fp32": "fp32", "bf16": "bf16", "int8_depths": "int8_depths_fast", "int8_depths_head": "int8_head_fast",
           "torchao_int8_depths_head": "torchao_int8_head_fast"}
DEVICE_SCHEMES = {"cuda": {"torchao_float8_depths_head": "torchao_float8_head_fast"}}


def schemes(device: str) -> dict[str, str]:
    """:data:`SCHEMES` and the device's own ones (``DEVICE_SCHEMES``), benchmark scheme -> variant."""
    return {**SCHEMES, **DEVICE_SCHEMES.get(torch.device(device).type, {})}


def device_variants(device: str) -> tuple[str, ...]:
    """Every variant but those only another device has kernels for: what ``quant_rows`` runs by default."""
    elsewhere = {v for d, named in DEVICE_SCHEMES.items() if d != torch.device(device).type for v in named.values()}
    return tuple(v[0] for v in VARIANTS if v[0] not in elsewhere)


def _models(preset: str, device: torch.device, dtype: torch.dtype, weights: str | None, scheme,
            quantize_head: bool) -> Models:
    models = load_models(preset, device=device, dtype=dtype, weights=weights, peer=False)
    if scheme is not None:
        models.mtp.quantize_(scheme if isinstance(scheme, str) else scheme(), head=quantize_head)
    return models


def _step_bytes(models: Models, batch: int, context: int) -> int:
    """``bench.step.step_bytes``, with the int8 head's bytes in place of a bf16 head's."""
    parts = S.step_bytes(models, batch, context)
    head = models.mtp.quantized_head
    return parts["total"] - parts["lm_head"] + (head.nbytes if head is not None else parts["lm_head"])


def _drafter(models: Models, batch: int, max_length: int, fast: bool) -> Drafter:
    # FX graph and autotune caches off: every variant compiles and autotunes from scratch (compiled C++ kernels are
    # still cached on disk). A quantized model compiles with the fast options unless they are turned off here.
    options = {"fx_graph_cache": False, "autotune_local_cache": False}
    if models.mtp.quantization is not None and not fast:
        options.update(FAST_PATH_OFF.get(models.device.type, {}))
    return Drafter(models.mtp, batch, max_length, graph_rows=(1,), compile_options={"options": options},
                   num_speculative_tokens=1)


def _variant(fp32: Models, name: str, dtype: torch.dtype, scheme, quantize_head: bool, fast: bool, batch: int,
             context: int, max_length: int, weights: str | None):
    """One variant's step (prefilled) and its row, timed once: the first call, compile included."""
    models = fp32 if name == "fp32" else _models(fp32.preset, fp32.device, dtype, weights, scheme, quantize_head)
    inputs = S.make_inputs(models, batch, context)
    drafter = _drafter(models, batch, max_length, fast)
    S.prefill(models, drafter, inputs)
    step = S.step_fn(drafter, inputs)
    with S.generated_code() as code:
        start = time.perf_counter()
        step()
        if models.device.type == "cuda":
            torch.cuda.synchronize(models.device)
        first_call = time.perf_counter() - start
    kernels = S.kernel_summary(code)
    quantization = models.mtp.quantization
    return step, {
        "variant": name, "dtype": str(dtype).removeprefix("torch."),
        "scheme": None if quantization is None else quantization.scheme,
        "quantized": None if quantization is None else ("depths+head" if quantization.head else "depths"),
        "inductor_options": "fast" if fast else "default", "bytes_per_step": _step_bytes(models, batch, context),
        "head_copy_bytes": quantization.head_copy_bytes if quantization is not None else 0,
        "first_call_s": first_call, "kernels": kernels["kernels"], "loop_nests": kernels["loop_nests"],
        "extern_ops": kernels["extern_ops"]}


@dataclass
class Quant:
    batch: int
    fp32_floor_ms: float | None = None
    schemes: dict[str, dict] = field(default_factory=dict)  # scheme -> step Stats, bytes, x fp32 floor, compile s
    errors: dict[str, str] = field(default_factory=dict)


def quant_rows(preset: str = "small", *, device: str = "cpu", weights: str | None = None, batch: int = 1,
               context: int = 64, max_length: int = 256, variants: tuple[str, ...] | None = None,
               budget_s: float = 10.0, errors: dict | None = None) -> list[dict]:
    """One row per variant (default the device's :func:`device_variants`) plus the fp32 GEMM floor row, timed in
    one interleaved run. With ``errors``, a variant that cannot be built is recorded there and left out."""
    device = torch.device(device)
    variants = device_variants(device.type) if variants is None else variants
    unknown = sorted(set(variants) - {v[0] for v in VARIANTS})
    if unknown:
        raise ValueError(f"unknown variants {unknown}: choose from {[v[0] for v in VARIANTS]}")
    fp32 = _models(preset, device, torch.float32, weights, None, False)  # the floor's GEMMs
    inputs = S.make_inputs(fp32, batch, context)
    eager = Drafter(fp32.mtp, batch, max_length, compile=False, num_speculative_tokens=1)
    S.prefill(fp32, eager, inputs)
    steps, rows = {}, {}
    steps[FLOOR], _ = S.gemm_floor(fp32, eager, inputs)
    floor_bytes = _step_bytes(fp32, batch, context)
    rows[FLOOR] = {"variant": FLOOR, "dtype": "float32", "scheme": None, "quantized": None, "inductor_options": None,
                   "bytes_per_step": floor_bytes, "head_copy_bytes": 0, "first_call_s": None}
    for name, dtype, scheme, quantize_head, fast in (v for v in VARIANTS if v[0] in variants):
        progress(f"{preset} b{batch}: compiling {name}")
        try:
            steps[name], rows[name] = _variant(fp32, name, dtype, scheme, quantize_head, fast, batch, context,
                                               max_length, weights)
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
            if errors is None:
                raise
            progress(f"{preset} b{batch}: {name} FAILED: {type(e).__name__}: {e}")
            errors[name] = error_text(e)[:1000]
    progress(f"{preset} b{batch}: timing {', '.join(steps)}")
    stats = time_variants(steps, device=device, budget_s=budget_s)
    for name, row in rows.items():
        row.update(stats[name].__dict__, x_fp32_floor=stats[name].median_ms / stats[FLOOR].median_ms,
                   bytes_x_fp32=row["bytes_per_step"] / floor_bytes)
    return list(rows.values())


def measure(ctx: Context) -> Quant:
    """Every scheme of the device's :func:`schemes` at the first batch size."""
    s, errors = ctx.settings, {}
    named = schemes(s.device)
    rows = {row["variant"]: row for row in quant_rows(
        ctx.preset, device=s.device, weights=s.weights, batch=s.batch_sizes[0], context=s.context,
        max_length=s.max_length, variants=tuple(named.values()), budget_s=s.time_budget, errors=errors)}
    return Quant(s.batch_sizes[0], rows[FLOOR]["median_ms"],
                 {scheme: {"step": Stats(*(rows[v][k] for k in Stats.__annotations__)), "step_bytes": rows[v][
                     "bytes_per_step"], "x_fp32_floor": rows[v]["x_fp32_floor"], "compile_s": rows[v]["first_call_s"]}
                  for scheme, v in named.items() if v in rows},
                 {scheme: errors[v] for scheme, v in named.items() if v in errors})


def lines(q: dict) -> list[str]:
    rows = [[f"quantized step, batch {q['batch']} (ms)", "median", "p10-p90", "x fp32 floor", "MB read", "compile s"]]
    for name, sch in q["schemes"].items():
        st = sch["step"]
        rows.append([name, ms(st["median_ms"]), f"{ms(st['p10_ms'])}-{ms(st['p90_ms'])}",
                     f"{sch['x_fp32_floor']:.2f}x", f"{sch['step_bytes'] / 1e6:.2f}", fmt(sch["compile_s"], ".1f")])
    return table(rows) + [f"  x fp32 floor: times the fp32 step's GEMMs alone ({ms(q['fp32_floor_ms'])} ms), same "
                          "run; int8 schemes compile with the drafter's fast Inductor options"] + [
        f"  {name}: FAILED: {msg}" for name, msg in q["errors"].items()]
