"""The GEMM-only floor: the matrix multiplies one eager step dispatches (recorded under a ``TorchDispatchMode``;
those reading a parameter are *weight* GEMMs), replayed alone with the same aten overloads."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten
GEMM_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.mv.default,
            aten.addmv.default, aten.dot.default}


def _empty(t: torch.Tensor, device) -> torch.Tensor:
    """Uninitialised, of ``t``'s shape, stride and dtype."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


@dataclass(frozen=True)
class Gemm:
    """One recorded call: its aten overload and arguments (tensors as meta tensors of their layout)."""

    op: object  # torch._ops.OpOverload
    args: tuple
    kwargs: dict
    weight: bool  # a parameter is among the operands

    @property
    def name(self) -> str:
        return self.op.name().removeprefix("aten::")

    @property
    def operands(self) -> list[torch.Tensor]:
        return [a for a in self.args if isinstance(a, torch.Tensor)]

    @property
    def mnk(self) -> tuple[int, ...]:
        """(M, N, K) of a 2-D GEMM (a vector operand is one row or column), (batch, M, N, K) of a batched one."""
        a, b = self.operands[-2:]
        if a.dim() == 3:
            return a.shape[0], a.shape[1], b.shape[2], a.shape[2]
        return a.shape[0] if a.dim() == 2 else 1, b.shape[1] if b.dim() == 2 else 1, a.shape[-1]


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
    """``floor()`` runs the recorded GEMMs once on fresh operands of their layout (``summary``: :func:`summarize`);
    on CUDA as one CUDA graph, so the floor carries no launch overhead."""

    def __init__(self, gemms: list[Gemm], device):
        self.device = torch.device(device)
        gen = torch.Generator(device=self.device).manual_seed(0)

        def fresh(meta: torch.Tensor) -> torch.Tensor:
            t = _empty(meta, self.device)
            return t.normal_(generator=gen) if t.dtype.is_floating_point else t.zero_()

        self.summary, self.graph = summarize(gemms), None
        self.calls = [(g.op, tree_map_only(torch.Tensor, fresh, g.args), tree_map_only(torch.Tensor, fresh, g.kwargs))
                      for g in gemms]
        if self.device.type == "cuda" and self.calls:
            self()  # warm-up (cuBLAS handles, workspaces) before capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self()
            self.graph = graph

    def __call__(self) -> None:
        if self.graph is not None:
            return self.graph.replay()
        for op, args, kwargs in self.calls:
            op(*args, **kwargs)
