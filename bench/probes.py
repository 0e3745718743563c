"""The functions :func:`bench.harness.run_probe` runs in a fresh process (JSON arguments in, figures out). The top
imports only the standard library: each probe imports what it measures, and the start-up probes time those imports."""

from __future__ import annotations

import os
import sys
import time

HEAVY = ("torch._dynamo", "torch._inductor", "transformers")  # what a process that only drafts need not import


def _since_spawn(args: dict) -> float:
    return time.time() - float(args["spawned_at"])


def _heavy() -> list[str]:
    return [m for m in HEAVY if m in sys.modules]


def _times() -> dict[str, float]:
    from torch._dynamo.utils import compile_times

    headers, values = compile_times(repr="csv", aggregate=True)
    return {h: float(v) for h, v in zip(headers, values)}


def split_compile_times(times: dict[str, float]) -> dict:
    """Dynamo = ``_compile.compile_inner`` outside the backend call; backend = AOTAutograd + Inductor
    (``OutputGraph.call_user_compiler``); inductor = ``compile_fx_inner`` (0 on a cache hit)."""
    total = times.get("_compile.compile_inner", 0.0)
    backend = times.get("OutputGraph.call_user_compiler", 0.0)
    keep = ("bytecode_tracing", "compile_fx_inner", "GraphLowering.codegen", "compile_file", "async_compile.wait",
            "PyCodeCache.load_by_key_path", "AOTAutogradCache.inductor_load", "build_guards")
    return {"dynamo_total_s": total, "dynamo_s": max(0.0, total - backend), "backend_s": backend,
            "inductor_s": times.get("compile_fx_inner", 0.0), "breakdown_s": {k: times[k] for k in keep if k in times}}


def imports(args: dict) -> dict:
    """Spawn to ``import torch`` done (``torch_fresh``: the child had not imported it before, as it must not), then
    ``import inkling_compiled`` (and its runtime) on top, and the heavy modules that loaded."""
    torch_fresh = "torch" not in sys.modules
    import torch  # noqa: F401

    import_torch_s, start = _since_spawn(args), time.perf_counter()
    import inkling_compiled.runtime  # noqa: F401

    return {"import_torch_s": import_torch_s, "import_package_s": time.perf_counter() - start,
            "package_imported": _heavy(), "torch_fresh": torch_fresh}


def first_draft(args: dict) -> dict:
    """Spawn to the first draft, by phase: :func:`imports`, the MTP from its checkpoint, the drafter (``package``: that
    AOTInductor package loaded; else the default K-depth drafter, its round from the disk cache), an eager depth-0
    prefill of ``context`` rows, the draft; the heavy modules imported by then, the Dynamo graphs compiled."""
    found = imports(args)
    import torch

    from inkling_compiled import InklingMTP
    from inkling_compiled.runtime import Drafter

    import_s, start = _since_spawn(args), time.perf_counter()
    torch.set_num_threads(int(args["threads"]))
    mtp = InklingMTP.from_pretrained(args["checkpoint"], dtype=getattr(torch, args["dtype"]), device=args["device"])
    t_model = time.perf_counter()
    batch, rows, k = int(args["batch"]), int(args["context"]) + 1, int(args["k"])
    drafter = (Drafter.load_compiled(args["package"], mtp) if args.get("package") else
               Drafter(mtp, batch, int(args["max_length"]), num_speculative_tokens=k, graph_rows=(k,)))
    t_ready = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, mtp.config.logits_vocab_size, (batch, rows), generator=gen).to(mtp.device)
    positions = torch.arange(rows, device=mtp.device)[None].expand(batch, rows)
    hidden = torch.randn(batch, rows, mtp.config.hidden_size, generator=gen).to(mtp.device, mtp.dtype)
    with torch.no_grad():
        mtp(ids[:, :-1], positions[:, :-1], hidden[:, :-1], cache=drafter.cache, depth=0)
    t_prefill = time.perf_counter()
    # unchecked: the rows before it were written through the model's own forward, which the Drafter does not track
    # (a validated call is refused there as skipping ahead of what it holds)
    drafter.draft(ids[:, -1:], positions[:, -1:], hidden[:, -1:], validate=False).drafts.cpu()
    t_first = time.perf_counter()
    dynamo = sys.modules.get("torch._dynamo.utils")  # absent: nothing imported Dynamo, so nothing compiled
    return {**found, "import_s": import_s, "model_s": t_model - start,
            "ready_s": t_ready - t_model, "prefill_s": t_prefill - t_ready, "first_draft_s": t_first - t_prefill,
            "to_first_draft_s": _since_spawn(args), "packaged": bool(drafter.packaged_buckets), "imported": _heavy(),
            "dynamo_graphs": int(dynamo.counters["stats"]["unique_graphs"]) if dynamo else 0}


def heavy_text(modules: list[str]) -> str:
    return ", ".join(modules) or "none of " + ", ".join(HEAVY)


def first_draft_text(r: dict) -> str:
    """A :func:`first_draft` record (or the fresh processes' medians of it) by phase."""
    return (f"{r['to_first_draft_s']:.2f} s after the spawn: imports {r['import_s']:.2f} (torch "
            f"{r['import_torch_s']:.2f}), model {r['model_s']:.2f}, drafter {r['ready_s']:.2f}, prefill "
            f"{r['prefill_s']:.2f}, first draft {r['first_draft_s']:.2f} (round packaged: {r['packaged']}; Dynamo "
            f"graphs {r['dynamo_graphs']}; imported: {heavy_text(r['imported'])})")


def step_compile(args: dict) -> dict:
    """Cold or warm (by the cache dir the parent gives) compile of the one-token draft step: the first call split
    into Dynamo / backend, the FX graph cache counters, recompiles over ``steps`` steps at advancing positions and,
    on CUDA, the CUDA-graph capture."""
    import torch
    from torch._dynamo.utils import counters

    from inkling_compiled import passes as ic_passes

    from .harness import random_rows
    from .models import load_models  # the model builders: transformers' too
    from .step import first_step, make_drafter, make_inputs, prefill

    import_s, start = _since_spawn(args), time.perf_counter()
    torch.set_num_threads(int(args["threads"]))
    device, dtype = torch.device(args["device"]), getattr(torch, args["dtype"])
    models = load_models(args["preset"], device=device, dtype=dtype, weights=args["weights"], peer=False)
    batch, max_length, context = int(args["batch"]), int(args["max_length"]), int(args["context"])
    inputs = make_inputs(models, batch, context)
    load_s = time.perf_counter() - start
    counters.clear()
    ic_passes.reset_match_counts()
    drafter = make_drafter(models, batch, max_length, compile=True)
    first = first_step(models, drafter, inputs)[1]
    split, graphs = split_compile_times(_times()), counters["stats"]["unique_graphs"]
    cache = {k: int(v) for group in ("inductor", "aot_autograd") for k, v in counters[group].items() if "cache" in k}
    gen, steps = torch.Generator().manual_seed(1), int(args["steps"])
    for i in range(min(steps, max_length - context - 1)):
        drafter.draft(*random_rows(models.mtp, batch, context + 1 + i, 1, gen), validate=False)
    capture = None
    if device.type == "cuda":
        before = _times().get("_compile.compile_inner", 0.0)
        graphed = make_drafter(models, batch, max_length, compile=True, cuda_graphs=True)
        prefill(models, graphed, inputs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphed.capture((batch,))
        total, recompile = time.perf_counter() - t0, _times().get("_compile.compile_inner", 0.0) - before
        capture = {"first_call_s": total, "recompile_s": recompile, "capture_s": max(0.0, total - recompile)}
    return {"first_call_s": first, "import_s": import_s, "load_s": load_s, **split,
            "graphs": graphs, "recompiles": counters["stats"]["unique_graphs"] - graphs, "recompile_steps": steps,
            "cache_counters": cache, "fxgraph_cache_hit": cache.get("fxgraph_cache_hit", 0),
            "fxgraph_cache_miss": cache.get("fxgraph_cache_miss", 0), "matches": ic_passes.match_counts(),
            "cuda_graph": capture}


def k_compile(args: dict) -> dict:
    """Compile a K-depth drafter's greedy decode windows at batch 1 (wall and CPU seconds, compiler children
    included), then count recompiles over 64 rounds of 1..K+1 verified rows."""
    import torch
    from torch._dynamo.utils import counters

    from inkling_compiled import InklingMTP
    from inkling_compiled import passes as ic_passes
    from inkling_compiled.runtime import Drafter

    from .harness import random_rows

    torch.set_num_threads(int(args["threads"]))
    k = int(args["k"])
    mtp = InklingMTP.from_pretrained(args["checkpoint"])
    # the compiled round being measured, not the packaged one cached on disk (K > 1 on CPU, docs/compile.md §12.1)
    drafter = Drafter(mtp, 1, 1024, num_speculative_tokens=k, batch_buckets=(1,), cached_rounds=False)
    ic_passes.reset_match_counts()
    cpu0, wall0 = sum(os.times()[:4]), time.perf_counter()  # user + system, ours and the compilers' (children)
    drafter.capture((1,))
    wall, cpu = time.perf_counter() - wall0, sum(os.times()[:4]) - cpu0
    graphs = counters["stats"]["unique_graphs"]
    gen, start = torch.Generator().manual_seed(1), 0
    for i in range(64):
        rows = i % (k + 1) + 1
        drafter.draft(*random_rows(mtp, 1, start, rows, gen), validate=False)
        start += rows
    return {"wall_s": wall, "cpu_s": cpu, "graphs": graphs, "matches": ic_passes.match_counts(),
            "recompiles_over_64_rounds": counters["stats"]["unique_graphs"] - graphs}
