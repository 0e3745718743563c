"""The GEMM-only floor: the matrix multiplies one eager step dispatches (recorded under a ``TorchDispatchMode``;
those reading a parameter are *weight* GEMMs), replayed alone on fresh operands of the same layout with the same
aten overloads (on CUDA from one CUDA graph, so launch gaps do not count)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
GEMM_OPS = {
    aten.mm.default: "mm", aten.addmm.default: "addmm", aten.bmm.default: "bmm", aten.baddbmm.default: "baddbmm",
    aten.mv.default: "mv", aten.addmv.default: "addmv", aten.dot.default: "dot",
}


@dataclass(frozen=True)
class Operand:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Gemm:
    """One recorded call: the aten overload, its arguments (tensors replaced by :class:`Operand`), whether a
    parameter is among the operands, and the multiply-add count."""

    op: object  # torch._ops.OpOverload
    args: tuple
    kwargs: tuple  # sorted (name, value) pairs
    weight: bool

    @property
    def name(self) -> str:
        return GEMM_OPS[self.op]

    @property
    def operands(self) -> list[Operand]:
        return [a for a in self.args if isinstance(a, Operand)]

    @property
    def mnk(self) -> tuple[int, ...]:
        """(M, N, K) of a 2-D GEMM, (batch, M, N, K) of a batched one."""
        ops = self.operands
        a, b = ops[-2], ops[-1]
        if self.name in ("bmm", "baddbmm"):
            return (a.shape[0], a.shape[1], b.shape[2], a.shape[2])
        if self.name in ("mv", "addmv"):
            return (a.shape[0], 1, a.shape[1])
        if self.name == "dot":
            return (1, 1, a.shape[0])
        return (a.shape[0], b.shape[1], a.shape[1])

    @property
    def macs(self) -> int:
        out = 1
        for d in self.mnk:
            out *= d
        return out

    def to_dict(self) -> dict:
        return {"op": self.name, "mnk": list(self.mnk), "weight": self.weight,
                "shapes": [list(o.shape) for o in self.operands],
                "dtype": str(self.operands[-1].dtype).removeprefix("torch.")}


class _Recorder(TorchDispatchMode):
    def __init__(self, param_ptrs: set[int]):
        super().__init__()
        self.param_ptrs = param_ptrs
        self.calls: list[Gemm] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMM_OPS:
            weight = False

            def conv(a):
                nonlocal weight
                if isinstance(a, torch.Tensor):
                    if a.untyped_storage().data_ptr() in self.param_ptrs:
                        weight = True
                    return Operand(tuple(a.shape), tuple(a.stride()), a.dtype)
                return a

            rec_args = tuple(conv(a) for a in args)
            rec_kwargs = tuple(sorted((k, conv(v)) for k, v in kwargs.items()))
            self.calls.append(Gemm(func, rec_args, rec_kwargs, weight))
        return func(*args, **kwargs)


def record_gemms(fn, params=()) -> tuple[list[Gemm], object]:
    """(GEMMs dispatched by ``fn()`` in call order, ``fn``'s result). ``params``: tensors whose storages mark a GEMM
    as a weight GEMM (pass ``model.parameters()``)."""
    ptrs = {p.untyped_storage().data_ptr() for p in params}
    with torch.no_grad(), _Recorder(ptrs) as rec:
        out = fn()
    return rec.calls, out


def summarize(gemms: list[Gemm]) -> list[dict]:
    """Distinct GEMMs with their call counts (for the JSON report)."""
    counts = Counter((g.name, tuple(g.mnk), g.weight, str(g.operands[-1].dtype)) for g in gemms)
    return [{"op": op, "mnk": list(mnk), "weight": w, "dtype": dt.removeprefix("torch."), "count": c}
            for (op, mnk, w, dt), c in counts.items()]


def _alloc(o: Operand, device, gen: torch.Generator | None) -> torch.Tensor:
    t = torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device=device)
    if t.dtype.is_floating_point:
        t.normal_(generator=gen)
    else:
        t.zero_()
    return t


class GemmFloor:
    """Replays recorded GEMMs with fresh operands of the same layout: ``floor()`` runs them all once.

    ``which``: "all" (every GEMM of the step), "weight" (parameter GEMMs only) or "activation". On CUDA the sequence
    is captured once as a CUDA graph (``cuda_graph=True``), so the floor carries no launch overhead.
    """

    def __init__(self, gemms: list[Gemm], device, *, which: str = "all", cuda_graph: bool = True, seed: int = 0):
        if which not in ("all", "weight", "activation"):
            raise ValueError(f"which must be all / weight / activation, got {which!r}")
        self.device = torch.device(device)
        self.gemms = [g for g in gemms if which == "all" or g.weight == (which == "weight")]
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.calls = []
        for g in self.gemms:
            args = tuple(_alloc(a, self.device, gen) if isinstance(a, Operand) else a for a in g.args)
            kwargs = {k: _alloc(v, self.device, gen) if isinstance(v, Operand) else v for k, v in g.kwargs}
            self.calls.append((g.op, args, kwargs))
        self.graph = None
        if cuda_graph and self.device.type == "cuda" and self.calls:
            self._run()  # warm-up (cuBLAS handles, workspaces) before capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._run()
            self.graph = graph

    def _run(self) -> None:
        for op, args, kwargs in self.calls:
            op(*args, **kwargs)

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run()

    @property
    def macs(self) -> int:
        return sum(g.macs for g in self.gemms)
