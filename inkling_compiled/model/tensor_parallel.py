"""Tensor parallelism for the draft head over a 1-D ``DeviceMesh`` (docs/model.md §11).

Everything parallel lives here, so that the modules keep reading like the math: the sharding plan (which rows or
columns of which tensor a rank holds), the row-parallel linear (the only place a depth communicates) and the
vocab-parallel head (rank-local argmax + a tiny (value, id) gather). Every rank holds plain local tensors, and the
collectives are ``torch.distributed._functional_collectives``: they trace into a ``torch.compile(fullgraph=True)``
graph and export through AOTInductor, which DTensor-parallelised modules do not. Only ``all_reduce`` is used: a gather
is an all-reduce of rank-slotted zeros, because Inductor's C++ wrapper (the drafter's CPU default, and every
AOTInductor package) cannot call ``all_gather_into_tensor`` in torch 2.13 ("arg type Any is not yet supported by
custom_op_wrapper"); the payload is the gathered size, and adding zeros is exact.

Per depth, by whole heads (GQA groups stay on one rank): q / k / v / r projections column-parallel, the K / V short
convs and the KV cache going with the rank's heads (the q / k norms share one gain per head: replicated); the output
projection row-parallel (one all-reduce).
The MLP's fused [gate; up] GEMM is column-parallel per half, its down projection row-parallel (one all-reduce).
Norms, ``input_proj``, the branch convs, the relative-bias table, the chain norm and the embedding are replicated
(so the draft-input fusion keeps its one kernel); the LM head is split by vocabulary rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from ..arguments import ArgumentError
from ..checkpoint.layout import Shard
from ..config import MTPConfig

# Per-depth parameter suffix -> (dim split by the plan, blocks along that dim each split on its own). Every other
# parameter of a depth is replicated.
_COLUMN = {f"transformer_block.attn.{n}.weight": (0, 1) for n in ("wq_du", "wk_dv", "wv_dv", "wr_du",
                                                                  "k_sconv", "v_sconv")}
_SPLIT = {**_COLUMN,
          "transformer_block.mlp.w13_dn.weight": (0, 2),  # [gate; up]: each half split, never the fused rows
          "transformer_block.attn.wo_ud.weight": (1, 1),
          "transformer_block.mlp.w2_md.weight": (1, 1)}
_ROW_PARALLEL = ("attn.wo_ud", "mlp.w2_md")  # under each depth's transformer_block

# The plan overrides for a transformers InklingForConditionalGeneration target run tensor-parallel
# (``from_pretrained(..., distributed_config=DistributedConfig(tp_size=T, tp_plan=TARGET_TP_PLAN))``, docs/model.md
# §11.3): its LM head split by vocab rows (each rank's logits gathered, so the target still returns full logits),
# whose local block the draft head then uses with no copy; and the embedding replicated, because the default
# vocab-sharded one crashes on the first forward (DTensor's _MaskPartial under the normed embedding). For an
# InklingForCausalLM the embedding's key is "model.embed_tokens".
TARGET_TP_PLAN = {"model.language_model.embed_tokens": "replicate", "lm_head": "colwise_rep"}

Result = TypeVar("Result")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a dtype's bits as an integer of its size
CHECKSUM = "contents of "  # the prefix of the fields :meth:`TensorParallel.agree` compares without printing them
# group name -> (its ProcessGroup, {(size, device): (the buffer of its agreement exchanges, the last one's Work)}),
# held so that no gloo worker thread ever needs the GIL to finish one (TensorParallel._exchange)
_EXCHANGES: dict[str, tuple] = {}


def checksum(t: torch.Tensor, most: int = 1 << 18) -> torch.Tensor:
    """A 0-d int64 tensor on ``t``'s device: an exact, order-sensitive checksum of the bits of ``t``'s elements (each
    as an integer, weighted by its index modulo a prime; integer sums are exact in any order, so equal values give
    the same number on every rank whatever its threads or kernels; -0.0 counts as 0.0), over at most ``most`` of
    them, evenly strided:
    another checkpoint or input differs nearly everywhere, and every element would cost a second per 32 M on one
    CPU thread (a full-size head's replicated tensors: tens of seconds)."""
    flat = t.detach().reshape(-1)
    flat = flat[::max(1, -(-flat.numel() // most))]
    if flat.is_floating_point():
        flat = flat + 0.0  # -0.0 as 0.0: equal values, other bits
    flat = flat.view(_BITS[flat.element_size()]).long()
    return (flat * (torch.arange(flat.numel(), device=flat.device) % 65521 + 1)).sum()


def loaded_digest(config: MTPConfig, own: Mapping[str, torch.Tensor], lent: Mapping[str, torch.Tensor]) -> int:
    """What a rank loaded, as a 56-bit digest: the config (after ``num_depths`` / ``mtp_log_scaling``), each tensor's
    name, dtype, shape and device type, and which ones the target lent."""
    tensors = sorted((name, str(t.dtype), tuple(t.shape), t.device.type, name in lent)
                     for name, t in {**own, **lent}.items())
    text = repr((config, tensors))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group: what it holds and how it talks to the others.

    Holds the group's *name*, not the ProcessGroup, so a model stays picklable and the compiled graph refers to the
    group the way the functional collectives do.
    """

    group_name: str
    rank: int
    world_size: int
    device_type: str = "cpu"  # the mesh's: where a tensor handed to its collectives lives (gloo: cpu, NCCL: cuda)

    @classmethod
    def from_mesh(cls, mesh) -> TensorParallel:
        """The tensor-parallel view of a 1-D ``DeviceMesh``; ArgumentError for anything else."""
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise ArgumentError(f"device_mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
        if mesh.ndim != 1:
            raise ArgumentError(f"device_mesh must be 1-D (the tensor-parallel ranks), got shape {tuple(mesh.shape)}")
        if mesh.get_coordinate() is None:
            raise ArgumentError(f"this process (rank {torch.distributed.get_rank()}) is not in device_mesh "
                                f"{mesh.mesh.tolist()}")
        return cls(mesh.get_group().group_name, mesh.get_local_rank(), mesh.size(), mesh.device_type)

    # -- the plan ------------------------------------------------------------------------------------------------

    def check(self, config: MTPConfig) -> None:
        """ArgumentError naming every size the group cannot split into whole heads, MLP channels or vocab rows."""
        t = self.world_size
        sizes = {"vocab_size": config.vocab_size, "intermediate_size": config.intermediate_size}
        for i, g in enumerate(config.depths):
            sizes[f"depth {i} heads"], sizes[f"depth {i} kv heads"] = g.num_heads, g.num_kv_heads
        bad = [f"{name} {n}" for name, n in sizes.items() if n % t]
        if bad:
            raise ArgumentError(f"tensor parallelism over {t} ranks splits whole heads, MLP channels and vocab rows, "
                                f"but these are not multiples of {t}: {', '.join(bad)}")
        if self.vocab_rows(config)[0] >= config.logits_vocab_size:
            raise ArgumentError(f"rank {self.rank} of {t} would hold only padded vocab rows (logits_vocab_size "
                                f"{config.logits_vocab_size} of {config.vocab_size}): use fewer ranks")

    def local_config(self, config: MTPConfig) -> MTPConfig:
        """The config of what this rank computes: its share of every depth's heads and MLP channels (the hidden
        size, vocabulary and everything else unchanged). The modules and the cache are built from it."""
        self.check(config)
        t = self.world_size
        depths = tuple(replace(g, num_heads=g.num_heads // t, num_kv_heads=g.num_kv_heads // t)
                       for g in config.depths)
        return replace(config, depths=depths, intermediate_size=config.intermediate_size // t)

    def vocab_rows(self, config: MTPConfig) -> tuple[int, int]:
        """The [start, stop) ids of the LM-head rows this rank holds."""
        rows = config.vocab_size // self.world_size
        return self.rank * rows, (self.rank + 1) * rows

    def shards(self, config: MTPConfig) -> dict[str, Shard]:
        """Parameter name -> the part of the full tensor this rank holds; names not listed are replicated."""
        plan = {f"layers.{i}.{suffix}": Shard(dim, self.rank, self.world_size, blocks)
                for i in range(config.num_depths) for suffix, (dim, blocks) in _SPLIT.items()}
        plan["lm_head_weight"] = Shard(0, self.rank, self.world_size)
        return plan

    def parallelize(self, layers: nn.ModuleList) -> None:
        """Replace each depth's output and down projections (built with the local sizes) by row-parallel ones."""
        for layer in layers:
            block = layer.transformer_block
            for path in _ROW_PARALLEL:
                parent, name = path.split(".")
                owner = getattr(block, parent)
                linear = getattr(owner, name)
                setattr(owner, name, RowParallelLinear(linear.in_features, linear.out_features, self,
                                                       device=linear.weight.device, dtype=linear.weight.dtype))

    def head_rows(self, head: torch.Tensor, config: MTPConfig) -> torch.Tensor:
        """This rank's vocab rows of the target's LM head, with no copy: a view of a replicated head, or the local
        block of a DTensor head split by rows over the same ranks (a transformers target loaded with
        :data:`TARGET_TP_PLAN`). ArgumentError for a head split any other way (transformers' default plan splits it
        along the hidden dim)."""
        shard = self.shards(config)["lm_head_weight"]
        placements = getattr(head, "placements", None)
        if placements is None:
            return shard.take(head.detach())
        from torch.distributed.tensor import Shard as RowSplit

        mesh = head.device_mesh
        if (tuple(placements) != (RowSplit(0),) or mesh.size() != self.world_size
                or mesh.get_local_rank() != self.rank):
            raise ArgumentError(f"the target's LM head is a DTensor placed {tuple(placements)} over {mesh.size()} "
                                f"ranks; the draft head shares it only split by vocab rows (Shard(0)) over its own "
                                f"{self.world_size} ranks: load the target with DistributedConfig(tp_size="
                                f"{self.world_size}, tp_plan=TARGET_TP_PLAN) (inkling_compiled.model.tensor_parallel)")
        return head.detach().to_local()

    # -- agreement ---------------------------------------------------------------------------------------------------

    def agree(self, what: str, fields: Sequence[str], run: Callable[[], tuple[Result, Mapping[str, object]]],
              fix: str) -> Result:
        """``run()``'s result once every rank has run it without an error and got the same ``fields``; else an
        error on every rank.

        Ranks that load or take different things compute garbage together without a word (their partial sums add
        up all the same), and a rank that refuses its input leaves the others waiting in the next collective; so
        each rank's outcome and ``fields`` (ints, or 0-d integer tensors such as :func:`checksum`) travel in one
        exchange. A failed rank raises its own error, the others an ArgumentError naming it; a difference raises
        an ArgumentError naming each field that differs (its values per rank, except the ``CHECKSUM`` ones) and
        ``fix``.
        """
        device = torch.device(self.device_type)  # cuda: this rank's current device, as NCCL wants
        try:
            result, values = run()
            row = torch.stack([torch.as_tensor(values[name], dtype=torch.int64, device=device).reshape(())
                               for name in fields]) if fields else torch.zeros(0, dtype=torch.int64, device=device)
            failed = None
        except Exception as error:  # noqa: BLE001 - raised below, after the exchange the other ranks wait in
            result, failed, row = None, error, torch.zeros(len(fields), dtype=torch.int64, device=device)
        flag = torch.tensor([failed is not None], dtype=torch.int64, device=device)
        gathered = self._exchange(torch.cat([flag, row]))  # [world, 1 + fields]
        if failed is not None:
            raise failed
        refused = [rank for rank, (bad, *_) in enumerate(gathered) if bad]
        if refused:
            raise ArgumentError(f"{what}: rank(s) {refused} of the tensor-parallel group refused theirs (their own "
                                f"error says why); every rank stops here rather than wait for them")
        differ = [(name, [r[1 + i] for r in gathered]) for i, name in enumerate(fields)
                  if len({r[1 + i] for r in gathered}) > 1]
        if differ:
            described = [name if name.startswith(CHECKSUM) else
                         f"{name} ({', '.join(f'rank {r}: {v}' for r, v in enumerate(values))})"
                         for name, values in differ]
            shown = "; ".join(described[:4]) + (f" and {len(described) - 4} more" if len(described) > 4 else "")
            raise ArgumentError(f"{what} differ between the {self.world_size} tensor-parallel ranks: {shown}. {fix}")
        return result

    def agreed_load(self, read: Callable[[], tuple]) -> tuple:
        """``InklingMTP.from_pretrained``'s ``read()`` (checkpoint, model, shards, own tensors, lent tensors) on every
        rank, then two exchanges (:meth:`agree`): what each rank loaded (config, tensor names, dtypes, shapes), then
        the checksums of the tensors every rank holds whole. Ranks that read different checkpoints (another training
        step, another ``dtype``) are refused on every rank, with the tensors that differ named."""
        what = CHECKSUM + "the config, dtype and tensor shapes"
        loaded = self.agree("the checkpoints", [what],
                            lambda: (r := read(), {what: loaded_digest(r[0].config, *r[3:])}),
                            fix="Every rank must load the same checkpoint, with the same from_pretrained options.")
        _, _, shards, own, _ = loaded
        whole = [name for name in sorted(own) if name not in shards]
        self.agree("the checkpoints' replicated tensors", [CHECKSUM + name for name in whole],
                   lambda: (None, {CHECKSUM + name: checksum(own[name]) for name in whole}),
                   fix="Every rank must load the same checkpoint files.")
        return loaded

    def _exchange(self, x: torch.Tensor) -> list:
        """:meth:`all_gather` of a 1-D int64 ``x`` as a list, for :meth:`agree`: a collective issued from Python.

        Not a functional collective, because of a deadlock: a gloo worker thread drops the Work of a finished
        collective, and when that drop releases the last C++ reference to a tensor Python also holds, it takes the
        GIL (torch 2.13's PyObject preservation) while holding the group's work queue lock. A packaged
        (AOTInductor) step holds the GIL and blocks in its own collectives on the same group, so a worker waiting
        for the GIL stops every rank (docs/model.md §11.4). Each (group, size) therefore keeps one buffer and the
        Work of its last exchange: a Work a worker drops then references a buffer the kept Work still references,
        so its drop is never the last. Like every collective on a group, one thread at a time calls this."""
        from torch.distributed import distributed_c10d

        # torch has no public name -> group lookup; the functional collectives resolve names with this same one
        group = distributed_c10d._resolve_process_group(self.group_name)
        held = _EXCHANGES.get(self.group_name)
        if held is None or held[0] is not group:  # a group made again under this name: the old one's entries go
            held = _EXCHANGES[self.group_name] = group, {}
        key = (x.numel(), x.device)
        if key not in held[1]:
            with torch.inference_mode(False):  # a buffer made under inference mode could not be written outside it
                held[1][key] = torch.zeros(self.world_size, x.numel(), dtype=x.dtype, device=x.device), None
        buffer = held[1][key][0]
        buffer.zero_()
        buffer[self.rank] = x  # each rank fills its own slot; the others add 0
        work = torch.distributed.all_reduce(buffer, group=group, async_op=True)
        work.wait()
        gathered = buffer.tolist()
        held[1][key] = buffer, work  # the previous Work is dropped here, on this thread, or by its worker
        return gathered

    # -- communication ---------------------------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``."""
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", self.group_name))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world, *x.shape]: every rank's ``x``, in rank order (each rank fills its own slot, the others add 0)."""
        before, after = x.new_zeros(self.rank, *x.shape), x.new_zeros(self.world_size - 1 - self.rank, *x.shape)
        return self.all_reduce(torch.cat([before, x.unsqueeze(0), after]))

    def top_tokens(self, local_logits: torch.Tensor, start: int) -> torch.Tensor:
        """Greedy ids [...] from each rank's logits over its kept vocab rows [..., n] (ids ``start``...).

        Each rank sends (its best value, that value's id) as fp32 [..., 2] (ids < 2^24 are exact), the best rank
        wins; a tie goes to the lowest rank, which holds the lower ids, and within a rank ``argmax`` already picks
        the lowest: the one-process argmax exactly (the values are the logits themselves, in their own dtype, cast
        to fp32 without rounding).
        """
        value, index = local_logits.max(dim=-1)
        pairs = self.all_gather(torch.stack([value.float(), (index + start).float()], dim=-1))  # [world, ..., 2]
        best = pairs[..., 0].argmax(dim=0, keepdim=True)
        return pairs[..., 1].gather(0, best).squeeze(0).long()

    def gather_logits(self, local_logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """The full logits [..., vocab] from every rank's block of vocab rows [..., V / world] (the sampled draft's
        distribution, which the acceptance test and the residual read over the whole vocabulary)."""
        gathered = self.all_gather(local_logits)  # [world, ..., V / world]
        return gathered.movedim(0, -2).flatten(-2)[..., :vocab]


class RowParallelLinear(nn.Linear):
    """``y = sum over ranks of x_r @ W_r^T``: this rank's input columns of a linear, then one all-reduce."""

    def __init__(self, in_features: int, out_features: int, parallel: TensorParallel, *, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(F.linear(x, self.weight))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, all-reduce over {self.parallel.world_size} ranks"
