"""Compile-time probe, run in a subprocess by :func:`bench.run` (``python -m bench.compile_probe ARGS_JSON``).

The parent points ``TORCHINDUCTOR_CACHE_DIR`` (and ``TRITON_CACHE_DIR``) at a fresh directory for the cold run and
reuses it for the warm run. The probe builds the models, prefills eagerly, then times the first call of the
compiled one-token draft step (Dynamo + AOT + Inductor + C++/Triton compile + one run), splits it with
``torch._dynamo.utils.compile_times()``, reads the FX graph cache counters, runs ``steps`` more steps at advancing
positions counting recompiles, and on CUDA times the CUDA-graph capture of the step. The last stdout line is
``PROBE_JSON: {...}``.
"""

from __future__ import annotations

import json
import sys
import time

PREFIX = "PROBE_JSON: "


def _times() -> dict[str, float]:
    from torch._dynamo.utils import compile_times

    headers, values = compile_times(repr="csv", aggregate=True)
    return {h: float(v) for h, v in zip(headers, values)}


def _split(times: dict[str, float]) -> dict:
    """Dynamo = everything in ``_compile.compile_inner`` outside the backend call; backend = AOTAutograd + Inductor
    (``OutputGraph.call_user_compiler``); inductor = ``compile_fx_inner`` (0 on a cache hit: the backend time is then
    mostly loading the cached module)."""
    total = times.get("_compile.compile_inner", 0.0)
    backend = times.get("OutputGraph.call_user_compiler", 0.0)
    keep = ("bytecode_tracing", "compile_fx_inner", "GraphLowering.codegen", "compile_file", "async_compile.wait",
            "PyCodeCache.load_by_key_path", "AOTAutogradCache.inductor_load", "build_guards")
    return {"dynamo_total_s": total, "dynamo_s": max(0.0, total - backend), "backend_s": backend,
            "inductor_s": times.get("compile_fx_inner", 0.0),
            "breakdown_s": {k: times[k] for k in keep if k in times}}


def probe(args: dict) -> dict:
    t_start = time.perf_counter()
    import torch
    from torch._dynamo.utils import counters

    from inkling_compiled import passes as ic_passes

    from .models import load_checkpoint_models, load_models, parse_dtype
    from .step import make_drafter, make_inputs, prefill, step_fn

    if args.get("threads"):
        torch.set_num_threads(int(args["threads"]))
    t_import = time.perf_counter() - t_start
    device, dtype = torch.device(args["device"]), parse_dtype(args["dtype"])
    if args.get("checkpoint"):
        models = load_checkpoint_models(args["checkpoint"], preset=args["preset"], device=device, dtype=dtype,
                                        peer=False)
    else:
        models = load_models(args["preset"], device=device, dtype=dtype, weights=args.get("weights"), peer=False)
    batch, context, max_length = int(args["batch"]), int(args["context"]), int(args["max_length"])
    inputs = make_inputs(models, batch, context)
    t_load = time.perf_counter() - t_start - t_import

    drafter = make_drafter(models, batch, max_length, compile=True, passes=bool(args.get("passes", True)))
    prefill(models, drafter, inputs)
    counters.clear()
    ic_passes.reset_match_counts()
    step = step_fn(drafter, inputs)
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    split = _split(_times())
    graphs_first = counters["stats"]["unique_graphs"]
    cache = {k: int(v) for k, v in counters["inductor"].items() if "cache" in k}
    cache.update({k: int(v) for k, v in counters["aot_autograd"].items() if "cache" in k})

    # recompiles: steps at advancing positions with fresh tokens (positions are tensors: no recompile expected)
    steps = int(args.get("steps", 20))
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        ids = torch.randint(3, models.config.logits_vocab_size, (batch, 1), generator=gen).to(device)
        pos = inputs.positions + 1 + i
        if int(pos.max()) >= max_length:
            break
        drafter.draft(ids, pos, inputs.hidden, validate=False)
    recompiles = counters["stats"]["unique_graphs"] - graphs_first

    capture = None
    if device.type == "cuda" and args.get("capture", True):
        before = _times().get("_compile.compile_inner", 0.0)
        graphed = make_drafter(models, batch, max_length, compile=True, passes=bool(args.get("passes", True)),
                               cuda_graphs=True)
        prefill(models, graphed, inputs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphed.capture((batch,))
        total = time.perf_counter() - t0
        recompile = _times().get("_compile.compile_inner", 0.0) - before
        capture = {"first_call_s": total, "recompile_s": recompile, "capture_s": max(0.0, total - recompile)}

    return {"first_call_s": first, "import_s": t_import, "load_s": t_load, **split, "graphs": graphs_first,
            "recompiles": recompiles, "recompile_steps": steps, "cache_counters": cache,
            "fxgraph_cache_hit": cache.get("fxgraph_cache_hit", 0),
            "fxgraph_cache_miss": cache.get("fxgraph_cache_miss", 0),
            "matches": ic_passes.match_counts(), "cuda_graph": capture,
            "probe_s": time.perf_counter() - t_start}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    result = probe(json.loads(argv[0]))
    print(PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
