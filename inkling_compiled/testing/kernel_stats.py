"""Counting what Inductor generated: kernel definitions, loop nests, launches, extern calls (design §3).

``metrics.generated_kernel_count`` is not a launch count, so this reads the wrapper code that
``torch._inductor.utils.run_and_get_code`` returns. On CPU one ``cpp_fused_*`` function may hold several loop
nests, each a separate pass over memory (what becomes a separate Triton kernel on GPU), so ``loop_nests`` is the
CPU number to compare.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch._inductor.utils import run_and_get_code

_CPP_DEF = re.compile(r"^(cpp_fused_\w+) = async_compile\.cpp(?:_pybinding)?\(", re.M)
_TRITON_DEF = re.compile(r"^(triton_\w+) = async_compile\.triton\(", re.M)
_CPP_SOURCE = re.compile(r"async_compile\.cpp(?:_pybinding)?\(.*?r'''(.*?)'''", re.S)
_EXTERN_CALL = re.compile(r"\bextern_kernels\.(\w+)\(")
_TOKEN = re.compile(r"\bfor\s*\(|[{}]")


@dataclass
class KernelStats:
    cpp_kernels: int = 0  # cpp_fused_* definitions
    triton_kernels: int = 0  # async_compile.triton( definitions
    loop_nests: int = 0  # outermost for-loops summed over the cpp kernels
    kernel_launches: int = 0  # calls of generated kernels in the wrappers' call()
    extern_calls: list[str] = field(default_factory=list)  # e.g. ["mm"], ["addmm"], in call order

    @property
    def kernels(self) -> int:
        return self.cpp_kernels + self.triton_kernels

    @property
    def launches(self) -> int:
        return self.kernel_launches + len(self.extern_calls)

    def __add__(self, other: KernelStats) -> KernelStats:
        return KernelStats(
            self.cpp_kernels + other.cpp_kernels,
            self.triton_kernels + other.triton_kernels,
            self.loop_nests + other.loop_nests,
            self.kernel_launches + other.kernel_launches,
            self.extern_calls + other.extern_calls,
        )


def outer_loops(cpp_source: str) -> int:
    """For-loops with no enclosing for-loop (Inductor's C++ always braces its loop bodies)."""
    stack: list[bool] = []  # one entry per open brace: does it open a for-loop body?
    pending_for = False
    count = 0
    for token in _TOKEN.findall(cpp_source):
        if token == "{":
            stack.append(pending_for)
            pending_for = False
        elif token == "}":
            if stack:
                stack.pop()
        else:
            if not any(stack) and not pending_for:
                count += 1
            pending_for = True
    return count


def kernel_stats(code: str | list[str] | tuple[str, ...]) -> KernelStats:
    """Stats of one wrapper module's source, or the sum over several (forward + backward, graph breaks)."""
    if not isinstance(code, str):
        total = KernelStats()
        for c in code:
            total = total + kernel_stats(c)
        return total
    names = _CPP_DEF.findall(code) + _TRITON_DEF.findall(code)
    call = code[code.find("def call("):] if "def call(" in code else code
    launches = sum(len(re.findall(rf"\b{re.escape(n)}(?:\.run)?\(", call)) for n in names)
    return KernelStats(
        cpp_kernels=len(_CPP_DEF.findall(code)),
        triton_kernels=len(_TRITON_DEF.findall(code)),
        loop_nests=sum(outer_loops(src) for src in _CPP_SOURCE.findall(code)),
        kernel_launches=launches,
        extern_calls=_EXTERN_CALL.findall(call),
    )


def compile_and_count(fn, *args, **compile_kwargs):
    """``torch.compile(fn, **compile_kwargs)(*args)`` -> (output, KernelStats, generated sources).

    Call inside a fresh context (``torch._dynamo.reset()``, FX graph cache off) when the pass must actually run.
    """
    out, code = run_and_get_code(torch.compile(fn, **compile_kwargs), *args)
    return out, kernel_stats(code), code


@dataclass
class CompiledRun:
    output: object
    stats: KernelStats
    matches: dict[str, int]  # per fusion, this compile only
    code: list[str]


def compile_fresh(fn, *args, passes: bool, **compile_kwargs) -> CompiledRun:
    """Compile and run ``fn`` from scratch (dynamo reset, FX graph and AOT caches off) with our passes alone in the
    post-grad slot (``passes=True``) or with the slot empty (``passes=False``: stock Inductor)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    from ..passes import pass_manager

    ours = pass_manager()
    torch._dynamo.reset()
    before = ours.match_counts()
    try:
        with (
            inductor_config.patch(fx_graph_cache=False, post_grad_custom_post_pass=ours if passes else None),
            functorch_config.patch(enable_autograd_cache=False),
        ):
            out, stats, code = compile_and_count(fn, *args, **compile_kwargs)
    finally:
        torch._dynamo.reset()
    after = ours.match_counts()
    return CompiledRun(out, stats, {k: after[k] - before[k] for k in after}, code)
