"""The one-token draft step, every way the benchmark runs it, at a realistic context.

Each variant first has its draft cache filled by an eager prefill of ``context`` rows (depth 0 over positions
0..context-1), then times the step for row ``context`` (target hidden at that position, the next token) — the K=1
decode step of docs/protocol.md §6.4. The step is repeated at the same position, so the context stays fixed (our caches
are position-addressed: rewriting the row is the same work; transformers' cache is put back to its post-prefill state
after each call, untimed).

Variants: ``eager`` (our modules through ``Drafter(compile=False)``), ``compiled_nopasses`` (``torch.compile`` with
the post-grad custom slot empty: stock Inductor), ``compiled`` (with our passes), ``cudagraph`` (compiled + passes
+ CUDA graph replay; CUDA only), ``compiled_call`` (``Drafter.static_step``: the compiled function alone on the
drafter's static buffers, CPU: what ``Drafter.draft`` adds around it), ``hf_eager`` (transformers'
``MtpModel.forward_layer(0)`` + its ``_project_to_logits`` + argmax, with its own ``MtpCache``), ``gemm_floor`` (the
eager step's GEMMs alone, see :mod:`bench.floor`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from inkling_compiled import passes as ic_passes
from inkling_compiled.model import torchao_schemes
from inkling_compiled.runtime import Drafter
from inkling_compiled.testing.kernel_stats import kernel_stats

from .floor import GemmFloor, record_gemms, summarize
from .models import Models


@dataclass
class StepInputs:
    prefill_ids: torch.Tensor  # [B, P] tokens x_1..x_P (row t carries x_{t+1})
    prefill_positions: torch.Tensor  # [B, P] 0..P-1
    prefill_hidden: torch.Tensor  # [B, P, H]
    ids: torch.Tensor  # [B, 1] x_{P+1}
    positions: torch.Tensor  # [B, 1] P
    hidden: torch.Tensor  # [B, 1, H]

    @property
    def context(self) -> int:
        return self.prefill_ids.shape[1]


def make_inputs(models: Models, batch: int, context: int, seed: int = 0) -> StepInputs:
    """Random tokens (real ids) and unit-scale hiddens: the step's cost does not depend on their values."""
    c, dev = models.config, models.device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, c.logits_vocab_size, (batch, context + 1), generator=gen).to(dev)
    hidden = torch.randn(batch, context + 1, c.hidden_size, generator=gen).to(device=dev, dtype=models.dtype)
    positions = torch.arange(context + 1, device=dev)[None].expand(batch, -1).contiguous()
    return StepInputs(ids[:, :context], positions[:, :context], hidden[:, :context],
                      ids[:, context:], positions[:, context:], hidden[:, context:])


# ------------------------------------------------------------------------------------------------------- code capture

@contextlib.contextmanager
def generated_code():
    """Collect the wrapper source of every graph Inductor compiles inside the block.

    ``torch._inductor.utils.run_and_get_code`` does the same but calls ``torch._dynamo.reset()`` first, which would
    throw away the other variants' compiled steps; this patches the same hook without the reset.
    """
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    sources: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", lambda code: sources.append(code)):
        yield sources


def kernel_summary(code: list[str]) -> dict:
    """Kernel definitions and launches of the compiled step's wrapper(s) (docs/compile.md §6), Python or C++ wrapper
    (the drafter's CPU default is ``cpp_wrapper=True``), as ``records.KernelCounts``."""
    return {**kernel_stats(code).to_dict(), "graphs": len(code)}


# ------------------------------------------------------------------------------------------------------- our variants

def compile_options(passes: bool, fresh: bool) -> dict:
    """``torch.compile(options=...)`` for a variant: the post-grad custom slot holds our pass manager or nothing
    (so the global slot does not matter), and ``fresh`` turns the FX graph cache off so the passes really run (on a
    cache hit they do not, and their match counts stay 0). Distinct options objects also give each variant its own
    Dynamo cache entry (Dynamo guards on the backend)."""
    options = {"post_grad_custom_post_pass": ic_passes.pass_manager() if passes else None}
    if fresh:
        options["fx_graph_cache"] = False
    return {"options": options}


def make_drafter(models: Models, batch: int, max_length: int, *, compile: bool, passes: bool = True,
                 cuda_graphs: bool = False, fresh: bool = False) -> Drafter:
    return Drafter(models.mtp, batch, max_length, compile=compile, cuda_graphs=cuda_graphs, graph_rows=(1,),
                   compile_options=compile_options(passes, fresh) if compile else None, num_speculative_tokens=1)


def prefill(models: Models, drafter: Drafter, inputs: StepInputs) -> None:
    """Eager depth-0 prefill straight into the drafter's cache (no compile of the prefill shape)."""
    with torch.no_grad():
        models.mtp(inputs.prefill_ids, inputs.prefill_positions, inputs.prefill_hidden, cache=drafter.cache,
                   depth=0)


def step_fn(drafter: Drafter, inputs: StepInputs):
    def step():
        return drafter.draft(inputs.ids, inputs.positions, inputs.hidden, validate=False).tokens
    return step


@dataclass
class CompiledVariant:
    drafter: Drafter
    first_call_s: float
    kernels: dict
    matches: dict
    graphs: int  # graphs Dynamo compiled for the first call
    extra: dict = field(default_factory=dict)


def build_compiled(models: Models, inputs: StepInputs, max_length: int, *, passes: bool,
                   cuda_graphs: bool = False) -> CompiledVariant:
    """Compile (FX graph cache off, so the passes run) and run the first step; collect kernels and matches."""
    from torch._dynamo.utils import counters

    drafter = make_drafter(models, inputs.ids.shape[0], max_length, compile=True, passes=passes,
                           cuda_graphs=cuda_graphs, fresh=True)
    prefill(models, drafter, inputs)
    before = ic_passes.match_counts()
    graphs0 = counters["stats"]["unique_graphs"]
    step = step_fn(drafter, inputs)
    with generated_code() as code:
        t0 = time.perf_counter()
        step()
        if models.device.type == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
    after = ic_passes.match_counts()
    return CompiledVariant(drafter, first, kernel_summary(code), {k: after[k] - before.get(k, 0) for k in after},
                           counters["stats"]["unique_graphs"] - graphs0)


# ------------------------------------------------------------------------------------------------------- the peer

class HFStep:
    """transformers' own draft step: ``forward_layer(0)`` + ``_project_to_logits`` + argmax, as its
    ``MTPCandidateGenerator`` drives it (``MtpCache`` with past recording, token positions = row + 1).

    With one MTP depth ``generate`` never crops the draft cache, so it keeps the whole history (sliding layers
    included); the rollback after each timed call restores the depth-0 cache layer's state from right after the
    prefill (its update assigns new tensors, so a shallow snapshot is enough), keeping that history and the context
    constant.
    """

    def __init__(self, models: Models, inputs: StepInputs):
        from transformers.cache_utils import MtpCache

        self.mtp = models.hf_mtp
        self.cache = MtpCache(config=models.target.config.get_mtp_config())
        self.cache.activate_past_recording()
        self.inputs = inputs
        with torch.no_grad():
            self.mtp.forward_layer(0, inputs.prefill_hidden, inputs.prefill_positions + 1, self.cache,
                                   input_ids=inputs.prefill_ids)
        self.layer = self.cache.layers[0]
        self._snapshot = self._state()
        self.length = self.cache.get_seq_length(0)

    def _state(self) -> dict:
        return {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
                for k, v in self.layer.__dict__.items()}

    def __call__(self):
        x = self.inputs
        out = self.mtp.forward_layer(0, x.hidden, x.positions + 1, self.cache, input_ids=x.ids)
        return self.mtp._project_to_logits(out[:, -1:]).argmax(-1)

    def rollback(self):
        """Untimed: back to the state right after the prefill, so every call runs at the same context."""
        self.layer.__dict__.update(self._state_copy())

    def _state_copy(self) -> dict:
        return {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
                for k, v in self._snapshot.items()}


# ------------------------------------------------------------------------------------------------------- bytes

def step_bytes(models: Models, batch: int, context: int) -> dict:
    """Bytes one depth-0 step must read at least: depth-0 weights, the LM head rows that are real logits, the
    embedding rows and backbone embed_norm, the K/V of the positions the query can see (the window on a sliding
    depth), and the short-conv taps. Writes (one row of K/V and conv inputs) are not counted."""
    c, mtp = models.config, models.mtp
    g = c.depths[0]
    item = models.dtype.itemsize
    layer = sum(torchao_schemes.nbytes(p) for p in mtp.layers[0].parameters())  # a torchao weight's stored bytes
    head = c.logits_vocab_size * c.hidden_size * item
    embed = batch * c.hidden_size * item + (c.hidden_size * item if mtp.embed_norm_weight is not None else 0)
    visible = context + 1 if g.window is None else min(context + 1, g.window)
    kv = 2 * batch * visible * g.num_kv_heads * g.head_dim * item
    conv = batch * (c.conv_kernel_size - 1) * (2 * g.num_kv_heads * g.head_dim + 2 * c.hidden_size) * item
    total = layer + head + embed + kv + conv
    return {"weights": layer, "lm_head": head, "embedding": embed, "kv_cache": kv, "conv_state": conv,
            "total": total}


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), median of ``iters`` CUDA-event timings."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del src, dst
    return 2 * nbytes / times[len(times) // 2]


def gemm_floor(models: Models, eager: Drafter, inputs: StepInputs) -> tuple[GemmFloor, list[dict]]:
    """Record the eager step's GEMMs and build their replay."""
    gemms, _ = record_gemms(step_fn(eager, inputs), models.mtp.parameters())
    return GemmFloor(gemms, models.device), summarize(gemms)
