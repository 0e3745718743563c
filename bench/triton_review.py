"""Check the ``gpu`` tests' kernel counts on a machine without a GPU: a pytest plugin that runs them on CPU tensors
with Inductor's *Triton* code generation (``cpu_backend="triton"``).

    pip install triton  # into a private venv: Inductor only needs it to write the kernels
    python -m pytest -p bench.triton_review -m gpu -o addopts="" -s tests/passes/test_gpu.py

Every ``compile_fresh`` the tests make runs twice: once through Triton code generation, stopped when the generated
module would load its kernels (no Triton driver for CPU), whose wrapper gives the kernel counts (definitions and
``.run(`` launches, extern calls) the test asserts; once through the C++ backend for real, whose output the test's
numeric checks see. ``.cuda()`` keeps tensors on the CPU and CUDA-only skips are lifted. What this cannot show:
whatever Inductor decides from the device itself (split reductions sized by the SM count, ``pad_mm``, autotuned
block sizes, cuBLAS numerics) and anything that needs CUDA at run time (graphs, streams) — those wait for a GPU.
"""

from unittest import mock

import torch
import torch.utils._triton as torch_triton
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.graph import GraphLowering

from inkling_compiled import InklingMTP
from inkling_compiled.passes import kernel_stats, manager


def triton_code(fn, *args, passes: bool, **compile_kwargs) -> list[str]:
    """The wrapper source(s) Inductor's Triton code generation writes for ``fn(*args)`` on CPU tensors."""
    code: list[str] = []
    ours = manager()
    torch._dynamo.reset()
    with (
        mock.patch.object(torch_triton, "triton_hash_with_backend", lambda: "no-driver"),
        mock.patch.object(GraphLowering, "save_output_code", code.append),
        inductor_config.patch(cpu_backend="triton", compile_threads=1, fx_graph_cache=False,
                              post_grad_custom_post_pass=ours if passes else None),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        try:
            torch.compile(fn, **compile_kwargs)(*args)
        except Exception as e:  # noqa: BLE001 - loading the kernels needs a Triton driver, which CPU lacks
            if not code or "driver" not in str(e) and "backends" not in str(e):
                raise
    torch._dynamo.reset()
    return code


def compile_fresh(fn, *args, passes: bool, **compile_kwargs) -> kernel_stats.CompiledRun:
    """``kernel_stats.compile_fresh`` with the counts of the Triton code and the output of the C++ one."""
    code = triton_code(fn, *args, passes=passes, **compile_kwargs)
    run = kernel_stats.compile_fresh(fn, *args, passes=passes, **compile_kwargs)
    stats = kernel_stats.kernel_stats(code)
    print(f"\n[triton code] {getattr(fn, '__name__', fn)} passes={passes}: {stats.to_dict()}")
    return kernel_stats.CompiledRun(run.output, stats, run.matches, code)


def pytest_configure(config):
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    from_pretrained = InklingMTP.from_pretrained.__func__
    InklingMTP.from_pretrained = classmethod(lambda cls, *a, device=None, **k: from_pretrained(cls, *a, **k))


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        for node in item.listchain():
            node.own_markers = [m for m in node.own_markers if m.name != "skipif"]
        if hasattr(item.module, "compile_fresh"):
            item.module.compile_fresh = compile_fresh
