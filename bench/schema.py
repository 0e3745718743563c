"""The JSON that ``python -m bench.run --json OUT`` writes, documented as a checkable schema.

Top level::

    schema     "inkling-bench/1"
    command    the command line;  date  ISO-8601 UTC;  wall_s  seconds for the whole run
    partial    true in the copies written after each section (a run cut short keeps those), false at the end
    machine    {cpu, cores, gpu (name or null), torch, transformers, python, threads}
    settings   {configs [names], device, dtype, batch_sizes [ints], context, max_length, threads, quick, skip [names]}
    configs    {name: CONFIG}, one per --config
    e2e        E2E or null (skipped / not run)
    goals      [GOAL]

CONFIG::

    model      {preset, weights ("checkpoint"|"random"), hidden_size, vocab_size, logits_vocab_size, intermediate_size,
                depth0 {...}, num_depths, mtp_parameters, ...}
    compile    null | {cold PROBE, warm PROBE, warm_cache_hit bool}  (subprocesses, fresh TORCHINDUCTOR_CACHE_DIR)
    kernels    null | {no_passes KERNELS|null, passes KERNELS|null, matches_no_passes {fusion: n}, matches_passes {...}}
    latency    {"<batch>": LATENCY}

PROBE: first_call_s, dynamo_s, backend_s, inductor_s (seconds, >= 0), fxgraph_cache_hit / _miss, recompiles,
recompile_steps (ints >= 0), process_s, cuda_graph (null or {capture_s, ...}).
KERNELS: kernels, loop_nests, extern_calls, launches (ints >= 0), extern_ops [names].
LATENCY: batch, context; variants {name: STATS} with names among eager, compiled_nopasses, compiled, compiled_call
(the compiled function alone on the Drafter's static buffers, CPU), cudagraph, hf_eager, gemm_floor;
STATS = {median_ms, p10_ms, p90_ms, min_ms (> 0), n (> 0)}; ratios {speedup_vs_peer,
speedup_vs_eager, x_floor: {variant: float > 0}}; gemms [{op, mnk, weight, dtype, count}]; gemm_calls;
step_bytes {..., total} (bytes the step must read); bandwidth null (CPU) or {copy_gbps, step_bytes, hbm_floor_ms,
achieved_fraction {variant: float}}; first_call_s {variant: seconds} for the in-process compiles; errors
{variant: message} for variants that failed to build (the others are still timed).
E2E: prompts, prompt_len, new_tokens; methods {name: {tokens_per_s, ms_per_token (> 0), new_tokens, acceptance
(null or 0..1), speedup_vs_target (> 0), outputs_match_target (null or bool)}}; distill (null or distill.json).
GOAL: {id, text, target, value (null or number), unit, met (null / true / false), note}.
"""

from __future__ import annotations

SCHEMA_ID = "inkling-bench/1"
VARIANTS = ("eager", "compiled_nopasses", "compiled", "compiled_call", "cudagraph", "hf_eager", "gemm_floor")


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class _Check:
    def __init__(self):
        self.problems: list[str] = []

    def need(self, cond: bool, where: str, what: str) -> bool:
        if not cond:
            self.problems.append(f"{where}: {what}")
        return cond

    def keys(self, d, where: str, keys) -> bool:
        if not self.need(isinstance(d, dict), where, "expected an object"):
            return False
        missing = [k for k in keys if k not in d]
        return self.need(not missing, where, f"missing keys {missing}")

    def positive(self, d: dict, where: str, keys) -> None:
        for k in keys:
            self.need(_num(d.get(k)) and d[k] > 0, f"{where}.{k}", f"expected a positive number, got {d.get(k)!r}")

    def nonneg(self, d: dict, where: str, keys) -> None:
        for k in keys:
            self.need(_num(d.get(k)) and d[k] >= 0, f"{where}.{k}", f"expected a number >= 0, got {d.get(k)!r}")


def validate(result: dict) -> list[str]:
    """Problems found in a bench result (empty list: it matches the schema above)."""
    c = _Check()
    if not c.keys(result, "$", ("schema", "command", "date", "wall_s", "machine", "settings", "configs", "e2e",
                                 "goals")):
        return c.problems
    c.need(result["schema"] == SCHEMA_ID, "$.schema", f"expected {SCHEMA_ID!r}")
    c.positive(result, "$", ("wall_s",))
    if c.keys(result["machine"], "$.machine", ("cpu", "cores", "gpu", "torch", "transformers", "python", "threads")):
        c.positive(result["machine"], "$.machine", ("cores", "threads"))
    s = result["settings"]
    if c.keys(s, "$.settings", ("configs", "device", "dtype", "batch_sizes", "context", "max_length", "threads",
                                "quick", "skip")):
        c.need(all(isinstance(b, int) and b > 0 for b in s["batch_sizes"]), "$.settings.batch_sizes",
               "expected positive ints")
        c.positive(s, "$.settings", ("context", "max_length"))
    c.need(isinstance(result["configs"], dict) and result["configs"], "$.configs", "expected at least one config")
    for name, cfg in (result["configs"] or {}).items():
        _config(c, cfg, f"$.configs.{name}")
    if result["e2e"] is not None:
        _e2e(c, result["e2e"], "$.e2e")
    c.need(isinstance(result["goals"], list) and result["goals"], "$.goals", "expected a non-empty list")
    for i, g in enumerate(result["goals"] or []):
        if c.keys(g, f"$.goals[{i}]", ("id", "text", "target", "value", "unit", "met", "note")):
            c.need(g["met"] in (None, True, False), f"$.goals[{i}].met", "expected null or a bool")
            c.need(g["value"] is None or _num(g["value"]), f"$.goals[{i}].value", "expected null or a number")
    return c.problems


def _config(c: _Check, cfg: dict, where: str) -> None:
    if not c.keys(cfg, where, ("model", "compile", "kernels", "latency")):
        return
    if c.keys(cfg["model"], f"{where}.model", ("preset", "weights", "hidden_size", "vocab_size", "depth0")):
        c.positive(cfg["model"], f"{where}.model", ("hidden_size", "vocab_size"))
    comp = cfg["compile"]
    if comp is not None and not comp.get("error"):
        for run in ("cold", "warm"):
            p = comp.get(run)
            if c.keys(p, f"{where}.compile.{run}", ("first_call_s", "dynamo_s", "backend_s", "inductor_s",
                                                    "fxgraph_cache_hit", "fxgraph_cache_miss", "recompiles",
                                                    "process_s")):
                c.positive(p, f"{where}.compile.{run}", ("first_call_s", "process_s"))
                c.nonneg(p, f"{where}.compile.{run}", ("dynamo_s", "backend_s", "inductor_s", "fxgraph_cache_hit",
                                                       "fxgraph_cache_miss", "recompiles"))
        c.need(isinstance(comp.get("warm_cache_hit"), bool), f"{where}.compile.warm_cache_hit", "expected a bool")
    k = cfg["kernels"]
    if k is not None:
        for side in ("no_passes", "passes"):
            ks = k.get(side)
            if ks is not None and c.keys(ks, f"{where}.kernels.{side}", ("kernels", "loop_nests", "extern_calls",
                                                                          "launches", "extern_ops")):
                c.nonneg(ks, f"{where}.kernels.{side}", ("kernels", "loop_nests", "extern_calls"))
                c.positive(ks, f"{where}.kernels.{side}", ("launches",))
    c.need(isinstance(cfg["latency"], dict), f"{where}.latency", "expected an object")
    for b, lat in (cfg["latency"] or {}).items():
        w = f"{where}.latency.{b}"
        if not c.keys(lat, w, ("batch", "context", "variants", "ratios", "gemms", "step_bytes", "bandwidth")):
            continue
        c.positive(lat, w, ("batch", "context"))
        c.need(bool(lat["variants"]), f"{w}.variants", "expected at least one variant")
        for name, st in lat["variants"].items():
            c.need(name in VARIANTS, f"{w}.variants.{name}", f"unknown variant (known: {VARIANTS})")
            if c.keys(st, f"{w}.variants.{name}", ("median_ms", "p10_ms", "p90_ms", "min_ms", "n")):
                c.positive(st, f"{w}.variants.{name}", ("median_ms", "p10_ms", "p90_ms", "min_ms", "n"))
        for kind, values in (lat["ratios"] or {}).items():
            for name, x in values.items():
                c.need(_num(x) and x > 0, f"{w}.ratios.{kind}.{name}", "expected a positive number")
        if lat["gemms"] is not None:
            for i, g in enumerate(lat["gemms"]):
                if c.keys(g, f"{w}.gemms[{i}]", ("op", "mnk", "weight", "dtype", "count")):
                    c.need(all(isinstance(d, int) and d > 0 for d in g["mnk"]), f"{w}.gemms[{i}].mnk",
                           "expected positive ints")
        if c.keys(lat["step_bytes"], f"{w}.step_bytes", ("total",)):
            c.positive(lat["step_bytes"], f"{w}.step_bytes", ("total",))
        if lat["bandwidth"] is not None and c.keys(lat["bandwidth"], f"{w}.bandwidth",
                                                   ("copy_gbps", "step_bytes", "hbm_floor_ms", "achieved_fraction")):
            c.positive(lat["bandwidth"], f"{w}.bandwidth", ("copy_gbps", "step_bytes", "hbm_floor_ms"))


def _e2e(c: _Check, e2e: dict, where: str) -> None:
    if e2e.get("error"):
        return
    if not c.keys(e2e, where, ("prompts", "prompt_len", "new_tokens", "methods", "distill")):
        return
    c.positive(e2e, where, ("prompts", "prompt_len", "new_tokens"))
    c.need("target" in e2e["methods"], f"{where}.methods", "expected the 'target' baseline")
    for name, m in e2e["methods"].items():
        w = f"{where}.methods.{name}"
        if c.keys(m, w, ("tokens_per_s", "ms_per_token", "new_tokens", "acceptance", "speedup_vs_target",
                         "outputs_match_target")):
            c.positive(m, w, ("tokens_per_s", "ms_per_token", "new_tokens", "speedup_vs_target"))
            a = m["acceptance"]
            c.need(a is None or (_num(a) and 0 <= a <= 1), f"{w}.acceptance", "expected null or a number in [0, 1]")
            c.need(m["outputs_match_target"] in (None, True, False), f"{w}.outputs_match_target",
                   "expected null or a bool")
