"""The JSON that ``python -m bench.run`` writes, as typed records: one ``TypedDict`` per object.

The benchmark builds plain dicts (they go straight to JSON and to :mod:`bench.report`); these types say what each
one holds, and :func:`problems` checks a loaded result against them (missing, unexpected or mistyped keys), so a
change to what the benchmark writes is a change here. A result written while the run is still going has
``partial: true`` and lists what it has measured so far in ``completed``.
"""

import types
import typing
from pathlib import Path
from typing import Any, NotRequired, TypedDict, Union

SCHEMA_ID = "inkling-bench/2"


class Machine(TypedDict):
    cpu: str
    cores: int
    gpu: str | None
    torch: str
    transformers: str
    python: str
    threads: int
    platform: str
    triton: str | None


class Settings(TypedDict):
    configs: list[str]
    device: str
    dtype: str
    batch_sizes: list[int]
    context: int
    max_length: int
    threads: int
    quick: bool
    skip: list[str]
    opt_in: NotRequired[list[str]]  # the sections asked for with --with
    e2e_target: NotRequired[str]  # "text", "synthetic" or the --e2e-checkpoint directory
    ks: NotRequired[list[int]]  # the K sweep's K values
    full_sweep: NotRequired[bool]  # the sweep's batch of 4 compiled too


class Depth0(TypedDict):
    sliding: bool
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None
    rel_extent: int


class Model(TypedDict):
    preset: str
    weights: str  # "checkpoint" | "random"
    checkpoint: str
    device: str
    dtype: str
    hidden_size: int
    vocab_size: int
    logits_vocab_size: int
    intermediate_size: int
    depth0: Depth0
    num_depths: int
    mtp_parameters: int


class CudaGraphCapture(TypedDict):
    first_call_s: float
    recompile_s: float
    capture_s: float


class Probe(TypedDict):
    """One compile in a subprocess (bench.compile_probe), cold or warm."""

    first_call_s: float
    import_s: float
    load_s: float
    dynamo_total_s: float
    dynamo_s: float
    backend_s: float
    inductor_s: float
    breakdown_s: dict[str, float]
    graphs: int
    recompiles: int
    recompile_steps: int
    cache_counters: dict[str, int]
    fxgraph_cache_hit: int
    fxgraph_cache_miss: int
    matches: dict[str, int]
    cuda_graph: CudaGraphCapture | None
    probe_s: float
    process_s: float


class Compile(TypedDict):
    batch: int
    cold: Probe | None
    warm: Probe | None
    warm_cache_hit: bool | None
    error: str | None


class KernelCounts(TypedDict):
    """``KernelStats.to_dict()`` of the compiled step's wrapper(s), plus how many graphs were compiled."""

    cpp_kernels: int
    triton_kernels: int
    kernels: int
    loop_nests: int
    cpp_launches: int
    triton_launches: int
    kernel_launches: int
    extern_calls: int
    extern_ops: list[str]
    launches: int
    graphs: int


class Kernels(TypedDict):
    batch: int
    no_passes: KernelCounts | None
    passes: KernelCounts | None
    matches_no_passes: dict[str, int]
    matches_passes: dict[str, int]


class Stats(TypedDict):  # bench.timing.Stats
    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    n: int


class Ratios(TypedDict):
    speedup_vs_peer: dict[str, float]
    speedup_vs_eager: dict[str, float]
    x_floor: dict[str, float]


class GemmSummary(TypedDict):
    op: str
    mnk: list[int]
    weight: bool
    dtype: str
    count: int


class Bandwidth(TypedDict):
    copy_gbps: float
    step_bytes: int
    hbm_floor_ms: float
    achieved_fraction: dict[str, float]
    x_hbm_floor: dict[str, float]


class Latency(TypedDict):
    """Variants: eager, compiled_nopasses, compiled, compiled_call (CPU), packaged (the AOTInductor step, timed with
    the others), cudagraph (CUDA), hf_eager, gemm_floor."""

    batch: int
    context: int
    max_length: int
    variants: dict[str, Stats]
    ratios: Ratios
    gemms: list[GemmSummary] | None
    gemm_calls: int | None
    step_bytes: dict[str, int]
    bandwidth: Bandwidth | None
    first_call_s: dict[str, float]
    errors: dict[str, str]


class Failed(TypedDict):
    """A section that raised: what it raised."""

    error: str


class StartupProbe(TypedDict):
    """A fresh process up to its first draft (``bench.packaged.probe``), seconds."""

    mode: str  # "package", "cold" (empty Inductor cache) or "warm" (FX graph cache hit)
    import_s: float  # torch and inkling_compiled
    model_s: float  # from_pretrained
    ready_s: float  # the drafter: loading the package, or building the (lazily compiled) drafter
    prefill_s: float
    first_draft_s: float  # for the compiled modes: the compile
    to_first_draft_s: float  # from the spawn: the figure the start-up goal names
    process_s: float  # the whole subprocess
    fxgraph_cache_hit: int
    fxgraph_cache_miss: int
    dynamo_graphs: int
    packaged_buckets: int


class PackagedStep(TypedDict):
    seconds: float  # export + AOTInductor compile of this step
    matches: dict[str, int]  # our passes' matches while compiling it
    kernels: dict[str, Any]  # testing.kernel_stats of its generated code


class PackageBuild(TypedDict):
    save_s: float  # Drafter.save_compiled, once, ahead of time
    bytes: int
    steps: dict[str, PackagedStep]


class PackagedLatency(TypedDict):
    batch: int
    context: int
    k: int
    variants: dict[str, Stats]  # eager, compiled, packaged, *_call (the rounds alone), hf_eager, gemm_floor, ...
    same_drafts: dict[str, bool]  # every variant's drafts against the compiled drafter's


class Packaged(TypedDict):
    """The drafter's rounds packaged ahead of time with AOTInductor (issue 15; ``bench.packaged.run_packaged``)."""

    preset: str
    k: int
    batch: int
    context: int
    threads: int
    device: str
    dtype: str
    torch: str
    package: PackageBuild | None
    startup: dict[str, StartupProbe]  # by mode
    latency: PackagedLatency | None
    errors: dict[str, str]  # the parts that failed
    ratios: dict[str, float]  # bench.packaged.ratios: the figures the goals name


class QuantScheme(TypedDict):
    step: Stats  # the compiled one-token draft step
    step_bytes: int  # bytes the step must read, weights at their stored width
    x_fp32_floor: float  # step median / fp32_floor_ms
    compile_s: float | None  # first call (compile + run) with the options the scheme needs


class Quant(TypedDict):
    """Weight-only quantized drafting (issue 14), every scheme timed in one run."""

    batch: int
    fp32_floor_ms: float  # the GEMM floor of the fp32 step, same run
    # "fp32", "bf16", "int8_depths", "int8_depths_head", "torchao_int8_depths_head" (+ "torchao_float8_depths_head"
    # on CUDA): bench.quant.schemes
    schemes: dict[str, QuantScheme]
    errors: dict[str, str]  # the schemes that failed (unavailable on the device, ...)


class Config(TypedDict):
    model: Model | None  # None: the models could not be built (see error)
    compile: Compile | None
    kernels: Kernels | None
    latency: dict[str, Latency]  # by batch size
    packaged: NotRequired[Packaged | None]
    quant: NotRequired[Quant | Failed | None]
    error: NotRequired[str]


class Method(TypedDict):
    tokens_per_s: float
    ms_per_token: float
    new_tokens: int
    seconds: float
    warmup_s: float
    acceptance: float | None
    drafted: int
    accepted: int
    rounds: int
    tokens_per_round: float | None
    outputs_match_target: bool | None  # None for the target itself
    speedup_vs_target: float


class E2E(TypedDict):
    checkpoint: str
    device: str
    prompts: int
    prompt_len: int
    new_tokens: int
    methods: dict[str, Method]
    hf_mtp_depths: int
    distill: dict[str, Any] | None  # distill.json without the loss history (+ "text_target": its build figures)
    target: NotRequired[str]  # what the target and its prompts are (the text target, held-out prompts; ...)


class ColdCompile(TypedDict):
    """One K's drafter compiled (greedy decode windows, batch 1) in a fresh subprocess with an empty Inductor
    cache (``bench.ksweep.compile_probe``)."""

    wall_s: float
    cpu_s: float  # the process and its C++ compiler children
    ratio_to_first: float  # cpu_s over the sweep's first K's (K = 1)
    graphs: int
    matches: dict[str, int]  # our passes' matches
    recompiles_over_64_rounds: int  # at advancing positions, every accepted count


class PaddedBatch(TypedDict):
    """One left-padded batch of 4 prompts generated together (each row advances by its own accepted length)."""

    compiled: bool  # the drafter compiled (else eager: same tokens, its own speed)
    tokens_per_s: float
    speedup_vs_target: float  # over target.generate on the same batch
    mean_accepted_length: float  # tokens per (sequence, target forward)
    acceptance_per_position: list[float]  # over (row, round) pairs
    per_sequence_accepted_length: float  # 1 + sum(acceptance_per_position): equal to the above up to truncation
    outputs_match_target: bool


class DepthPoint(TypedDict):
    """Speculative generation with K chained draft depths per round, end to end (statistics: docs/protocol.md
    §6.8)."""

    k: int
    tokens_per_s: float
    speedup_vs_target: float  # tokens/s over the target alone's (target.generate), same run
    mean_accepted_length: float  # tokens per target forward: 1 + accepted drafts per round
    acceptance_per_position: list[float]  # K fractions: rounds whose drafts 1..j were all accepted
    outputs_match_target: bool
    draft_round_ms: dict[str, Stats]  # one compiled draft round (all K depths), by batch size; {} where not timed
    compile_s: float | None  # first call (compile + run) of the K-depth drafter; None where not compiled
    speedup_vs_hf_mtp: NotRequired[float | None]  # tokens/s over transformers' generate(use_mtp=True)'s, same run
    draft_round_cpu_ms: NotRequired[dict[str, float]]  # median thread-CPU ms of those rounds, by batch size
    draft_round_all_accepted_ms: NotRequired[Stats | None]  # batch 1, the K + 1-row window (every draft accepted)
    cold_compile: NotRequired[ColdCompile | Failed | None]
    batch4: NotRequired[PaddedBatch | None]


class Depths(TypedDict):
    """The K sweep (issue 11; ``bench.ksweep``) on a self-distilled target: ours for each K, transformers'
    generate(use_mtp=True) (which chains every depth it loads) once."""

    checkpoint: str
    device: str
    prompts: int
    new_tokens: int
    target_tokens_per_s: float
    ours: dict[str, DepthPoint]  # by K
    hf_mtp: DepthPoint | None
    prompt_len: NotRequired[int]
    batch4_target_tokens_per_s: NotRequired[float]  # target.generate on the left-padded batch of 4
    compile_checkpoint: NotRequired[str | None]  # where the cold compiles ran; None: not run
    target: NotRequired[str]  # as E2E.target


class Goal(TypedDict):
    id: str
    text: str
    target: str
    value: float | None
    unit: str
    met: bool | None  # None: this run did not measure it
    note: str


class PerRowMode(TypedDict):
    tokens_per_forward: float  # tokens per (row, target forward): mean accepted length
    target_forwards: int
    tokens_per_s: float
    same_tokens: bool  # every continuation equals target.generate's
    vs_batch1: float  # tokens_per_forward over batch 1's, same mode


class PerRowRollback(TypedDict):
    forward_ms: float  # median verify forward
    rollback_ms: float  # median target_cache.rollback_rows, every round
    share: float
    ragged_ms: float | None  # median over the rounds whose rows kept different counts
    rounds: int
    ragged_rounds: int


class PerRowBatch(TypedDict):
    lockstep: PerRowMode
    per_row: PerRowMode
    rollback: PerRowRollback


class RollbackCost(TypedDict):
    batch: int
    k: int
    context: int
    rollback_ms: float
    forward_ms: float
    share: float


class PerRow(TypedDict):
    """Per-row acceptance against lockstep (issue 13; ``bench.perrow.run_perrow``), one run."""

    checkpoint: str
    config: dict[str, Any]  # bench.perrow.PerRowConfig
    ks: dict[str, dict[str, PerRowBatch]]  # by K, then batch size
    target: dict[str, dict[str, float]]  # by batch size: the target alone's tokens_per_s
    rollback_vs_context: list[RollbackCost]


class Result(TypedDict):
    schema: str
    command: str
    date: str
    wall_s: float
    partial: bool
    completed: list[str]  # "tiny/models", "tiny/compile", "tiny/latency/1", "tiny", "e2e", ... as they finish
    machine: Machine
    settings: Settings
    configs: dict[str, Config]
    e2e: E2E | Failed | None
    depths: NotRequired[Depths | Failed | None]
    perrow: NotRequired[PerRow | Failed | None]
    goals: list[Goal]


def problems(value: Any, kind: Any = Result, where: str = "$") -> list[str]:
    """Where ``value`` (loaded JSON) departs from the record type ``kind``; empty when it conforms."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return []
    if origin in (Union, types.UnionType):
        found = [problems(value, option, where) for option in args]
        if not all(found):
            return []
        if isinstance(value, (dict, list)):  # the option it comes closest to
            return min(found, key=len)
        return [f"{where}: expected {' or '.join(_name(option) for option in args)}, got {value!r}"]
    if typing.is_typeddict(kind):
        if not isinstance(value, dict):
            return [f"{where}: expected an object ({kind.__name__}), got {type(value).__name__}"]
        hints = typing.get_type_hints(kind)
        out = [f"{where}: missing key {k!r}" for k in sorted(kind.__required_keys__ - value.keys())]
        out += [f"{where}: unexpected key {k!r}" for k in sorted(value.keys() - hints.keys())]
        for k in value:
            if k in hints:
                out += problems(value[k], hints[k], f"{where}.{k}")
        return out
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        return [p for i, item in enumerate(value) for p in problems(item, args[0], f"{where}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {type(value).__name__}"]
        return [p for k, item in value.items() for p in problems(item, args[1], f"{where}.{k}")]
    if kind is type(None):
        return [] if value is None else [f"{where}: expected null, got {value!r}"]
    accepted = (int, float) if kind is float else kind
    if isinstance(value, bool) and kind is not bool or not isinstance(value, accepted):
        return [f"{where}: expected {kind.__name__}, got {value!r}"]
    return []


def _name(kind: Any) -> str:
    if kind is type(None):
        return "null"
    origin = typing.get_origin(kind)
    return {list: "a list", dict: "an object"}.get(origin) or getattr(kind, "__name__", str(kind))


def main(argv=None) -> int:
    """``python -m bench.records RESULT.json``: one line on a saved result (the GPU check prints it per stage)."""
    import json
    import sys

    path = (sys.argv[1:] if argv is None else argv)[0]
    result = json.loads(Path(path).read_text())
    found = problems(result)
    state = "partial" if result.get("partial") else "complete"
    print(f"{path}: {state}, completed {result.get('completed')}; "
          + (f"{len(found)} problem(s): {found[:5]}" if found else "conforms to bench.records.Result"))
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
