"""The GEMM-only floor: the matrix multiplies one eager step dispatches (recorded under a ``TorchDispatchMode``;
those reading a parameter are *weight* GEMMs), replayed alone on fresh operands of the same layout with the same
aten overloads (on CUDA from one CUDA graph, so launch gaps do not count)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten
GEMM_OPS = {
    aten.mm.default: "mm", aten.addmm.default: "addmm", aten.bmm.default: "bmm", aten.baddbmm.default: "baddbmm",
    aten.mv.default: "mv", aten.addmv.default: "addmv", aten.dot.default: "dot",
}
# (M, N, K) of a 2-D GEMM, (batch, M, N, K) of a batched one, from its last two operands
MNK = {"mm": lambda a, b: (a.shape[0], b.shape[1], a.shape[1]),
       "bmm": lambda a, b: (a.shape[0], a.shape[1], b.shape[2], a.shape[2]),
       "mv": lambda a, b: (a.shape[0], 1, a.shape[1]), "dot": lambda a, b: (1, 1, a.shape[0])}
MNK.update(addmm=MNK["mm"], baddbmm=MNK["bmm"], addmv=MNK["mv"])


def _empty(t: torch.Tensor, device) -> torch.Tensor:
    """Uninitialised, of ``t``'s shape, stride and dtype."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


@dataclass(frozen=True)
class Gemm:
    """One recorded call: the aten overload, its arguments (tensors as meta tensors of the same layout) and whether
    a parameter is among the operands."""

    op: object  # torch._ops.OpOverload
    args: tuple
    kwargs: dict
    weight: bool

    @property
    def name(self) -> str:
        return GEMM_OPS[self.op]

    @property
    def operands(self) -> list[torch.Tensor]:
        return [a for a in self.args if isinstance(a, torch.Tensor)]

    @property
    def mnk(self) -> tuple[int, ...]:
        return MNK[self.name](*self.operands[-2:])


class _Recorder(TorchDispatchMode):
    def __init__(self, param_ptrs: set[int]):
        super().__init__()
        self.param_ptrs, self.calls = param_ptrs, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMM_OPS:
            tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
            meta = [tree_map_only(torch.Tensor, lambda t: _empty(t, "meta"), x) for x in (args, kwargs)]
            self.calls.append(Gemm(func, *meta, any(t.untyped_storage().data_ptr() in self.param_ptrs
                                                    for t in tensors)))
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


class GemmFloor:
    """Replays recorded GEMMs with fresh operands of the same layout: ``floor()`` runs them all once (``summary``:
    :func:`summarize`). On CUDA the sequence is captured once as a CUDA graph, so the floor carries no launch
    overhead."""

    def __init__(self, gemms: list[Gemm], device, seed: int = 0):
        self.device = torch.device(device)
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def fresh(meta: torch.Tensor) -> torch.Tensor:
            t = _empty(meta, self.device)
            return t.normal_(generator=gen) if t.dtype.is_floating_point else t.zero_()

        self.summary, self.graph = summarize(gemms), None
        self.calls = [(g.op, tree_map_only(torch.Tensor, fresh, g.args), tree_map_only(torch.Tensor, fresh, g.kwargs))
                      for g in gemms]
        if self.device.type == "cuda" and self.calls:
            self._run()  # warm-up (cuBLAS handles, workspaces) before capture
            torch.cuda.synchronize(self.device)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._run()

    def _run(self) -> None:
        for op, args, kwargs in self.calls:
            op(*args, **kwargs)

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run()
