"""The drafter: an ``InklingMTP`` plus its static cache, run through ``torch.compile`` and, on GPU, CUDA graphs.

One call drafts one token per sequence from MTP depth 0: the rows given (the prompt at prefill, or the target's
verified window while decoding) are written into the position-addressed cache and the logits of each sequence's last
real row (its largest position, picked on the device) give the draft (docs/protocol.md §6.3-6.4). Shapes are bucketed so
that compiled graphs are reused: the batch is padded up to a batch bucket and the rows up to a power of two, with
padding rows at ``cache.pad_position`` (they touch only a scratch slot). Each (batch bucket, rows, greedy/sampled) shape
owns static input/output buffers; on CUDA the shapes in ``graph_rows`` are captured once as CUDA graphs sharing one
memory pool and later only replayed. Greedy and sampled drafting both stay on the device: sampling uses the
exponential-race form of the Gumbel trick (``argmax(q / E)``, ``E ~ Exp(1)``), with q the muP-correct draft
distribution, returned for verification.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass

import torch

from ..model.cache import positive_int
from ..model.mtp import InklingMTP
from ..torch_version import BEFORE_2_13

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
DEFAULT_GRAPH_ROWS = (1, 2)  # the K=1 decode windows: one row after a rejection, two after an acceptance
RECOMPILE_LIMIT = 64  # one compiled graph per (batch bucket, row bucket, mode); raised only around our own calls
# torch 2.11's C++ codegen emits a vectorized 2-D tile of the step's cache-write kernel that reads an index before
# declaring it (CppCompileError: 'tmpNN' was not declared); scalar CPU code compiles and is correct. 2.13 is fine.
CPU_CODEGEN_WORKAROUNDS = {"cpp.simdlen": 1} if BEFORE_2_13 else {}


def check_temperature(temperature) -> None:
    """ValueError unless ``temperature`` is a finite number >= 0 (0 means greedy; a bool is not a temperature)."""
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not 0.0 <= temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")


def check_generator(generator, device: torch.device) -> None:
    """ValueError unless ``generator`` is None or a ``torch.Generator`` for ``device``'s type (what sampling needs)."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator (or None), got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device}, the model on {device}: sampling needs a generator "
                         f"of the model's device (torch.Generator(device={device.type!r}))")


def _bucket_sizes(name: str, values) -> tuple[int, ...]:
    """Sorted distinct sizes, each an int >= 1."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a tuple of ints >= 1, got {values!r}")
    return tuple(sorted({positive_int(f"each of {name}", v) for v in values}))


# Inductor options a quantized model's int8 kernels need, per device (docs/compile.md §11): passed to the drafter's
# own torch.compile only, never set globally.
FAST_INDUCTOR_OPTIONS = {
    "cpu": {"freezing": True, "max_autotune": True},  # the C++ weight-only GEMM template packs frozen weights
    "cuda": {"coordinate_descent_tuning": True},  # M == 1 GEMMs become reductions that read the int8 weight
}


def fast_inductor_options(model) -> dict:
    """The Inductor options a quantized ``InklingMTP`` compiles with on its device; {} for an unquantized one."""
    return dict(FAST_INDUCTOR_OPTIONS.get(model.device.type, {})) if model.quantization is not None else {}


def _compile_options(compile_options, on_cuda: bool, model_options: dict) -> dict:
    """torch.compile's keyword arguments for the step: ours (fullgraph, static shapes; the Inductor options the
    model's kernels need, e.g. a quantized model's int8 fast path, docs/compile.md §11), then the caller's."""
    if compile_options is None:
        compile_options = {}
    if not isinstance(compile_options, dict):
        raise ValueError(f"compile_options must be a dict of torch.compile arguments, got {compile_options!r}")
    accepted = set(inspect.signature(torch.compile).parameters) - {"model"}
    unknown = sorted(set(compile_options) - accepted)
    if unknown:
        raise ValueError(f"compile_options {unknown} are not torch.compile arguments (those are {sorted(accepted)})")
    options = {"fullgraph": True, "dynamic": False, **compile_options}
    inductor = options.get("options") or {}
    if not isinstance(inductor, dict):
        raise ValueError(f"compile_options['options'] must be a dict of Inductor options, got {inductor!r}")
    inductor = {**model_options, **inductor}
    if not on_cuda:  # a C++ wrapper around the CPU kernels: ~30 us less per call than the Python wrapper
        inductor = {"cpp_wrapper": True, **CPU_CODEGEN_WORKAROUNDS, **inductor}
    if inductor:
        options["options"] = inductor
    return options


@dataclass
class DraftResult:
    tokens: torch.Tensor  # [B] drafted token ids
    probs: torch.Tensor | None  # [B, V] draft distribution the tokens were sampled from; None when greedy
    hidden: torch.Tensor  # [B, H] last real row's depth output (the next depth's hidden input when chaining)


class _Shape:
    """Static buffers (and, on CUDA, a captured graph) for one (batch bucket, rows, sampled) shape."""

    def __init__(self, drafter: Drafter, batch: int, rows: int, sampled: bool):
        model, dev = drafter.model, drafter.model.device
        self.batch, self.rows, self.sampled = batch, rows, sampled
        self.input_ids = torch.zeros(batch, rows, dtype=torch.long, device=dev)
        self.positions = torch.full((batch, rows), -1, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(batch, rows, model.config.hidden_size, dtype=model.dtype, device=dev)
        vocab = model.config.logits_vocab_size
        self.noise = torch.ones(batch, vocab, dtype=torch.float32, device=dev) if sampled else None
        self.inv_temperature = torch.ones(batch, 1, dtype=torch.float32, device=dev) if sampled else None
        self.compiled = False  # the step has run once for this shape (compiled, and captured where it applies)
        self.written = (0, 0)  # (batch, rows) of the last call: the positions beyond it are padding (-1)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, ...] | None = None

    def args(self):
        base = (self.input_ids, self.positions, self.hidden)
        return base + (self.noise, self.inv_temperature) if self.sampled else base


class Drafter:
    """Drafts with depth 0 of ``model`` for up to ``max_batch_size`` sequences of up to ``max_length`` positions.

    ``compile=False`` runs the eager model (same buffers and results); ``cuda_graphs`` defaults to on for CUDA models.
    """

    def __init__(self, model: InklingMTP, max_batch_size: int, max_length: int, *, compile: bool = True,
                 cuda_graphs: bool | None = None, batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS,
                 graph_rows: tuple[int, ...] = DEFAULT_GRAPH_ROWS, compile_options: dict | None = None):
        if not isinstance(model, InklingMTP):
            raise ValueError(f"model must be an InklingMTP, got {type(model).__name__}")
        model.check_parameters()
        if not isinstance(compile, bool) or not (cuda_graphs is None or isinstance(cuda_graphs, bool)):
            raise ValueError(f"compile must be a bool and cuda_graphs a bool or None, got {compile!r}, {cuda_graphs!r}")
        self.model = model
        self.max_batch_size = positive_int("max_batch_size", max_batch_size)
        self.max_length = positive_int("max_length", max_length)
        self.cache = model.new_cache(self.max_batch_size, self.max_length)
        buckets = _bucket_sizes("batch_buckets", batch_buckets)
        if not buckets:
            raise ValueError("batch_buckets must name at least one batch size")
        self.batch_buckets = tuple(b for b in buckets if b < self.max_batch_size) + (self.max_batch_size,)
        self.graph_batch_limit = buckets[-1]
        self.graph_rows = _bucket_sizes("graph_rows", graph_rows)
        on_cuda = model.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs a CUDA model; this one is on {model.device}")
        if cuda_graphs and not compile:  # the eager step is not captured
            raise ValueError("cuda_graphs=True needs compile=True")
        self.cuda_graphs = on_cuda and compile if cuda_graphs is None else cuda_graphs
        options = _compile_options(compile_options, on_cuda, fast_inductor_options(model))
        # Inductor freezes only what Dynamo traced as constants: prepare_freezing, around our own compiles only.
        self._freezing = bool(options.get("options", {}).get("freezing"))
        self._greedy = torch.compile(self._greedy_step, **options) if compile else self._greedy_step
        self._sampled = torch.compile(self._sampled_step, **options) if compile else self._sampled_step
        self._shapes: dict[tuple[int, int, bool], _Shape] = {}
        self._pool = None

    # -- the compiled step functions (traced by torch.compile; our Inductor passes apply to them) ------------------

    def _run_depth0(self, input_ids, positions, hidden):
        """Depth 0 over the rows (validated, if at all, by :meth:`draft`); each sequence's output at its last real
        row, the one at its largest position (real rows are consecutive; padding, < 0, may sit anywhere)."""
        last = positions.argmax(dim=1)
        positions = torch.where(positions < 0, self.cache.pad_position, positions)
        out = self.model.forward_unchecked(input_ids, positions, hidden, cache=self.cache, depth=0)
        return out[torch.arange(out.shape[0], device=out.device), last]

    def _greedy_step(self, input_ids, positions, hidden):
        last = self._run_depth0(input_ids, positions, hidden)
        return self.model.get_top_tokens(last), last

    def _sampled_step(self, input_ids, positions, hidden, noise, inv_temperature):
        last = self._run_depth0(input_ids, positions, hidden)
        probs = torch.softmax(self.model.compute_logits(last).float() * inv_temperature, dim=-1)
        return (probs / noise).argmax(dim=-1), last, probs

    # -- public API ---------------------------------------------------------------------------------------------

    def draft(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, *,
              temperature: float = 0.0, generator: torch.Generator | None = None,
              validate: bool = True) -> DraftResult:
        """Run depth 0 over rows [B, T] and draft the token after each sequence's last real row.

        Row t of sequence b is (target hidden at ``positions[b, t]``, token at ``positions[b, t] + 1``); negative
        positions mark padding rows, which may sit anywhere (left or right padding); the real rows of a sequence are
        consecutive positions. ``validate`` checks every argument (:meth:`check`: one host sync); callers that
        validated at their own boundary pass ``validate=False``, and then nothing is checked at all.
        """
        if validate:
            self.check(input_ids, positions, hidden)
            check_temperature(temperature)
            check_generator(generator, self.model.device)
        batch, rows = positions.shape
        shape = self._shape(batch, rows, temperature > 0)
        exact = batch == shape.batch and rows == shape.rows  # no padding: skip the slicing (it costs per call)
        for buffer, value in zip(shape.args(), (input_ids, positions, hidden)):  # inference state: no autograd history
            (buffer if exact else buffer[:batch, -rows:]).copy_(value.detach())
        if shape.sampled:
            shape.noise.exponential_(generator=generator)
            shape.inv_temperature.fill_(1.0 / temperature)
        outputs = self._execute(shape)
        if shape.graph is not None:  # graph outputs live in the pool and are overwritten by the next replay
            outputs = [t[:batch].clone() for t in outputs]
        elif not exact:  # freshly allocated by the compiled step: views are safe to keep
            outputs = [t[:batch] for t in outputs]
        return DraftResult(tokens=outputs[0], probs=outputs[2] if shape.sampled else None, hidden=outputs[1])

    def check(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """ValueError naming the problem for a bad batch, shape, id, position or value (one host sync)."""
        if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
            got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise ValueError(f"positions must be a [batch, rows] tensor, got {got}")
        batch = positions.shape[0]
        if batch > self.max_batch_size:
            raise ValueError(f"batch of {batch} sequences exceeds the drafter's max_batch_size {self.max_batch_size}")
        cache = self.cache.depths[0].k
        if (cache.dtype, cache.device) != (self.model.dtype, self.model.device):
            raise ValueError(f"the model is now {self.model.dtype} on {self.model.device}, but this Drafter was built "
                             f"for it as {cache.dtype} on {cache.device}: build a new Drafter after moving the model")
        self.model.check_inputs(input_ids, positions, hidden, self.cache, drafting=True)

    def capture(self, batch_sizes: tuple[int, ...] | None = None, temperature: float = 0.0) -> float:
        """Compile and (on CUDA) capture every graph shape for ``batch_sizes`` now; returns the seconds it took."""
        batch_sizes = self.batch_buckets if batch_sizes is None else _bucket_sizes("batch_sizes", batch_sizes)
        if batch_sizes and batch_sizes[-1] > self.max_batch_size:
            raise ValueError(f"batch size {batch_sizes[-1]} exceeds the drafter's max_batch_size {self.max_batch_size}")
        check_temperature(temperature)
        start = time.perf_counter()
        for batch in batch_sizes:
            for rows in self.graph_rows:
                self._execute(self._shape(batch, rows, temperature > 0))
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def bucket(self, batch: int, rows: int) -> tuple[int, int]:
        """The padded (batch, rows) shape a call of this size runs as."""
        padded_batch = next((b for b in self.batch_buckets if b >= batch), batch)
        padded_rows = rows if rows in self.graph_rows else 1 << (rows - 1).bit_length()
        return padded_batch, padded_rows

    def static_step(self, batch: int, rows: int):
        """The greedy step bound to the static buffers of the (batch, rows) shape, as a no-argument callable: the
        compiled graph alone, without ``draft``'s input copies and output handling (what a benchmark sets it
        against). The buffers hold the inputs of the last ``draft`` call of that shape."""
        return functools.partial(self._greedy, *self._shape(batch, rows, False).args())

    def uses_graph(self, batch: int, rows: int) -> bool:
        padded_batch, padded_rows = self.bucket(batch, rows)
        return self.cuda_graphs and padded_batch <= self.graph_batch_limit and padded_rows in self.graph_rows

    # -- shapes, compilation, graphs ----------------------------------------------------------------------------

    def _shape(self, batch: int, rows: int, sampled: bool) -> _Shape:
        shape = self._shapes.get((batch, rows, sampled))  # calls of a bucket's exact size: one dict lookup
        if shape is None:
            key = (*self.bucket(batch, rows), sampled)
            shape = self._shapes.get(key) or _Shape(self, *key)
            self._shapes[key] = self._shapes[(batch, rows, sampled)] = shape
        if batch < shape.written[0] or rows < shape.written[1]:  # stale real rows would sit in this call's padding
            shape.positions.fill_(-1)
        shape.written = (batch, rows)
        return shape

    def _execute(self, shape: _Shape) -> tuple[torch.Tensor, ...]:
        if shape.graph is not None:
            shape.graph.replay()
            return shape.outputs
        step = self._sampled if shape.sampled else self._greedy
        if shape.compiled:  # the hot path: no config patching, which costs more than a tiny step
            with torch.no_grad():
                return step(*shape.args())
        dynamo_config = torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, prepare_freezing=self._freezing)
        with torch.no_grad(), dynamo_config:
            outputs = step(*shape.args())
            if self.uses_graph(shape.batch, shape.rows):
                outputs = self._capture(shape, step)
        shape.compiled = True
        return outputs

    def _capture(self, shape: _Shape, step) -> tuple[torch.Tensor, ...]:
        """Warm up on a side stream, then capture ``step`` on the shared pool (the cache writes are idempotent:
        the same rows are rewritten with the same values during warm-up, capture and the first replay)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step(*shape.args())
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            shape.outputs = step(*shape.args())
        shape.graph = graph
        graph.replay()
        return shape.outputs
