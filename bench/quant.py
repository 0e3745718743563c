"""The ``quant`` section (opt-in on tiny: ``--with quant``): the one-token draft step per weight scheme, compiled with
the options a user gets (a quantized model's fast Inductor options included), against the fp32 step's GEMM floor."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inkling_compiled.model import torchao_schemes
from inkling_compiled.runtime import Drafter

from . import step as S
from .harness import Context, error_text, fmt, ms, progress, table, time_variants
from .models import Models, load_models


def _torchao(config_name: str):
    """A ``quantize_`` scheme: a fresh instance of the named ``torchao.quantization`` config (the optional extra)."""
    return lambda: getattr(torchao_schemes.import_quantization(), config_name)()


# scheme -> (dtype, quantize_ scheme (a name, a torchao config factory) or None, quantize_head)
SCHEMES = {"fp32": (torch.float32, None, False), "bf16": (torch.bfloat16, None, False),
           "int8_depths": (torch.bfloat16, "int8", False), "int8_depths_head": (torch.bfloat16, "int8", True),
           # torchao's int8 weight-only depth linears (fp32 scales) beside ours; the head is our int8 copy
           "torchao_int8_depths_head": (torch.bfloat16, _torchao("Int8WeightOnlyConfig"), True)}
# The schemes only a device has kernels for: float8 weights and dynamically quantized float8 activations need sm89+
DEVICE_SCHEMES = {"cuda": {"torchao_float8_depths_head": (
    torch.bfloat16, _torchao("Float8DynamicActivationFloat8WeightConfig"), True)}}
FLOOR = "fp32_gemm_floor"


def schemes(device: str) -> dict[str, tuple]:
    return {**SCHEMES, **DEVICE_SCHEMES.get(torch.device(device).type, {})}


def _models(preset: str, device: torch.device, dtype: torch.dtype, weights: str | None, scheme,
            quantize_head: bool) -> Models:
    models = load_models(preset, device=device, dtype=dtype, weights=weights, peer=False)
    if scheme is not None:
        models.mtp.quantize_(scheme if isinstance(scheme, str) else scheme(), head=quantize_head)
    return models


def _drafter(models: Models, batch: int, max_length: int) -> Drafter:
    # FX graph and autotune caches off: every scheme compiles and autotunes from scratch (compiled C++ kernels are
    # still cached on disk)
    options = {"fx_graph_cache": False, "autotune_local_cache": False}
    return Drafter(models.mtp, batch, max_length, graph_rows=(1,), compile_options={"options": options},
                   num_speculative_tokens=1)


@dataclass
class Quant:
    batch: int
    fp32_floor_ms: float | None = None
    schemes: dict[str, dict] = field(default_factory=dict)  # scheme -> step Stats, bytes, x fp32 floor, compile s
    errors: dict[str, str] = field(default_factory=dict)


def measure(ctx: Context) -> Quant:
    """Every scheme of the device's :func:`schemes` at the first batch size; a scheme that cannot be built is
    recorded in ``errors`` and left out."""
    s, record = ctx.settings, Quant(ctx.settings.batch_sizes[0])
    device, tag = torch.device(s.device), f"{ctx.preset} b{record.batch}"
    fp32 = _models(ctx.preset, device, torch.float32, s.weights, None, False)  # the floor's GEMMs
    steps, built = {FLOOR: S.gemm_floor(fp32, S.make_inputs(fp32, record.batch, s.context), s.max_length)}, {}
    for name, (dtype, scheme, quantize_head) in schemes(s.device).items():
        progress(f"{tag}: compiling {name}")
        try:
            models = fp32 if name == "fp32" else _models(ctx.preset, device, dtype, s.weights, scheme, quantize_head)
            inputs = S.make_inputs(models, record.batch, s.context)
            steps[name], compile_s = S.first_step(models, _drafter(models, record.batch, s.max_length), inputs)
            built[name] = {"step_bytes": S.step_bytes(models, record.batch, s.context)["total"], "compile_s": compile_s}
        except Exception as e:  # noqa: BLE001 - one scheme failing must not lose the others
            progress(f"{tag}: {name} FAILED: {type(e).__name__}: {e}")
            record.errors[name] = error_text(e)
    progress(f"{tag}: timing {', '.join(steps)}")
    stats = time_variants(steps, device=device, budget_s=s.time_budget)
    record.fp32_floor_ms = stats[FLOOR].median_ms
    record.schemes = {name: {"step": stats[name], "x_fp32_floor": stats[name].median_ms / record.fp32_floor_ms,
                             **figures} for name, figures in built.items()}
    return record


def lines(q: dict) -> list[str]:
    rows = [[f"quantized step, batch {q['batch']} (ms)", "median", "p10-p90", "x fp32 floor", "MB read", "compile s"]]
    rows += [[name, ms(sch["step"]["median_ms"]), f"{ms(sch['step']['p10_ms'])}-{ms(sch['step']['p90_ms'])}",
              f"{sch['x_fp32_floor']:.2f}x", f"{sch['step_bytes'] / 1e6:.2f}", fmt(sch["compile_s"], ".1f")]
             for name, sch in q["schemes"].items()]
    return [*table(rows), f"  x fp32 floor: times the fp32 step's GEMMs alone ({ms(q['fp32_floor_ms'])} ms), same "
            "run; int8 schemes compile with the drafter's fast Inductor options",
            *(f"  {name}: FAILED: {msg}" for name, msg in q["errors"].items())]
