"""Quantized drafting figures: the one-token draft step in fp32 / bf16 / int8 weight-only, in one run.

:func:`quant_rows` loads a preset's models once per variant (``bench.models.load_models``: the seeded synthetic
checkpoint, or random weights for ``full``), compiles each variant's drafter (FX graph and autotune caches off), times
the K=1 decode step after an eager prefill (``bench.step``), and returns one row per variant with its latency as a
ratio to the fp32 step's GEMM floor (the fp32 eager step's GEMMs replayed alone, in the same run), the bytes one step
must read, and the first call's wall time (compile included):

* ``fp32``, ``bf16``: the unquantized model, default compile;
* ``int8_depths``: int8 depth linears, bf16 head; ``int8_head``: int8 depths and a draft-only int8 LM head;
* each int8 variant twice: ``default`` Inductor options and ``fast`` (the drafter's default for a quantized model,
  ``inkling_compiled.runtime.drafter.FAST_INDUCTOR_OPTIONS``: freezing + max-autotune on CPU,
  coordinate-descent tuning on CUDA);
* ``torchao_int8_head_fast``: torchao's ``Int8WeightOnlyConfig`` on the depth linears (the ``torchao`` extra) and
  our int8 head; ``torchao_float8_head_fast``: its ``Float8DynamicActivationFloat8WeightConfig`` (float8 GEMMs exist
  on sm89+ GPUs only: on CPU it is not run by default).

    python -m bench.quant [--config small] [--device cpu] [--batch 1] [--context 64] [--variants a,b] [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from inkling_compiled.runtime import Drafter
from inkling_compiled.runtime.drafter import FAST_PATH_OFF

from . import step as S
from .models import Models, load_models
from .records import Stats
from .timing import measure


def _torchao(config_name: str):
    """A ``quantize_`` scheme: a fresh instance of the named ``torchao.quantization`` config (the optional extra)."""
    def make():
        from inkling_compiled.model import torchao_schemes
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
# The benchmark's schemes (``bench.records.Quant``): each the variant a user gets by default, so the quantized ones
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


def quant_rows(preset: str = "small", *, device: str = "cpu", weights: str | None = None, batch: int = 1,
               context: int = 64, max_length: int = 256, variants: tuple[str, ...] | None = None, warmup: int = 5,
               rounds: int = 10, per_round: int = 5, budget_s: float | None = None, errors: dict | None = None,
               progress=lambda msg: None) -> list[dict]:
    """One row per variant (see module doc; ``variants`` names a subset, default the device's
    :func:`device_variants`) plus the fp32 GEMM floor row, all timed in one interleaved run. ``weights``:
    ``bench.models.load_models``'s (the preset's checkpoint, or random for full).
    With ``errors``, a variant that cannot be built (no kernel on the device, ...) is recorded there, name ->
    message, and left out instead of raising."""
    device = torch.device(device)
    variants = device_variants(device.type) if variants is None else variants
    unknown = sorted(set(variants) - {v[0] for v in VARIANTS})
    if unknown:
        raise ValueError(f"unknown variants {unknown}: choose from {[v[0] for v in VARIANTS]}")
    steps, rows = {}, {}
    fp32 = _models(preset, device, torch.float32, weights, None, False)  # the floor's GEMMs
    inputs = S.make_inputs(fp32, batch, context)
    eager = Drafter(fp32.mtp, batch, max_length, compile=False, num_speculative_tokens=1)
    S.prefill(fp32, eager, inputs)
    steps[FLOOR], _ = S.gemm_floor(fp32, eager, inputs)
    floor_bytes = _step_bytes(fp32, batch, context)
    rows[FLOOR] = {"variant": FLOOR, "dtype": "float32", "scheme": None, "quantized": None, "inductor_options": None,
                   "bytes_per_step": floor_bytes, "head_copy_bytes": 0, "first_call_s": None}
    for name, dtype, scheme, quantize_head, fast in VARIANTS:
        if name not in variants:
            continue
        progress(f"{preset} b{batch}: compiling {name}")
        try:
            steps[name], rows[name] = _variant(fp32, name, dtype, scheme, quantize_head, fast, batch, context,
                                               max_length, weights)
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
            if errors is None:
                raise
            progress(f"{preset} b{batch}: {name} FAILED: {type(e).__name__}: {e}")
            errors[name] = f"{type(e).__name__}: {e}"[:1000]
    progress(f"{preset} b{batch}: timing {', '.join(steps)}")
    stats = measure(steps, device=device, warmup=warmup, rounds=rounds, per_round=per_round, budget_s=budget_s)
    floor_ms = stats[FLOOR].median_ms
    for name, row in rows.items():
        row.update(stats[name].to_dict(), x_fp32_floor=stats[name].median_ms / floor_ms,
                   bytes_x_fp32=row["bytes_per_step"] / floor_bytes)
    return list(rows.values())


def quant_record(rows: list[dict], batch: int, errors: dict[str, str], device: str = "cpu") -> dict:
    """``bench.records.Quant`` of :func:`quant_rows`' rows (and ``errors``) for the variants of the device's
    :func:`schemes`."""
    by_variant = {row["variant"]: row for row in rows}
    named = schemes(device)
    found = {scheme: by_variant[variant] for scheme, variant in named.items() if variant in by_variant}
    return {"batch": batch, "fp32_floor_ms": by_variant[FLOOR]["median_ms"],
            "schemes": {scheme: {"step": {k: row[k] for k in Stats.__annotations__},
                                 "step_bytes": row["bytes_per_step"], "x_fp32_floor": row["x_fp32_floor"],
                                 "compile_s": row["first_call_s"]} for scheme, row in found.items()},
            "errors": {scheme: errors[variant] for scheme, variant in named.items() if variant in errors}}


def format_rows(rows: list[dict]) -> str:
    """A Markdown table of :func:`quant_rows`."""
    header = ("| Variant | Weights | Inductor options | Median ms | x fp32 GEMM floor | Bytes / step | x fp32 bytes "
              "| Head copy | First call s |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        first = f"{r['first_call_s']:.1f}" if r["first_call_s"] is not None else ""
        weights = f"{r['dtype']}" + (f", {r['scheme']} {r['quantized']}" if r["quantized"] else "")
        lines.append(f"| {r['variant']} | {weights} | {r['inductor_options'] or ''} | {r['median_ms']:.2f} | "
                     f"{r['x_fp32_floor']:.2f} | {r['bytes_per_step'] / 1e6:.1f} MB | {r['bytes_x_fp32']:.2f} | "
                     f"{r['head_copy_bytes'] / 1e6:.1f} MB | {first} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quant", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="small", help="synthetic preset (default small)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--weights", choices=("checkpoint", "random"), help="default: random for full, else checkpoint")
    parser.add_argument("--variants", help=f"comma-separated subset of {','.join(v[0] for v in VARIANTS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1)")
    parser.add_argument("--rounds", type=int, default=10, help="timing rounds, each variant per_round calls (10)")
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    variants = tuple(args.variants.split(",")) if args.variants else None

    def progress(msg: str) -> None:
        print(f"[bench.quant] {msg}", file=sys.stderr, flush=True)

    rows = quant_rows(args.config, device=args.device, weights=args.weights, batch=args.batch, context=args.context,
                      variants=variants, rounds=args.rounds, per_round=args.per_round, progress=progress)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
