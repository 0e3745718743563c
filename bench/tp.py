"""The ``tp`` section (CPU only): the tensor-parallel draft head on gloo ranks against the unsharded model, and the
full-size communication beside transformers' and SGLang's schemes (what is measured and why: docs/model.md §11.5)."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from inkling_compiled import InklingMTP, MTPConfig
from inkling_compiled.arguments import ArgumentError
from inkling_compiled.model.tensor_parallel import TensorParallel
from inkling_compiled.runtime import Drafter
from inkling_compiled.testing.distributed import run_ranks
from inkling_compiled.testing.synthetic import cached_checkpoint, preset_config

from .harness import random_rows

PRESET, ROUNDS, QUICK_ROUNDS, FULL_WORLD = "small", 20, 5, 8
COLLECTIVES = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast"}
BF16 = 2  # bytes


@dataclass
class RankRun:
    world_size: int
    parameter_bytes: int  # one rank's, the embedding aside
    unsharded_bytes: int  # the unsharded model's, the embedding aside
    greedy_round_bytes: int  # handed to collectives in one greedy decode round
    greedy_collectives: int
    sampled_round_bytes: int
    sampled_collectives: int
    round_ms: float  # greedy, median
    sampled_round_ms: float
    same_drafts: bool  # every rank drafted what the unsharded model drafts


@dataclass
class FullSize:  # the full config's, bf16, batch 1, from the shapes alone
    world_size: int
    depths: int
    window_rows: int  # rows each depth runs over in a K-depth decode round (K after a rejection)
    ours_greedy_bytes: int  # per round: 2 all-reduces of [B, R, H] per depth + [T, B, 2] fp32 per depth
    ours_head_bytes: int  # per depth: the [T, B, 2] fp32 (value, id) pairs
    ours_sampled_extra_bytes: int  # per depth: the gathered [B, V] logits the acceptance test reads
    transformers_bytes: int  # per round: a [B, V] all-reduce per depth
    sglang_bytes: int  # per round: a [B, V] all-gather per depth
    head_ratio: float  # [B, V] gather / our [T, B, 2]: the goal is >= 1000
    parameter_bytes: dict  # "T" -> one rank's parameter bytes (embedding aside)
    unsharded_bytes: int


@dataclass
class TPResult:
    preset: str
    batch: int
    num_speculative_tokens: int
    runs: list[RankRun]
    full: FullSize


class CollectiveBytes(TorchDispatchMode):
    """Counts the collectives run under it and the bytes of the tensors handed to them."""

    def __init__(self):
        super().__init__()
        self.bytes = self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func.name().split("::")[-1] in COLLECTIVES:
            self.bytes += args[0].numel() * args[0].element_size()
            self.calls += 1
        return func(*args, **(kwargs or {}))


def parameter_bytes(model: InklingMTP) -> int:
    """What one rank holds, the replicated embedding table aside."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed_weight")


def _rounds(model: InklingMTP, batch: int, rounds: int, temperature: float):
    """A prefill of 8 rows, then ``rounds`` one-row rounds unchecked, as the loop calls them (a validated call adds the
    ranks' agreement exchange): (drafts, median s per round, the last round's counts)."""
    drafter = Drafter(model, batch, 64, compile=False)
    rows = random_rows(model, batch, 0, 8 + rounds, torch.Generator().manual_seed(0))
    sampling = dict(temperature=temperature, generator=torch.Generator().manual_seed(1)) if temperature else {}
    drafts, seconds, counter = [], [], CollectiveBytes()
    with torch.no_grad():
        drafts.append(drafter.draft(*(x[:, :8] for x in rows), **sampling).drafts)
        for t in range(8, 8 + rounds):
            start = time.perf_counter()
            with counter if t == 8 + rounds - 1 else contextlib.nullcontext():
                drafts.append(drafter.draft(*(x[:, t:t + 1] for x in rows), **sampling, validate=False).drafts)
            seconds.append(time.perf_counter() - start)
    return torch.cat(drafts, 1), statistics.median(seconds), counter


def _measure_rank(mesh, path, batch: int, rounds: int, sharded: bool) -> dict:
    """This rank's :class:`RankRun` figures, its own round times, its greedy drafts against the unsharded model's."""
    model = InklingMTP.from_pretrained(path, device_mesh=mesh if sharded else None)
    reference = InklingMTP.from_pretrained(path) if sharded else model
    expected = _rounds(reference, batch, rounds, 0.0)[0] if sharded else None
    drafts, greedy_s, greedy = _rounds(model, batch, rounds, 0.0)
    _, sampled_s, sampled = _rounds(model, batch, rounds, 0.8)
    return dict(parameter_bytes=parameter_bytes(model), unsharded_bytes=parameter_bytes(reference),
                greedy_round_bytes=greedy.bytes, greedy_collectives=greedy.calls, sampled_round_bytes=sampled.bytes,
                sampled_collectives=sampled.calls, round_ms=greedy_s * 1e3, sampled_round_ms=sampled_s * 1e3,
                same_drafts=expected is None or torch.equal(drafts, expected))


def measure_runs(path, world_sizes, batch: int, rounds: int) -> list[RankRun]:
    """Per world size rank 0's bytes, the slowest rank's rounds, and whether every rank drafted as unsharded."""
    runs = []
    for world in world_sizes:
        ranks = run_ranks(_measure_rank, world, path, batch, rounds, world > 1, timeout=600)
        slowest = {key: max(r[key] for r in ranks) for key in ("round_ms", "sampled_round_ms")}
        runs.append(RankRun(world, **{**ranks[0], **slowest, "same_drafts": all(r["same_drafts"] for r in ranks)}))
    return runs


def _config(preset: str) -> MTPConfig:
    return MTPConfig.from_config_dict(preset_config(preset), f"the {preset} preset")


def world_sizes() -> tuple[int, ...]:
    """The rank counts the section runs: those the small preset splits over (whole heads, MLP channels and vocab
    rows on every rank), up to the full-size comparison's T (each rank is a process holding the model)."""
    config = _config(PRESET)

    def splits(t: int) -> bool:
        try:
            TensorParallel("", t - 1, t).check(config)  # the last rank: the one a padded vocabulary leaves empty
        except ArgumentError:
            return False
        return True

    return tuple(t for t in range(1, FULL_WORLD + 1) if splits(t))


def full_size(world: int = FULL_WORLD, batch: int = 1) -> FullSize:
    """The communication and per-rank bytes of the full config, from the shapes (meta tensors, bf16)."""
    config = _config("full")
    h, v, k = config.hidden_size, config.vocab_size, config.num_depths  # a round's window: K rows
    head, gather = world * batch * 2 * 4, batch * v * BF16  # our [T, B, 2] fp32 pairs; a [B, V] bf16 row
    with torch.device("meta"):
        unsharded = parameter_bytes(InklingMTP(config).to(torch.bfloat16))
        per_rank = {str(t): parameter_bytes(InklingMTP(config, TensorParallel("", 0, t)).to(torch.bfloat16))
                    for t in (2, 4, 8)}
    return FullSize(world, k, k, k * (2 * batch * k * h * BF16 + head), head, gather, k * gather, k * gather,
                    gather / head, per_rank, unsharded)


def measure(ctx) -> TPResult:
    """The small preset at ``--tp-world-sizes`` (default T = 1, 2), batch 1."""
    path = cached_checkpoint(PRESET)
    runs = measure_runs(path, ctx.settings.tp_world_sizes, 1, QUICK_ROUNDS if ctx.settings.quick else ROUNDS)
    return TPResult(PRESET, 1, InklingMTP.from_pretrained(path).config.num_depths, runs, full_size())


def lines(record: dict) -> list[str]:
    out = [f"tp: {record['preset']} preset, batch {record['batch']}, K = {record['num_speculative_tokens']} "
           "(CPU gloo, eager drafter, one thread per rank)"]
    for r in record["runs"]:
        share = r["parameter_bytes"] / (r["unsharded_bytes"] / r["world_size"])
        out.append(f"  T={r['world_size']}: {r['parameter_bytes'] / 2**20:8.1f} MiB/rank ({share:.3f} x 1/T of "
                   f"{r['unsharded_bytes'] / 2**20:.1f}), greedy round {r['round_ms']:.2f} ms / "
                   f"{r['greedy_round_bytes']} B in {r['greedy_collectives']} collectives, sampled "
                   f"{r['sampled_round_ms']:.2f} ms / {r['sampled_round_bytes']} B, drafts == unsharded: "
                   f"{r['same_drafts']}")
    f = record["full"]
    shares = ", ".join(f"T={t}: {b / (f['unsharded_bytes'] / int(t)):.3f}" for t, b in f["parameter_bytes"].items())
    return out + [
        f"  full config, T={f['world_size']}, B=1, bf16, K={f['depths']} (window {f['window_rows']} rows):",
        f"    ours greedy {f['ours_greedy_bytes']:>12,} B/round (head {f['ours_head_bytes']} B/depth); "
        f"sampled adds {f['ours_sampled_extra_bytes']:,} B/depth",
        f"    transformers {f['transformers_bytes']:>12,} B/round ([B, V] all-reduce per depth); SGLang "
        f"{f['sglang_bytes']:,} B/round ([B, V] all-gather per depth); head share {f['head_ratio']:.0f}x less",
        f"    per-rank parameter bytes / (unsharded / T), embedding aside: {shares}"]

