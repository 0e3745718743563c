"""The drafter: ``K`` chained MTP depths over a static cache, run through ``torch.compile`` and, on GPU, CUDA graphs.

One call (a *round*) drafts K tokens per sequence (docs/protocol.md §6.3-6.5). The rows given — the prompt at
prefill, or the target's verified rows while decoding — are the round's window; depth k runs over the same rows as
depth 0, with depth k-1's full-window output as its hidden and the token stream shifted one further left, the drafts
so far filling the tail (depth k at row t reads ``(g^{k-1}_t, x_{t+k+1})``). Each depth writes its own
position-addressed cache, and the last row of depth k gives draft ``d_{k+1}``.

Stale rows (K > 1): after a verification that rejected r drafts, the last ``max(0, r - 1)`` committed rows before
the new rows were computed by some depth from drafts that turned out wrong. The drafter keeps the last K committed
rows of each sequence (token, position, target hidden) and puts the ones a round needs at the front of its window,
so that every window covers at least the K rows ending at its last row: with ``a + 1`` new rows that is exactly
``K - a - 1 = r - 1`` re-run rows, and their slots are overwritten with values from committed tokens only. K = 1
re-runs nothing.

Every depth drafts from each sequence's last real row, whatever padding the caller used; with K > 1 the window's
rows are first right-aligned (padding first, real rows in position order), so that shifting the tokens by one
column shifts them by one position. Shapes are bucketed so that compiled graphs are reused: the batch is padded up
to a batch bucket and the window to a graph row count (the decode windows K and K + 1) or a power of two, with
padding rows at ``cache.pad_position`` (they touch only a scratch slot).

Compilation: one compiled step per depth *geometry* (sliding / full). The step takes the depth's module and cache
as arguments, so every depth of a geometry reuses one graph (Dynamo treats module parameters as inputs) and the
compile cost does not grow with K; with K > 1 a small compiled prologue builds the window. The same pieces can be
packaged ahead of time with AOTInductor (:meth:`Drafter.save_compiled`, :meth:`Drafter.load_compiled`,
docs/compile.md §12): a loaded drafter runs them with no Dynamo at call time. On CUDA the whole round
— prologue and all K depth steps — is captured as one CUDA graph per (batch bucket, rows, greedy/sampled) bucket,
the buckets sharing one memory pool. Greedy and sampled drafting both stay on the device: sampling uses the
exponential-race form of the Gumbel trick (``argmax(q / E)``, ``E ~ Exp(1)``, independent per depth), with q the
muP-correct draft distribution of each depth, returned for verification.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, get_origin, runtime_checkable

import torch

from .. import arguments
from ..arguments import ArgumentError
from ..model import validation
from ..model.mtp import InklingMTP
from ..model.tensor_parallel import CHECKSUM, checksum
from ..torch_version import BEFORE_2_13
from . import packaged, round_cache

# What tensor-parallel ranks compare of a validated draft call, beyond the model's inputs (Drafter._checked_spans)
DRAFT_FIELDS = (*validation.INPUT_FIELDS, "num_speculative_tokens", CHECKSUM + "inputs_embeds",
                CHECKSUM + "temperature", CHECKSUM + "the generator's state")

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
# Compiled graphs per code object: (batch buckets x row buckets x greedy/sampled), times the two depth geometries for
# the depth step. Raised only around our own first calls of a bucket.
RECOMPILE_LIMIT = 256
# torch 2.11's C++ codegen emits a vectorized 2-D tile of the step's cache-write kernel that reads an index before
# declaring it (CppCompileError: 'tmpNN' was not declared); scalar CPU code compiles and is correct. 2.13 is fine.
CPU_CODEGEN_WORKAROUNDS = {"cpp.simdlen": 1} if BEFORE_2_13 else {}


# Inductor options a quantized model's int8 kernels need, per device (docs/compile.md §11): passed to the drafter's
# own torch.compile only, never set globally.
FAST_INDUCTOR_OPTIONS = {
    "cpu": {"freezing": True, "max_autotune": True},  # the C++ weight-only GEMM template packs frozen weights
    "cuda": {"coordinate_descent_tuning": True},  # M == 1 GEMMs become reductions that read the int8 weight
}
# compile_options["options"] that turn the fast path off again (the switches; a backend list means nothing without)
FAST_PATH_OFF = {device: {k: False for k, v in options.items() if v is True}
                 for device, options in FAST_INDUCTOR_OPTIONS.items()}


def fast_inductor_options(model) -> dict:
    """The Inductor options a quantized ``InklingMTP`` compiles with on its device; {} for an unquantized one."""
    return dict(FAST_INDUCTOR_OPTIONS.get(model.device.type, {})) if model.quantization is not None else {}


def _compile_options(compile_options, on_cuda: bool, model_options: dict) -> dict:
    """torch.compile's keyword arguments for the step: ours (fullgraph, static shapes; the Inductor options the
    model's kernels need, e.g. a quantized model's int8 fast path, docs/compile.md §11), then the caller's."""
    if compile_options is None:
        compile_options = {}
    if not isinstance(compile_options, dict):
        raise ArgumentError(f"compile_options must be a dict of torch.compile arguments, got {compile_options!r}")
    accepted = set(inspect.signature(torch.compile).parameters) - {"model"}
    unknown = sorted(set(compile_options) - accepted)
    if unknown:
        raise ArgumentError(f"compile_options {unknown} are not torch.compile arguments (those are {sorted(accepted)})")
    options = {"fullgraph": True, "dynamic": False, **compile_options}
    arguments.check_bool("compile_options['fullgraph']", options["fullgraph"])  # torch.compile checks them only
    arguments.check_bool("compile_options['dynamic']", options["dynamic"], optional=True)  # at the first draft
    inductor = options.get("options") or {}
    if not isinstance(inductor, dict):
        raise ArgumentError(f"compile_options['options'] must be a dict of Inductor options, got {inductor!r}")
    _check_backend(options.get("backend", "inductor"))
    _check_inductor_options(inductor)
    if options.get("mode") is not None and options.get("backend", "inductor") == "inductor":
        inductor = {**_mode_options(options.pop("mode"), given=bool(inductor)), **inductor}
    inductor = {**model_options, **inductor}
    if not on_cuda:  # a C++ wrapper around the CPU kernels: ~30 us less per call than the Python wrapper
        inductor = {"cpp_wrapper": True, **CPU_CODEGEN_WORKAROUNDS, **inductor}
    if inductor:
        options["options"] = inductor
    return options


def _check_backend(backend) -> None:
    """A backend name torch.compile knows, or a callable: checked when the Drafter is built (torch checks it only
    at the first draft). Dynamo is imported only for a name the caller gave."""
    if callable(backend) or backend == "inductor":
        return
    from torch._dynamo import list_backends

    names = list_backends(exclude_tags=())
    if not isinstance(backend, str) or backend not in names:
        raise ArgumentError(f"compile_options['backend'] must be a callable or one of {names}, got {backend!r}")


def _check_inductor_options(given: dict) -> None:
    """The caller's Inductor options checked by name and type when the Drafter is built, as torch.compile checks
    them at the first draft, naming the near names instead of listing all of Inductor's options."""
    if not given:
        return
    from torch._inductor import config

    known = config.get_config_copy()
    for key, value in given.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if name not in known:
            near = difflib.get_close_matches(str(name), list(known), n=3)
            raise ArgumentError(f"compile_options['options'] names no Inductor option {key!r}"
                                + (f" (close: {', '.join(near)})" if near else ""))
        kind = config.get_type(name)
        if get_origin(kind) is None and isinstance(kind, type) and not isinstance(value, kind):
            raise ArgumentError(f"compile_options['options'][{key!r}] must be a {kind.__name__}, got {value!r}")


def _mode_options(mode, given: bool) -> dict:
    """torch.compile's ``mode`` as the Inductor options it stands for (what Inductor applies it as): torch.compile
    takes a mode or options, not both, and the step always has options on CPU (and for a quantized model)."""
    if given:
        raise ArgumentError("compile_options: give 'mode' or 'options', not both (torch.compile takes one of them)")
    from torch._inductor import list_mode_options

    modes = list_mode_options()
    if not isinstance(mode, str) or mode not in modes:
        raise ArgumentError(f"compile_options['mode'] must be one of {sorted(modes)}, got {mode!r}")
    if modes[mode].get("triton.cudagraphs"):  # a replay overwrites the outputs the next depth reads
        raise ArgumentError(f"compile_options['mode'] {mode!r} turns on Inductor's CUDA graphs, which break chained "
                            f"depths (docs/compile.md §8): use the Drafter's own (cuda_graphs=True), and a mode "
                            f"without them")
    if modes[mode].get("use_post_grad_passes") is False:  # 'lite': little but eager fallbacks, and none of our passes
        raise ArgumentError(f"compile_options['mode'] {mode!r} turns off Inductor's post-grad passes, ours among them "
                            "(docs/compile.md §1): use compile=False for the eager steps, or another mode")
    return dict(modes[mode])


def decode_windows(num_speculative_tokens: int) -> tuple[int, int]:
    """Rows of a decode round's window: K after a rejection (re-run rows + verified rows), K + 1 when every draft
    was accepted (K = 1: one and two rows)."""
    return num_speculative_tokens, num_speculative_tokens + 1


@dataclass
class DraftResult:
    """What one drafting round returns (the one result type of :class:`DraftSource`)."""

    drafts: torch.Tensor  # [B, K] drafted token ids d_1..d_K
    draft_probs: torch.Tensor | None  # [B, K, V] the distribution each draft was sampled from; None when greedy
    hidden: torch.Tensor  # [B, H] the last depth's output at each sequence's last row

    @property
    def tokens(self) -> torch.Tensor:
        """[B] the first draft d_1 (with K = 1, the only one)."""
        return self.drafts[:, 0]

    @property
    def probs(self) -> torch.Tensor | None:
        """[B, V] the distribution d_1 was sampled from; None when greedy."""
        return None if self.draft_probs is None else self.draft_probs[:, 0]


@runtime_checkable
class DraftSource(Protocol):
    """What :func:`~inkling_compiled.runtime.speculative.speculative_generate` needs of a drafter (:class:`Drafter`
    is one; the tests' stand-ins are others).

    ``draft`` runs one round over rows [B, T] (row t: target hidden at ``positions[b, t]``, committed token at
    ``positions[b, t] + 1``; negative positions mark padding) and drafts ``num_speculative_tokens`` tokens after each
    sequence's last real row; ``draft_probs`` must be given when ``temperature > 0``. The loop validates its inputs
    up front against ``max_batch_size`` and ``max_length`` and then calls ``draft(..., validate=False)``. A drafter
    with a ``model`` attribute (an ``InklingMTP``) has its device, dtype, vocabulary and hidden size checked against
    the target too. A drafter other than :class:`Drafter` has every round's result checked: drafts [B, K] of ids in
    the target's vocabulary, and when sampling ``draft_probs`` [B, K, V]. Only multimodal prompts pass
    ``inputs_embeds`` (the rows in place of the tokens' embeddings, docs/model.md §7); text-only drafters may leave it
    out of their signature.
    """

    max_batch_size: int
    max_length: int
    num_speculative_tokens: int

    def draft(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, *,
              temperature: float = 0.0, generator: torch.Generator | None = None,
              validate: bool = True, inputs_embeds: torch.Tensor | None = None) -> DraftResult: ...


class CommittedRows:
    """The last K committed rows of each sequence (token, position, target hidden, and the row embedding a depth-0 call
    read there), for re-running stale rows.

    Stored by position modulo K, so running a round again with the same rows rewrites the same slots with the same
    values (idempotent, like the position-addressed cache; a CUDA-graph warm-up relies on it). Empty slots hold
    position -1. ``embeds`` is written and read by rounds given multimodal rows only (``Drafter.draft(...,
    inputs_embeds=...)``): a token round embeds its tokens itself.
    """

    def __init__(self, batch_size: int, size: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.size = size
        self.input_ids = torch.zeros(batch_size, size, dtype=torch.long, device=device)
        self.positions = torch.full((batch_size, size), -1, dtype=torch.long, device=device)
        self.hidden = torch.zeros(batch_size, size, hidden_size, dtype=dtype, device=device)
        self.embeds = torch.zeros(batch_size, size, hidden_size, dtype=dtype, device=device)

    def prepend(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The stored rows before the new ones (each sequence's K - 1 positions before its first new row; the others
        marked padding), followed by the new rows (and their embeddings, given ``embeds``)."""
        batch = positions.shape[0]
        stored = self.positions[:batch]
        first = torch.where(positions >= 0, positions, torch.iinfo(positions.dtype).max).amin(dim=1, keepdim=True)
        before = (stored < first) & (stored >= first - (self.size - 1))
        rows = (torch.cat([self.input_ids[:batch], input_ids], dim=1),
                torch.cat([torch.where(before, stored, -1), positions], dim=1),
                torch.cat([self.hidden[:batch], hidden], dim=1))
        return rows if embeds is None else (*rows, torch.cat([self.embeds[:batch], embeds], dim=1))

    def remember(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                 embeds: torch.Tensor | None = None) -> None:
        """Store the last K columns of a right-aligned window (>= K columns); sequences with no real row keep theirs."""
        batch, width = positions.shape
        last = positions[:, -1:]
        slots = torch.arange(self.size, device=positions.device)[None, :]
        column = width - self.size + (slots - last - 1) % self.size  # the column holding the position of each slot
        keep = last >= 0
        for stored, new in ((self.input_ids, input_ids), (self.positions, positions)):
            stored[:batch].copy_(torch.where(keep, new.gather(1, column), stored[:batch]))
        for stored, new in ((self.hidden, hidden), (self.embeds, embeds)):
            if new is not None:
                picked = new.gather(1, column[..., None].expand(-1, -1, new.shape[-1]))
                stored[:batch].copy_(torch.where(keep[..., None], picked, stored[:batch]))


class _BucketBuffers:
    """Static input buffers of one (batch bucket, rows, sampled) bucket and, on CUDA, its captured round."""

    def __init__(self, drafter: Drafter, batch: int, rows: int, sampled: bool):
        model, dev = drafter.model, drafter.model.device
        self.batch, self.rows, self.sampled = batch, rows, sampled
        self.input_ids = torch.zeros(batch, rows, dtype=torch.long, device=dev)
        self.positions = torch.full((batch, rows), -1, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(batch, rows, model.config.hidden_size, dtype=model.dtype, device=dev)
        vocab, depths = model.config.logits_vocab_size, drafter.num_speculative_tokens
        self.noise = torch.ones(depths, batch, vocab, dtype=torch.float32, device=dev) if sampled else None
        self.inv_temperature = torch.ones(batch, 1, dtype=torch.float32, device=dev) if sampled else None
        self.key = (batch, rows, sampled)
        self.compiled = False  # the round has run once for this bucket (compiled, and captured where it applies)
        self.written = (0, 0)  # (batch, rows) of the last call: the positions beyond it are padding (-1)
        self.embeds: torch.Tensor | None = None  # the rows of multimodal calls, allocated by the first one
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, ...] | None = None

    def args(self):
        base = (self.input_ids, self.positions, self.hidden)
        return base + (self.noise, self.inv_temperature) if self.sampled else base


def _weight_addresses(model: torch.nn.Module) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


def _check_model(model) -> None:
    if not isinstance(model, InklingMTP):
        raise ArgumentError(f"model must be an InklingMTP, got {type(model).__name__}")


def _check_num_speculative_tokens(value, loaded: int) -> int:
    if value is None:
        return loaded
    if not arguments.is_int(value) or not 1 <= value <= loaded:
        raise ArgumentError(f"num_speculative_tokens must be an int in [1, {loaded}] (the model has {loaded} loaded "
                            f"MTP depth(s); load more with from_pretrained(..., num_depths=...)), got {value!r}")
    return value


def _normal_state(method):
    """``method`` outside inference mode (under ``no_grad``) when called inside it: the cache and buffers a Drafter
    keeps are updated in place on every later call, which a tensor made under ``torch.inference_mode()`` refuses
    for good once outside it (a Drafter built or first used there then failed in its next call out of it)."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return method(*args, **kwargs)
    return run


class Drafter:
    """Drafts ``num_speculative_tokens`` tokens per round with depths 0..K-1 of ``model`` for up to
    ``max_batch_size`` sequences of up to ``max_length`` positions.

    ``num_speculative_tokens`` defaults to every loaded depth (load fewer with ``from_pretrained(...,
    num_depths=K)``, or pass K). ``compile=False`` runs the eager model (same buffers and
    results); ``cuda_graphs`` defaults to on for CUDA models; ``graph_rows`` (default: the decode windows K and
    K + 1) are the window sizes that get an exact bucket and, on CUDA, a captured graph.

    ``cached_rounds`` (default: on for K > 1 on CPU when compiling a model that can be packaged) runs each bucket's
    round packaged, built on the first call of its (batch bucket, greedy/sampled), one package for every window
    width, and cached on disk for every later drafter and process (``runtime/round_cache.py``, docs/compile.md
    §12.1); off, the round is K + 1 compiled calls, which on CPU cost Dynamo's guards and Python each. CUDA is
    unaffected: there a round is one CUDA graph.
    """

    @_normal_state
    def __init__(self, model: InklingMTP, max_batch_size: int, max_length: int, *,
                 num_speculative_tokens: int | None = None, compile: bool = True, cuda_graphs: bool | None = None,
                 batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS, graph_rows: tuple[int, ...] | None = None,
                 compile_options: dict | None = None, cached_rounds: bool | None = None):
        _check_model(model)
        model.check_parameters()
        arguments.check_bool("compile", compile)
        arguments.check_bool("cuda_graphs", cuda_graphs, optional=True)
        arguments.check_bool("cached_rounds", cached_rounds, optional=True)
        self.model = model
        self._quantization = model.quantization  # what the compiled and packaged steps are built for
        self._weights = _weight_addresses(model)  # ... and the tensors packaged rounds read (by address)
        # read-only (properties below): the cache, the buffers and the compiled round are sized by them
        self._num_speculative_tokens = _check_num_speculative_tokens(num_speculative_tokens, model.config.num_depths)
        self._max_batch_size = arguments.positive_int("max_batch_size", max_batch_size)
        self._max_length = arguments.positive_int("max_length", max_length)
        self.cache = model.new_cache(self.max_batch_size, self.max_length)
        # per sequence, the positions 0..n-1 validated calls wrote (None: unknown after an unchecked call), so that a
        # call skipping ahead of them is refused rather than read the stale slots in between
        self._written: list[int | None] = [0] * self.max_batch_size
        # K > 1, per sequence: the positions among the last K given as inputs_embeds rows (validated calls; None:
        # unknown), so that a sequence can switch between token and inputs_embeds calls (:meth:`_with_history`)
        self._given_rows: list[set[int] | None] = [set() for _ in range(self.max_batch_size)]
        k = self.num_speculative_tokens
        self.history = (CommittedRows(self.max_batch_size, k, model.config.hidden_size, model.dtype, model.device)
                        if k > 1 else None)
        self._last_drafts = (torch.zeros(self.max_batch_size, k, dtype=torch.long, device=model.device)  # validated
                             if k > 1 else None)
        buckets = arguments.size_tuple("batch_buckets", batch_buckets)
        if not buckets:
            raise ArgumentError(f"batch_buckets must name at least one batch size, got {batch_buckets!r}")
        self.batch_buckets = tuple(b for b in buckets if b < self.max_batch_size) + (self.max_batch_size,)
        self.graph_batch_limit = buckets[-1]
        self.graph_rows = decode_windows(k) if graph_rows is None else arguments.size_tuple("graph_rows", graph_rows)
        on_cuda = model.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ArgumentError(f"cuda_graphs=True needs a CUDA model; this one is on {model.device}")
        if cuda_graphs and not compile:  # the eager step is not captured
            raise ArgumentError("cuda_graphs=True needs compile=True")
        self.cuda_graphs = on_cuda and compile if cuda_graphs is None else cuda_graphs
        options = _compile_options(compile_options, on_cuda, fast_inductor_options(model))
        # Inductor freezes only what Dynamo traced as constants: prepare_freezing, around our own compiles only.
        self._freezing = bool(options.get("options", {}).get("freezing"))
        self._compile_options = options if compile else None
        self._inductor_options = options.get("options", {})
        self._shapes: dict[tuple[int, int, bool], _BucketBuffers] = {}
        self._packaged: dict[tuple[int, int, bool], functools.partial] = {}  # bucket key -> its packaged round
        self._unpackaged: set[tuple[int, bool]] = set()  # (batch bucket, sampled) whose cached round failed
        self._pool = None
        scheme = model.quantization.scheme if model.quantization is not None else ""
        packable = compile and not on_cuda and not self._freezing and not scheme.startswith("torchao:")
        if cached_rounds and not packable:
            raise ArgumentError(
                "cached_rounds=True needs compile=True, a CPU model, and one that can be packaged (no Inductor "
                f"freezing, no torchao scheme); got compile={compile}, {model.device}, freezing={self._freezing}, "
                f"quantization {scheme or None!r}")
        self.cached_rounds = packable and k > 1 if cached_rounds is None else cached_rounds

    def _compiled(self, fn):
        return fn if self._compile_options is None else torch.compile(fn, **self._compile_options)

    # wrapped on first use: a drafter whose buckets are all packaged never imports Dynamo for them
    @functools.cached_property
    def _window_step(self):
        return self._compiled(self._window)

    @functools.cached_property
    def _depth_step(self):
        return self._compiled(self._depth)

    @functools.cached_property
    def _compiled_round(self):
        """The round of the compiled (or eager) steps: every depth runs the one step of its geometry."""
        depths = [functools.partial(self._depth_step, self.model.layers[k], self.cache.depths[k])
                  for k in range(self.num_speculative_tokens)]
        return functools.partial(self._round, self._window_step, depths)

    # -- the round: a compiled prologue, then one compiled step per depth (traced; our Inductor passes apply) ------

    def _window(self, input_ids, positions, hidden, embeds=None):
        """K > 1: the stored rows the round re-runs, then the new rows, each sequence right-aligned (padding -1
        first, then positions ascending) in the bucket's width; with ``embeds`` (multimodal rows) their rows too."""
        width = positions.shape[1]
        rows = self.history.prepend(input_ids, positions, hidden, embeds)
        order = rows[1].argsort(dim=1, stable=True)[:, -width:]  # padding is -1: it sorts first
        rows = tuple(t.gather(1, order if t.dim() == 2 else order[..., None].expand(-1, -1, t.shape[-1]))
                     for t in rows)
        self.history.remember(*rows)
        return rows

    def _depth(self, layer, depth_cache, input_ids, positions, previous, noise=None, inv_temperature=None,
               embeds=None):
        """One depth over the rows (negative positions: padding); its draft from each sequence's last real row; the
        next depth's tokens (shifted one left, the draft after the last real row's token).

        ``embeds`` (multimodal rows, docs/model.md §7) replaces the embedding of ``input_ids``; the next depth's rows
        are then returned too, shifted like the tokens, the draft's embedding after the last real row.

        Padding rows pass zeros on: a padding row of a sliding depth sees no key (its softmax is NaN), and the next
        depth would write what it computes from that into its scratch slot, which full-attention rows read with
        probability 0 (0 * NaN = NaN)."""
        real = positions >= 0
        slots = torch.where(real, positions, self.cache.pad_position)
        rows = self.model.embed_tokens(input_ids, validate=False) if embeds is None else embeds
        hidden = self.model.run_layer(layer, rows, previous, slots, depth_cache)
        hidden = torch.where(real[..., None], hidden, 0.0)
        last_column = (torch.arange(positions.shape[1], device=positions.device) * real).amax(dim=1, keepdim=True)
        last = hidden.gather(1, last_column[..., None].expand(-1, -1, hidden.shape[-1])).squeeze(1)
        if noise is None:
            draft, probs = self.model.get_top_tokens(last, validate=False), None
        else:
            probs = torch.softmax(self.model.compute_logits(last, validate=False).float() * inv_temperature, dim=-1)
            draft = (probs / noise).argmax(dim=-1)
        next_ids = input_ids.roll(-1, dims=1).scatter(1, last_column, draft[:, None])
        outputs = (hidden, last, draft, next_ids) + ((probs,) if noise is not None else ())
        if embeds is None:
            return outputs
        draft_rows = self.model.embed_tokens(draft[:, None], validate=False)
        return outputs + (embeds.roll(-1, dims=1).scatter(1, last_column[..., None].expand_as(draft_rows), draft_rows),)

    def _round(self, window, depths, input_ids, positions, hidden, noise=None, inv_temperature=None, embeds=None):
        """The prologue (K > 1), then depth k = 0..K-1 by ``depths[k](input_ids, positions, hidden[, noise_k,
        inv_temperature])``: the compiled steps (:attr:`_compiled_round`) or packaged ones (:meth:`load_compiled`).
        ``embeds``: multimodal rows in place of the tokens' embeddings (the compiled steps only)."""
        rows = () if embeds is None else (embeds,)
        if self.history is not None:  # K = 1 re-runs nothing
            input_ids, positions, hidden, *rows = window(input_ids, positions, hidden, *rows)
        drafts, probs = [], []
        for k, depth in enumerate(depths):
            sampling = () if noise is None else (noise[k], inv_temperature)
            extra = {} if not rows else {"embeds": rows[0]}
            hidden, last, draft, input_ids, *rest = depth(input_ids, positions, hidden, *sampling, **extra)
            if rows:
                rows = (rest.pop(),)
            drafts.append(draft)
            probs += rest
        outputs = (torch.stack(drafts, dim=1), last)
        return outputs + (torch.stack(probs, dim=1),) if noise is not None else outputs

    # -- public API ---------------------------------------------------------------------------------------------

    @_normal_state
    def draft(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, *,
              temperature: float = 0.0, generator: torch.Generator | None = None,
              validate: bool = True, inputs_embeds: torch.Tensor | None = None) -> DraftResult:
        """Run the round over rows [B, T] and draft K tokens after each sequence's last real row.

        Row t of sequence b is (target hidden at ``positions[b, t]``, committed token at ``positions[b, t] + 1``);
        negative positions mark padding rows, which may sit anywhere (left or right padding); the real rows of a
        sequence are consecutive positions. While decoding, pass the rows verified since the last call; the drafter
        re-runs stale rows itself (docs/protocol.md §6.5): an unchecked call those the loop's contract leaves stale
        (new rows led by the last call's accepted drafts), a validated one every row that read a draft, so a prompt
        may come in chunks and token and ``inputs_embeds`` calls may alternate. ``validate`` checks every argument
        (:meth:`check`: two host syncs, three for new rows past a sequence's first); callers that validated at their
        own boundary pass ``validate=False``, and then nothing is checked at all.

        ``inputs_embeds`` [B, T, H] (multimodal prompts, docs/model.md §7): row t's input row in place of the
        embedding of ``input_ids[:, t]``, i.e. the target's merged row of position ``positions[b, t] + 1`` (already
        backbone-normed text rows, tower rows as the target saw them); deeper depths read them shifted like the
        tokens. Such calls run the compiled (or eager) steps without CUDA graphs, one graph per bucket whatever the
        prompt (a packaged drafter compiles them on first use).
        """
        spans, given_rows = None, inputs_embeds is not None
        if validate is not False:  # the loop's hot path passes False: anything else is checked, itself included
            arguments.check_bool("validate", validate)
            spans = self._checked_spans(input_ids, positions, hidden, inputs_embeds, temperature, generator)
            if self.history is not None:
                input_ids, positions, hidden, inputs_embeds = self._with_history(input_ids, positions, hidden,
                                                                                 inputs_embeds, spans)
        self._remember_spans(spans, given_rows, positions.shape[0])
        batch, rows = positions.shape
        shape = self._shape(batch, rows, temperature > 0)
        exact = batch == shape.batch and rows == shape.rows  # no padding: skip the slicing (it costs per call)
        for buffer, value in zip(shape.args(), (input_ids, positions, hidden)):  # inference state: no autograd history
            (buffer if exact else buffer[:batch, -rows:]).copy_(value.detach())
        if shape.sampled:
            shape.noise.exponential_(generator=generator)
            shape.inv_temperature.fill_(1.0 / temperature)
        if inputs_embeds is not None:
            outputs = self._draft_rows(shape, batch, rows, inputs_embeds)
        else:
            outputs = self._execute(shape)
            if shape.graph is not None:  # graph outputs live in the pool and are overwritten by the next replay
                outputs = [t[:batch].clone() for t in outputs]
            elif not exact:  # freshly allocated by the compiled step: views are safe to keep
                outputs = [t[:batch] for t in outputs]
        if spans is not None and self.history is not None:  # what the next validated call's rows are checked against
            self._last_drafts[:batch].copy_(outputs[0])
        return DraftResult(drafts=outputs[0], draft_probs=outputs[2] if shape.sampled else None, hidden=outputs[1])

    def _draft_rows(self, shape: _BucketBuffers, batch: int, rows: int, inputs_embeds: torch.Tensor) -> list:
        """A round over multimodal rows: the bucket's buffers plus its row buffer, through the compiled steps."""
        if shape.embeds is None:
            shape.embeds = torch.zeros_like(shape.hidden)
        shape.embeds.zero_()
        shape.embeds[:batch, -rows:].copy_(inputs_embeds.detach())
        with torch.no_grad(), self._first_call_config():
            outputs = self._compiled_round(*shape.args(), embeds=shape.embeds)
        return [t[:batch] for t in outputs]

    @_normal_state
    def check(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
              inputs_embeds: torch.Tensor | None = None) -> None:
        """ArgumentError naming the problem for a bad batch, shape, id, position or value, or for a sequence whose
        new rows start past the positions earlier validated calls wrote (two host syncs)."""
        self._checked_spans(input_ids, positions, hidden, inputs_embeds)

    def _checked_spans(self, input_ids, positions, hidden, inputs_embeds, temperature=0.0,
                       generator=None) -> list[tuple[int, int]]:
        """:meth:`check` (and the sampling arguments), then each sequence's first and last real position. A
        tensor-parallel model's ranks compare what they were given, and this drafter's K and cache, in one exchange
        after every check (:meth:`TensorParallel.agree`): a refusal on one rank is then one on every rank."""
        if self.model.parallel is None:
            return self._spans_here(input_ids, positions, hidden, inputs_embeds, temperature, generator)[0]

        def run():
            spans, ids, positions64 = self._spans_here(input_ids, positions, hidden, inputs_embeds, temperature,
                                                       generator)
            real = positions64 >= 0
            state = generator.get_state() if generator is not None else torch.zeros(0, dtype=torch.uint8)
            return spans, {**validation.input_fields(ids, positions64, hidden, self.cache, 0, None, drafting=True),
                           "num_speculative_tokens": self.num_speculative_tokens,
                           CHECKSUM + "inputs_embeds": 0 if inputs_embeds is None else checksum(
                               inputs_embeds.where(real[..., None], 0)),
                           CHECKSUM + "temperature": checksum(torch.tensor(float(temperature), dtype=torch.float64)),
                           CHECKSUM + "the generator's state": checksum(state)}
        return self.model.parallel.agree("the draft's inputs", DRAFT_FIELDS, run, fix=validation.SAME_INPUTS)

    def _spans_here(self, input_ids, positions, hidden, inputs_embeds, temperature, generator):
        """:meth:`_checked_spans` on this rank alone: (spans, input_ids and positions as int64)."""
        if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
            got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise ArgumentError(f"positions must be a [batch, rows] tensor, got {got}")
        batch = positions.shape[0]
        if batch > self.max_batch_size:
            raise ArgumentError(f"positions: a batch of {batch} sequences exceeds the drafter's max_batch_size "
                                f"{self.max_batch_size}")
        self.check_model_unchanged()
        if input_ids is None:  # the model's own check would ask for exactly one of the two
            raise ArgumentError("input_ids are needed (also when inputs_embeds is given): each depth's rows pass "
                                "their tokens on, shifted, to the next depth")
        input_ids, positions = validation.checked_inputs_here(self.model, input_ids, positions, hidden, self.cache, 0,
                                                              None, drafting=True)  # as int64
        if inputs_embeds is not None and (not isinstance(inputs_embeds, torch.Tensor)
                                          or inputs_embeds.shape != hidden.shape
                                          or inputs_embeds.dtype != self.model.dtype
                                          or inputs_embeds.device != self.model.device):
            got = (tuple(inputs_embeds.shape), inputs_embeds.dtype, str(inputs_embeds.device)) \
                if isinstance(inputs_embeds, torch.Tensor) else type(inputs_embeds).__name__
            raise ArgumentError(f"inputs_embeds must be a {self.model.dtype} tensor on {self.model.device} shaped like "
                                f"hidden {tuple(hidden.shape)}, got {got}")
        real = positions >= 0
        none, k = torch.iinfo(torch.long).max, self.num_speculative_tokens
        stats = [positions.masked_fill(~real, none).amin(dim=1), positions.masked_fill(~real, -1).amax(dim=1)]
        if inputs_embeds is not None:  # [B]: real rows holding a NaN or inf
            stats.append((real & ~inputs_embeds.isfinite().all(dim=-1)).sum(dim=1))
        firsts, lasts, *nonfinite = torch.stack(stats).tolist()  # the second host sync
        for b, (first, written) in enumerate(zip(firsts, self._written)):
            if nonfinite and nonfinite[0][b]:
                raise ArgumentError(f"inputs_embeds holds a NaN or inf in a real row of sequence {b}: the inputs of "
                                    "real rows must be finite")
            if written is not None and first > written:
                held = f"positions 0..{written - 1}" if written else "no position"
                raise ArgumentError(f"sequence {b}: its rows start at position {first}, but this Drafter holds {held} "
                                    f"of it: the rows of positions {written}..{first - 1} are missing (pass every row "
                                    "verified since the last call, or start a new sequence at position 0)")
            if written is not None and k > 1 and 0 < first < written - 1:
                raise ArgumentError(f"sequence {b}: its rows start at position {first}, but a K = {k} drafter re-runs "
                                    f"the {k - 1} rows before a call's first row from the last {k} it was given, which "
                                    f"end at position {written - 1}: start at {written - 1} or {written} (or at 0, a "
                                    "new sequence)")
        arguments.temperature(temperature)
        arguments.generator(generator, self.model.device)
        return list(zip(firsts, lasts)), input_ids, positions

    def _with_history(self, input_ids, positions, hidden, inputs_embeds, spans: list[tuple[int, int]]):
        """A validated K > 1 call, with each continuing sequence's K - 1 rows before its first prepended from the
        history where the window alone would re-run too few. The window re-runs the rows the loop's contract leaves
        stale: new rows led by the last call's accepted drafts. Other rows (a prompt in chunks, a rewind) left deeper
        depths reading drafts. And the history holds row embeddings only where rows were given as ``inputs_embeds``
        (a token round embeds its tokens inside its step): a call re-running given rows (tower rows, say) runs on its
        tokens' embeddings as an ``inputs_embeds`` call, and before such a call the stored token rows get theirs."""
        k, batch, input_ids = self.num_speculative_tokens, len(spans), input_ids.long()
        given = [g or set() for g in self._given_rows[:batch]]
        known = [written is not None and first > 0 for (first, _), written in zip(spans, self._written)]
        # the stored rows before each first, any of which may be re-run (the window fills its bucket with them)
        stored = [range(max(0, written - k), first) if known[b] else range(0)
                  for b, ((first, _), written) in enumerate(zip(spans, self._written))]
        rows_call, needs, leads = inputs_embeds is not None, [], []
        for b, ((first, last), written) in enumerate(zip(spans, self._written)):
            mixed = any((p in given[b]) != rows_call for p in stored[b])
            # a row call's lead rows would have to be the drafts' embeddings: checked by re-running them instead
            needs.append(known[b] and (first < written or mixed or last - first > k or rows_call and last > first))
            if known[b] and not needs[b] and last > first:
                leads.append(b)
        redo = any(needs)
        if leads and not redo:  # the contract: each lead's first rows carry the last call's drafts
            offset = positions.long() - torch.tensor([first for first, _ in spans], device=positions.device)[:, None]
            lead = (positions >= 0) & (offset < torch.tensor([last - first for _, last in spans],
                                                             device=positions.device)[:, None])
            drafted = self._last_drafts[:batch].gather(1, offset.clamp(0, k - 1))
            broken = (lead & (input_ids != drafted)).any(dim=1).tolist()  # a host sync
            redo = any(broken[b] for b in leads)
        if not redo:
            return input_ids, positions, hidden, inputs_embeds
        count = max(min(first, k - 1) if known[b] else 0 for b, (first, _) in enumerate(spans))
        layout = [[p if known[b] and p >= max(0, first - (k - 1)) else -1 for p in range(first - count, first)]
                  for b, (first, _) in enumerate(spans)]
        before = torch.tensor(layout, device=positions.device)
        seq, slot = torch.arange(batch, device=before.device)[:, None], before.clamp(min=0) % k  # slot: position mod K
        if inputs_embeds is None and any(p in g for rows, g in zip(stored, given) for p in rows):
            inputs_embeds = self.model.embed_tokens(input_ids, validate=False).detach()
        if inputs_embeds is not None:  # every stored row given as tokens, the ones the window adds too
            text = [(b, p % k) for b, (g, written) in enumerate(zip(given, self._written[:batch])) if written
                    for p in range(max(0, written - k), written) if p not in g]
            if text:
                b, j = torch.tensor(text, device=before.device).T
                embedded = self.model.embed_tokens(self.history.input_ids[b, j], validate=False)
                self.history.embeds[b, j] = embedded.detach()
            inputs_embeds = torch.cat([self.history.embeds[seq, slot], inputs_embeds], dim=1)
        prepended = (self.history.input_ids[seq, slot], before, self.history.hidden[seq, slot])
        return (*(torch.cat([old, new], dim=1) for old, new in zip(prepended, (input_ids, positions.long(), hidden))),
                inputs_embeds)

    def _remember_spans(self, spans: list[tuple[int, int]] | None, given_rows: bool, batch: int) -> None:
        """What a call of ``batch`` sequences leaves written per sequence (:attr:`_written`, :attr:`_given_rows`); an
        unchecked call's positions are not known here: its sequences' become unknown."""
        if spans is None:
            self._written[:batch] = [None] * batch
            self._given_rows[:batch] = [None] * batch
            return
        size = self.history.size if self.history is not None else 1
        for b, (first, last) in enumerate(spans):
            kept = {p for p in self._given_rows[b] or () if last - size < p < first}
            self._given_rows[b] = kept | (set(range(max(first, last - size + 1), last + 1)) if given_rows else set())
            self._written[b] = last + 1

    def check_model_unchanged(self) -> None:
        """ValueError when the model was converted (``.to``, ``.half``, ...) after this Drafter built its cache and
        buffers for it: they would meet the new dtype or device inside the first kernel. Also when it was quantized
        (``quantize_``) or its parameters replaced since, unless the Drafter is eager with nothing packaged: packaged
        rounds and captured graphs would keep reading the replaced weights, and the compile options were chosen for
        the old ones."""
        cache = self.cache.depths[0].k
        if (cache.dtype, cache.device) != (self.model.dtype, self.model.device):
            validation.check_parameters(self.model)  # the target converted alone: its shared tensors, not the MTP
            raise ValueError(f"the model is now {self.model.dtype} on {self.model.device}, but this Drafter was built "
                             f"for it as {cache.dtype} on {cache.device}: build a new Drafter after moving the model")
        follows_the_model = self._compile_options is None and not self._packaged  # eager, nothing packaged
        if self.model.quantization is not self._quantization and not follows_the_model:
            now, then = ("none" if q is None else f"{q.scheme} head={q.head}"
                         for q in (self.model.quantization, self._quantization))
            raise ValueError(f"the model's quantization is now {now}, but this Drafter was built for it with {then}: "
                             "its compiled or packaged steps were made for the weights it had then; build a new "
                             "Drafter after quantizing the model")
        if _weight_addresses(self.model) != self._weights and not follows_the_model:
            raise ValueError("the model's parameters were replaced (load_state_dict(assign=True), say) after this "
                             "Drafter was built: its compiled or packaged steps read the tensors it had then; build a "
                             "new Drafter (an in-place update, load_state_dict's default, is seen)")

    @_normal_state
    def capture(self, batch_sizes: tuple[int, ...] | None = None, temperature: float = 0.0) -> float:
        """Compile and (on CUDA) capture every graph bucket for ``batch_sizes`` now; returns the seconds it took.

        Each bucket runs on the inputs its last call left in its buffers, which rewrites cache and history slots of
        the sequences in progress in those buckets: they end here (a validated call refuses to continue one; start
        again at 0)."""
        batch_sizes = self.batch_buckets if batch_sizes is None else arguments.size_tuple("batch_sizes", batch_sizes)
        if batch_sizes and batch_sizes[-1] > self.max_batch_size:
            raise ArgumentError(f"batch_sizes must be at most the drafter's max_batch_size {self.max_batch_size}, "
                                f"got {batch_sizes}")
        arguments.temperature(temperature)
        self.check_model_unchanged()
        start = time.perf_counter()
        for batch in batch_sizes:
            for rows in self.graph_rows:
                self._execute(self._shape(batch, rows, temperature > 0))
        touched = max((self.bucket(batch, 1)[0] for batch in batch_sizes), default=0)
        self._written[:touched] = [0] * touched  # each bucket re-ran its last inputs: its sequences start over
        self._given_rows[:touched] = [set() for _ in range(touched)]
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def bucket(self, batch: int, rows: int) -> tuple[int, int]:
        """The padded (batch, window rows) a call of ``rows`` new rows runs as (the window has at least K rows)."""
        batch = arguments.integer("batch", batch, minimum=1, maximum=self.max_batch_size)
        rows = arguments.positive_int("rows", rows)
        padded_batch = next(b for b in self.batch_buckets if b >= batch)  # the last is max_batch_size
        window = max(rows, self.num_speculative_tokens)
        padded_rows = window if window in self.graph_rows else 1 << (window - 1).bit_length()
        return padded_batch, padded_rows

    @_normal_state
    def static_step(self, batch: int, rows: int):
        """The greedy step bound to the static buffers of the (batch, rows) shape, as a no-argument callable: the
        compiled graph alone, without ``draft``'s input copies and output handling (what a benchmark sets it
        against; the packaged round for a packaged bucket). The buffers hold the inputs of the last ``draft`` call of
        that shape."""
        self.check_model_unchanged()
        shape = self._shape(batch, rows, False)
        return functools.partial(self._round_of(shape), *shape.args())

    def uses_graph(self, batch: int, rows: int) -> bool:
        padded_batch, padded_rows = self.bucket(batch, rows)
        return self.cuda_graphs and padded_batch <= self.graph_batch_limit and padded_rows in self.graph_rows

    # -- packaged rounds (runtime/packaged.py): AOTInductor ahead of time, no Dynamo at call time -------------------

    @_normal_state
    def save_compiled(self, directory, batch_sizes: tuple[int, ...] | None = None, rows: tuple[int, ...] | None = None,
                      *, sampled: bool = False) -> Path:
        """Package the round of every bucket that calls of ``batch_sizes`` (default: every batch bucket) x ``rows``
        new rows (default: ``graph_rows``) run as, greedy (and sampled with ``sampled=True``), into the new
        ``directory``: per bucket the prologue (K > 1) and one step per depth geometry, which every depth of that
        geometry runs over its own parameters and cache (:func:`packaged.save_rounds`, docs/compile.md §12).

        The package holds code only (no weights, no cache) and records what it was built for; see
        :meth:`load_compiled`. Each step is one AOTInductor compile (seconds to a minute on a small CPU)."""
        directory = arguments.path("directory", directory)
        batch_sizes = self.batch_buckets if batch_sizes is None else arguments.size_tuple("batch_sizes", batch_sizes)
        rows = self.graph_rows if rows is None else arguments.size_tuple("rows", rows)
        for name, sizes in (("batch_sizes", batch_sizes), ("rows", rows)):
            if not sizes:  # a package of no bucket, which load_compiled would take and never use
                raise ArgumentError(f"save_compiled: {name} must name at least one size, got ()")
        if batch_sizes[-1] > self.max_batch_size:
            raise ArgumentError(f"batch_sizes must be at most the drafter's max_batch_size {self.max_batch_size}, "
                                f"got {batch_sizes}")
        if rows[-1] > self.max_length:  # a step no call can use, compiled for minutes
            raise ArgumentError(f"rows must be at most the drafter's max_length {self.max_length}, got {rows}")
        arguments.check_bool("sampled", sampled)
        self.check_model_unchanged()
        keys = sorted({(*self.bucket(b, r), s) for b in batch_sizes for r in rows for s in {False, sampled}})
        return packaged.save_rounds(self, directory, [_BucketBuffers(self, *key) for key in keys])

    @classmethod
    def load_compiled(cls, directory, model: InklingMTP, *, num_speculative_tokens: int | None = None,
                      fallback: bool = False, compile: bool = True, cuda_graphs: bool | None = None,
                      compile_options: dict | None = None) -> Drafter:
        """A drafter for ``model`` with the geometry and K the package was saved with, whose packaged buckets run the
        package's steps over ``model``'s own parameters and the drafter's cache (:func:`packaged.load_rounds`); other
        buckets run as a Drafter built with ``compile`` / ``cuda_graphs`` / ``compile_options`` runs them.

        A missing or damaged package is a ``PackageError``. One built for another config, dtype, quantization, K
        (``num_speculative_tokens``, default: the package's), device, torch or pass version is a ``PackageMismatch``
        naming what differs, or with ``fallback=True`` a warning, and every bucket then runs the usual step
        (``torch.compile`` by default)."""
        directory = arguments.path("directory", directory)
        _check_model(model)
        arguments.check_bool("fallback", fallback)
        if num_speculative_tokens is not None:
            _check_num_speculative_tokens(num_speculative_tokens, model.config.num_depths)
        manifest = packaged.read_manifest(directory, layout_fields=packaged.LAYOUT_FIELDS)
        k = manifest["built_for"]["num_speculative_tokens"] if num_speculative_tokens is None \
            else num_speculative_tokens
        if k > model.config.num_depths:  # the package's K, which the caller did not pass: named as the package's
            raise ArgumentError(f"the package {str(directory)!r} drafts K = {k}, but the model has "
                                f"{model.config.num_depths} loaded MTP depth(s): load more with from_pretrained(..., "
                                f"num_depths={k}), or pass num_speculative_tokens <= {model.config.num_depths}")
        inductor = _compile_options(compile_options, model.device.type == "cuda", fast_inductor_options(model))
        matches = packaged.matches(directory, manifest, packaged.built_for(model, inductor.get("options", {}), k),
                                   fallback=fallback)
        packaged.check_cache_size(directory, manifest)
        layout = manifest["layout"]
        drafter = cls(model, layout["max_batch_size"], layout["max_length"], num_speculative_tokens=k,
                      compile=compile, cuda_graphs=cuda_graphs, batch_buckets=layout["batch_buckets"],
                      graph_rows=layout["graph_rows"], compile_options=compile_options)
        if matches:
            drafter._packaged.update(packaged.load_rounds(drafter, directory, manifest))
        return drafter

    @property
    def num_speculative_tokens(self) -> int:
        """K: the drafts of one :meth:`draft` call (read-only: the buffers and compiled rounds are built for it)."""
        return self._num_speculative_tokens

    @property
    def max_batch_size(self) -> int:
        """The most rows one call takes (the draft cache is allocated for them)."""
        return self._max_batch_size

    @property
    def max_length(self) -> int:
        """The positions the draft cache holds per row; a position >= it is refused."""
        return self._max_length

    @property
    def packaged_buckets(self) -> tuple[tuple[int, int, bool], ...]:
        """The (batch bucket, rows, sampled) buckets that run a packaged round (:meth:`load_compiled`, or from the
        round cache: every width its entry serves, once one of them has run)."""
        return tuple(self._packaged)

    def _round_of(self, shape: _BucketBuffers):
        """The round a bucket runs: its packaged round, else the compiled (or eager) one."""
        return self._packaged.get(shape.key) or self._compiled_round

    # -- buckets, compilation, graphs ---------------------------------------------------------------------------

    def _shape(self, batch: int, rows: int, sampled: bool) -> _BucketBuffers:
        shape = self._shapes.get((batch, rows, sampled))  # calls of a bucket's exact size: one dict lookup
        if shape is None:
            key = (*self.bucket(batch, rows), sampled)
            shape = self._shapes.get(key) or _BucketBuffers(self, *key)
            self._shapes[key] = self._shapes[(batch, rows, sampled)] = shape
        if batch < shape.written[0] or rows < shape.written[1]:  # stale real rows would sit in this call's padding
            shape.positions.fill_(-1)
        shape.written = (batch, rows)
        return shape

    def _execute(self, shape: _BucketBuffers) -> tuple[torch.Tensor, ...]:
        if shape.graph is not None:
            shape.graph.replay()
            return shape.outputs
        if not shape.compiled and self.cached_rounds and shape.key not in self._packaged:
            # every width of the bucket's entry at once; {}: the cache is off, or the build failed (warned)
            for key, found in round_cache.cached_rounds(self, shape).items():
                self._packaged.setdefault(key, found)  # a round load_compiled gave stays
        step = self._round_of(shape)
        if shape.compiled or shape.key in self._packaged:  # the hot path: no config patching, which costs more than
            with torch.no_grad():                           # a tiny step (and a packaged round never needs it)
                outputs = step(*shape.args())
                if not shape.compiled and self.uses_graph(shape.batch, shape.rows):
                    outputs = self._capture(shape, step)
            shape.compiled = True
            return outputs
        with torch.no_grad(), self._first_call_config():
            outputs = step(*shape.args())
            if self.uses_graph(shape.batch, shape.rows):
                outputs = self._capture(shape, step)
        shape.compiled = True
        return outputs

    def _first_call_config(self) -> contextlib.ExitStack:
        """The settings of a bucket's first call (its compiles), and only of it. With freezing, Dynamo must trace
        the weights as constants (``prepare_freezing``) and guard on which tensors they are, and it installs those
        guards only while Inductor's *global* ``freezing`` flag is on: without them the depth step compiled with
        depth 0's weights in its code would run for every later depth of the same geometry (wrong drafts, no
        error). With them each depth compiles its own step (docs/compile.md §11)."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT,
                                                       prepare_freezing=self._freezing))
        if self._freezing:
            stack.enter_context(torch._inductor.config.patch(freezing=True))
        return stack

    def _capture(self, shape: _BucketBuffers, step) -> tuple[torch.Tensor, ...]:
        """Warm up on a side stream, then capture the whole round ``step`` (prologue and every depth's compiled step)
        on the shared pool. Running a round again with the same inputs rewrites the same cache and history slots with
        the same values, so the warm-up, the capture and the first replay leave the state as one call would."""
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
