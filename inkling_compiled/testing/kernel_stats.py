"""Counting what Inductor generated: kernel definitions, kernel launches, loop nests, extern calls (docs/compile.md §6).

``metrics.generated_kernel_count`` is not a launch count, so this reads the wrapper code that
``torch._inductor.utils.run_and_get_code`` returns: a Python wrapper (``cpp_fused_*`` and Triton kernels defined
through ``async_compile``, launched from ``call`` or its graph partitions) or a C++ wrapper (``cpp_wrapper=True``:
one C++ source holding the kernels and ``inductor_entry_impl``, which calls them and the extern ops through
``aoti_torch_<device>_<op>_out``). Inductor emits identical kernel sources once and launches the one definition
wherever it is needed (two identical RMSNorms: one Triton kernel, two launches), so a claim about how many passes
over memory a graph makes is a claim about *launches*. On CPU one ``cpp_fused_*`` function may hold several loop
nests, each a separate pass over memory (what becomes a separate Triton kernel on GPU), so ``loop_nests`` is the
CPU number to compare.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch._inductor.utils import run_and_get_code

# Python wrapper
_CPP_DEF = re.compile(r"^(cpp_fused_\w+) = async_compile\.cpp(?:_pybinding)?\(", re.M)
_TRITON_DEF = re.compile(r"^(triton_\w+) = async_compile\.triton\(", re.M)
_KERNEL_SOURCE = re.compile(r"'''(.*?)'''", re.S)  # every kernel's source sits in one triple-quoted string
_EXTERN_CALL = re.compile(r"\bextern_kernels\.(\w+)\(")
# C++ wrapper
_CPP_WRAPPER_MARK = "inductor_entry_impl"
_CPP_WRAPPER_DEF = re.compile(r'extern "C"\s+void\s+(cpp_fused_\w+)\(')
_CPP_WRAPPER_CALL = re.compile(r"\b(cpp_fused_\w+)\(\(")  # call sites cast their first pointer: name((float*)...
_AOTI_EXTERN = re.compile(r"\baoti_torch_(?:cpu|cuda)_(\w+?)(?:_out)?\(")

_TOKEN = re.compile(r"\bfor\s*\(|[{}]")


@dataclass
class KernelStats:
    cpp_kernels: int = 0  # distinct cpp_fused_* definitions
    triton_kernels: int = 0  # distinct Triton kernel definitions (identical sources are defined once)
    loop_nests: int = 0  # outermost for-loops summed over the cpp kernels
    cpp_launches: int = 0  # calls of cpp kernels in the wrapper
    triton_launches: int = 0  # ``<kernel>.run(`` calls in the wrapper: what a GPU claim about kernels counts
    extern_calls: list[str] = field(default_factory=list)  # e.g. ["mm"], ["addmm"], in call order

    @property
    def kernels(self) -> int:
        return self.cpp_kernels + self.triton_kernels

    @property
    def kernel_launches(self) -> int:
        return self.cpp_launches + self.triton_launches

    @property
    def launches(self) -> int:
        return self.kernel_launches + len(self.extern_calls)

    def __add__(self, other: KernelStats) -> KernelStats:
        return KernelStats(
            self.cpp_kernels + other.cpp_kernels,
            self.triton_kernels + other.triton_kernels,
            self.loop_nests + other.loop_nests,
            self.cpp_launches + other.cpp_launches,
            self.triton_launches + other.triton_launches,
            self.extern_calls + other.extern_calls,
        )

    def to_dict(self) -> dict:
        """Every count, derived ones included, and the distinct extern ops (for JSON reports)."""
        return {"cpp_kernels": self.cpp_kernels, "triton_kernels": self.triton_kernels, "kernels": self.kernels,
                "loop_nests": self.loop_nests, "cpp_launches": self.cpp_launches,
                "triton_launches": self.triton_launches, "kernel_launches": self.kernel_launches,
                "extern_calls": len(self.extern_calls), "extern_ops": sorted(set(self.extern_calls)),
                "launches": self.launches}


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


def _python_wrapper_stats(code: str) -> KernelStats:
    cpp, triton = _CPP_DEF.findall(code), _TRITON_DEF.findall(code)
    calls = _KERNEL_SOURCE.sub("", code)  # the wrapper without kernel sources: what is left calls them
    return KernelStats(
        cpp_kernels=len(cpp),
        triton_kernels=len(triton),
        loop_nests=sum(outer_loops(src) for src in _KERNEL_SOURCE.findall(code)
                       if 'extern "C"' in src),
        cpp_launches=sum(len(re.findall(rf"\b{name}\(", calls)) for name in cpp),
        triton_launches=sum(len(re.findall(rf"\b{name}\.run\(", calls)) for name in triton),
        extern_calls=_EXTERN_CALL.findall(calls),
    )


def _cpp_wrapper_stats(code: str) -> KernelStats:
    return KernelStats(
        cpp_kernels=len(set(_CPP_WRAPPER_DEF.findall(code))),  # each is declared, then defined
        loop_nests=outer_loops(code),
        cpp_launches=len(_CPP_WRAPPER_CALL.findall(code)),
        extern_calls=_AOTI_EXTERN.findall(code),
    )


def kernel_stats(code: str | list[str] | tuple[str, ...]) -> KernelStats:
    """Stats of one wrapper module's source (Python or C++ wrapper), or the sum over several (forward + backward,
    graph breaks)."""
    if not isinstance(code, str):
        total = KernelStats()
        for c in code:
            total = total + kernel_stats(c)
        return total
    return _cpp_wrapper_stats(code) if _CPP_WRAPPER_MARK in code else _python_wrapper_stats(code)


def aoti_package_sources(path) -> dict[str, str]:
    """The generated C++ of an AOTInductor package (a ``.pt2``): ``{"wrapper": ..., "kernel": ...}`` (CPU: the
    kernels are in ``kernel``; a CUDA package keeps its Triton kernels as binaries and has no ``kernel``)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        return {name.rsplit(".", 2)[-2]: archive.read(name).decode() for name in archive.namelist()
                if name.endswith((".wrapper.cpp", ".kernel.cpp"))}


def aoti_package_stats(path) -> KernelStats:
    """Stats of a CPU AOTInductor package: definitions and loop nests from its kernel source, launches and extern
    calls from its wrapper (whose own helper loops are not kernels)."""
    sources = aoti_package_sources(path)
    wrapper, kernels = sources["wrapper"], sources.get("kernel", "")
    return KernelStats(cpp_kernels=len(set(_CPP_WRAPPER_DEF.findall(kernels))), loop_nests=outer_loops(kernels),
                       cpp_launches=len(_CPP_WRAPPER_CALL.findall(wrapper)), extern_calls=_AOTI_EXTERN.findall(wrapper))


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
