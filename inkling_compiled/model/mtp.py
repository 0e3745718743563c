"""The MTP depth layer and ``InklingMTP``, the public draft head (docs/model.md §4, §5; docs/architecture.md §3).

Depth k at row t reads (previous hidden g^{k-1}_t, token x_{t+k+1}) at the target's absolute position t and returns
its raw block output g^k_t, which is both the next depth's hidden and (divided by muP) the shared LM head's input.
The embedding table, the backbone ``embed_norm`` and the LM head belong to the target and are shared, never copied.
"""

from __future__ import annotations

import os
import weakref

import torch
from torch import nn

from .. import arguments
from ..arguments import ArgumentError
from ..checkpoint.layout import SHARED_KEYS, CheckpointError
from ..checkpoint.reader import open_checkpoint
from ..checkpoint.writer import save_checkpoint
from ..config import DepthGeometry, MTPConfig
from . import int8, torchao_schemes, validation
from .block import DecoderBlock
from .cache import DepthCache, MTPCache
from .depth_input import concat_normed, normed_embedding
from .head import mup_logits
from .int8 import Int8Linear, Quantization
from .norm import RMSNorm
from .tensor_parallel import TensorParallel


class MTPDepth(nn.Module):
    """hidden_norm / embed_norm / concat / input_proj (2H -> H) / one decoder block (docs/model.md §4.4-4.5)."""

    def __init__(self, config: MTPConfig, geometry: DepthGeometry):
        super().__init__()
        self.eps, self.hidden_first = config.rms_norm_eps, config.hidden_states_first
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.transformer_block = DecoderBlock(config, geometry)

    def forward(self, embeds: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor,
                cache: DepthCache | None = None) -> torch.Tensor:
        x = concat_normed(previous_hidden, embeds, self.hidden_norm.weight, self.embed_norm.weight, self.eps,
                          self.hidden_first)
        return self.transformer_block(self.input_proj(x), positions, cache)


class InklingMTP(nn.Module):
    """Inkling's multi-token-prediction draft head: any number of depths over the target's shared tensors."""

    SHARED = tuple(SHARED_KEYS)  # the target's tensors (docs/model.md §3.1)
    _target_ref: weakref.ref | None = None  # the module whose own Parameters fill SHARED (loaded with `target=`)

    def __init__(self, config: MTPConfig, parallel: TensorParallel | None = None):
        super().__init__()
        self.config = config
        # Tensor parallelism (docs/model.md §11): the depths and the cache are built with this rank's share of the
        # heads and MLP channels, the LM head holds this rank's vocab rows.
        self.parallel = parallel
        self.local_config = parallel.local_config(config) if parallel is not None else config
        h, v = config.hidden_size, config.vocab_size
        self.layers = nn.ModuleList(MTPDepth(self.local_config, g) for g in self.local_config.depths)
        if parallel is not None:
            parallel.parallelize(self.layers)
        self.chain_norm = RMSNorm(h, config.rms_norm_eps) if config.chain_hidden_post_norm else None
        # Shared with the target (docs/model.md §3.1): replaced by the target's own Parameters when loaded with
        # `target=`.
        self.embed_weight = nn.Parameter(torch.zeros(v, h))
        self.embed_norm_weight = nn.Parameter(torch.ones(h)) if config.use_embed_norm else None
        self.lm_head_weight = nn.Parameter(torch.zeros(v if parallel is None else v // parallel.world_size, h))
        # Set by quantize_(): a draft-only int8 copy of the head's first logits_vocab_size rows, 1/muP in its scales.
        self.quantized_head: Int8Linear | None = None
        self.quantization: Quantization | None = None

    # -- public API (docs/architecture.md §3) --------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None, target: nn.Module | None = None,
                        num_depths: int | None = None, mtp_log_scaling: bool = False,
                        progress: bool | None = None, quantize: str | None = None,
                        quantize_head: bool = True, device_mesh=None) -> InklingMTP:
        """Load from a raw Inkling checkpoint directory (eval mode, no autograd on its own weights).

        ``dtype`` defaults to the stored MTP dtype (or the target's), ``device`` to CPU (or the target's). ``target``
        (a transformers ``InklingForCausalLM`` / ``InklingForConditionalGeneration``) lends its embedding table,
        embed_norm and LM head as the very same Parameters. ``num_depths`` loads only the first depths (vLLM loads
        min(depths, speculative tokens)). Every mismatch between config and files is reported at once; see
        :func:`inkling_compiled.checkpoint.reader.open_checkpoint`. ``quantize="int8"`` quantizes the loaded model with
        :meth:`quantize_` (``head=quantize_head``); ``dtype`` then defaults to bfloat16 (without a target).
        ``device_mesh`` (a 1-D ``torch.distributed`` DeviceMesh, every rank calling) loads this rank's shards only
        (docs/model.md §11); with ``target`` the LM-head shard is a view of the target's own head.
        """
        parallel = TensorParallel.from_mesh(device_mesh) if device_mesh is not None else None
        if quantize is not None and dtype is None and target is None:
            dtype = int8.ACTIVATION_DTYPE

        def read():  # every check in here: on a tensor-parallel rank, a refusal is one on every rank
            if parallel is not None and quantize is not None:
                raise ArgumentError(f"quantize={quantize!r} with device_mesh=: quantized tensor-parallel models are "
                                    "not supported; load unquantized, or without a mesh")
            arguments.check_bool("quantize_head", quantize_head)
            if quantize is not None:
                int8.check_scheme(quantize)
            checkpoint = open_checkpoint(path, num_depths=num_depths, mtp_log_scaling=mtp_log_scaling)
            with torch.device("meta"):
                model = cls(checkpoint.config, parallel)
            shards = parallel.shards(checkpoint.config) if parallel is not None else {}
            shapes = {name: shards[name].full_shape(p.shape) if name in shards else p.shape
                      for name, p in model.named_parameters(remove_duplicate=False)}
            return checkpoint, model, shards, *checkpoint.read_state(shapes, dtype=dtype, device=device, target=target,
                                                                     progress=progress, shards=shards)

        checkpoint, model, shards, own, lent = read() if parallel is None else parallel.agreed_load(read)
        if parallel is not None and "lm_head_weight" in lent:  # this rank's rows of the target's head: no copy
            lent["lm_head_weight"] = nn.Parameter(parallel.head_rows(lent["lm_head_weight"], checkpoint.config),
                                                  requires_grad=False)
        model.requires_grad_(False)
        for name, param in lent.items():  # load_state_dict(assign=True) gives a Parameter our requires_grad: keep
            getattr(model, name).requires_grad_(param.requires_grad)  # the target's own
        model.load_state_dict({**own, **lent}, strict=True, assign=True)
        if target is not None:
            model.shares_tensors_of(target)
        if quantize is not None:
            model.quantize_(quantize, head=quantize_head)
        return model.eval()

    def quantize_(self, scheme="int8", *, head: bool = True) -> InklingMTP:
        """Weight-only quantized depth linears and, with ``head``, a draft-only int8 copy of the LM head; in place.

        ``scheme``: ``"int8"`` (ours, ``model/int8.py``) or a torchao config instance, which torchao applies to the
        depth linears (``model/torchao_schemes.py``; the optional ``torchao`` extra). The shared LM head Parameter
        (the target's) is never modified: the copy holds its first logits_vocab_size rows with 1/muP folded into
        the scales, and costs ``quantization.head_copy_bytes`` beside it. Norms, short convs, relative-bias tables,
        the embedding and the activations (bfloat16) stay as they are. Deterministic, and not saved:
        ``from_pretrained(..., quantize=...)`` quantizes again on load (docs/compile.md §11).
        """
        int8.check_scheme(scheme)
        arguments.check_bool("head", head)
        if self.parallel is not None:
            raise ValueError("quantize_ on a tensor-parallel model is not supported: quantize an unsharded model")
        if self.quantization is not None:
            raise ValueError(f"this model is already quantized ({self.quantization.scheme}, "
                             f"head={self.quantization.head})")
        int8.check_runs_int8(self.device, self.dtype)
        if torchao_schemes.is_config(scheme):
            before, after = torchao_schemes.quantize_linears(self.layers, scheme)  # all depths or none
            name = torchao_schemes.scheme_name(scheme)
        else:
            (before, after), name = int8.quantize_linears(self.layers), scheme
        if head:
            rows = self.lm_head_weight[: self.config.logits_vocab_size]
            self.quantized_head = Int8Linear.quantize(rows, 1.0 / self.config.mup)
        self.quantization = Quantization(name, head, before, after,
                                         self.quantized_head.nbytes if self.quantized_head is not None else 0)
        return self

    def save_pretrained(self, path: str | os.PathLike, *, include_shared: bool = True) -> None:
        """Write the raw layout back, atomically; see :func:`inkling_compiled.checkpoint.writer.save_checkpoint`."""
        if self.quantization is not None:
            raise CheckpointError("cannot save a quantized model: the raw Inkling layout holds no int8 tensors, and "
                                  "its int8 weights are a lossy copy; save the model before quantize_(), and load "
                                  "with from_pretrained(..., quantize='int8'), which quantizes again")
        if self.parallel is not None:
            raise CheckpointError("cannot save a tensor-parallel model: each rank holds only its shards; save the "
                                  "checkpoint from an unsharded model (from_pretrained without device_mesh=)")
        save_checkpoint(path, self.config, dict(self.named_parameters(remove_duplicate=False)),
                        include_shared=include_shared)

    def new_cache(self, batch_size: int, max_length: int) -> MTPCache:
        """Static, position-addressed KV + conv-state buffers for every depth (free rollback)."""
        return MTPCache(self.local_config, batch_size, max_length, self.dtype, self.device)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, previous_hidden: torch.Tensor,
                cache: MTPCache | None = None, depth: int = 0,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Run depth ``depth`` over rows [B, T]: ``(input_ids or inputs_embeds, positions, previous_hidden)`` ->
        [B, T, H].

        ``input_ids`` are the tokens x_{t+depth+1}; ``inputs_embeds`` replaces them with already backbone-normed
        embeddings (multimodal rows, docs/model.md §7), to which only the depth's own embed_norm is applied. With a
        cache the rows are written at their positions (``cache.pad_position`` marks padding rows); without one the rows
        are the whole sequence. Eager calls are validated first (:meth:`check_inputs`, one host sync; ids and
        positions of any integer dtype are converted to int64 there); traced calls (``torch.compile``) are not, and
        callers that validated once at their own boundary use :meth:`forward_unchecked`.
        """
        if not torch.compiler.is_compiling():
            input_ids, positions = self.check_inputs(input_ids, positions, previous_hidden, cache, depth,
                                                     inputs_embeds)
        return self.forward_unchecked(input_ids, positions, previous_hidden, cache, depth, inputs_embeds)

    def forward_unchecked(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                          previous_hidden: torch.Tensor, cache: MTPCache | None = None, depth: int = 0,
                          inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` without input validation (no host sync): bad inputs crash or answer wrong here."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids, validate=False)
        return self.run_layer(self.layers[depth], inputs_embeds, previous_hidden, positions,
                              cache.depths[depth] if cache is not None else None)

    def run_layer(self, layer: MTPDepth, embeds: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor,
                  depth_cache: DepthCache | None) -> torch.Tensor:
        """One of ``self.layers`` over rows, then the chain norm; no validation. The drafter compiles this once per
        depth geometry and passes each depth's module and cache, so every depth of a geometry shares one graph."""
        hidden = layer(embeds, previous_hidden, positions, depth_cache)
        return self.chain_norm(hidden) if self.chain_norm is not None else hidden

    def embed_tokens(self, input_ids: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
        """The target's own (backbone-normed) token embedding of ids of any shape and integer dtype.
        ``validate=False``: no checks (ids the caller checked)."""
        if validate is not False and not torch.compiler.is_compiling():
            arguments.check_bool("validate", validate)
            input_ids = validation.check_ids(self, input_ids)
        return normed_embedding(self.embed_weight, input_ids, self.embed_norm_weight, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
        """``(hidden / mup) @ lm_head.T`` truncated to the unpadded vocab: [..., logits_vocab_size] (tensor-parallel:
        every rank's vocab rows, gathered). ``validate=False``: no checks (the drafter's own hidden states)."""
        if validate is not False and not torch.compiler.is_compiling():
            arguments.check_bool("validate", validate)
            validation.check_head_input(self, hidden)
        if self.quantized_head is not None:  # its rows are the unpadded vocab, its scales carry 1/mup
            return self.quantized_head(hidden)
        if self.parallel is not None:
            local = mup_logits(hidden, self.lm_head_weight, self.config.mup, self.lm_head_weight.shape[0])
            return self.parallel.gather_logits(local, self.config.logits_vocab_size)
        return mup_logits(hidden, self.lm_head_weight, self.config.mup, self.config.logits_vocab_size)

    def get_top_tokens(self, hidden: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
        """Greedy draft tokens [...]: argmax over the unpadded vocab (muP cannot change it); tensor-parallel, each
        rank's argmax over its rows, then a [..., 2] (value, id) gather (docs/model.md §11). ``validate=False``: no
        checks, as for :meth:`compute_logits`."""
        if self.parallel is None:
            return self.compute_logits(hidden, validate=validate).argmax(dim=-1)
        if validate is not False and not torch.compiler.is_compiling():
            arguments.check_bool("validate", validate)
            validation.check_head_input(self, hidden)
        start, stop = self.parallel.vocab_rows(self.config)
        kept = min(stop, self.config.logits_vocab_size) - start  # padded ids never win
        local = mup_logits(hidden, self.lm_head_weight, self.config.mup, kept)
        return self.parallel.top_tokens(local, start)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head_weight.device

    # -- tensors shared with the target ----------------------------------------------------------------------------

    def shares_tensors_of(self, target: nn.Module) -> None:
        """Note that ``target`` owns the Parameters in :attr:`SHARED` that are its own (loaded with ``target=``).

        Only a weak reference is kept; a copy or an unpickled model owns what it holds.
        """
        self._target_ref = weakref.ref(target)

    def shared_parameters(self) -> dict[str, nn.Parameter]:
        """The Parameters of :attr:`SHARED` that are, right now, the very Parameters of the target's."""
        target = self._target_ref() if self._target_ref is not None else None
        if target is None:
            return {}
        theirs = {id(p) for p in target.parameters()}
        return {n: p for n in self.SHARED if (p := self._parameters.get(n)) is not None and id(p) in theirs}

    def _apply(self, fn, recurse=True):
        """``.to()`` / ``.half()`` / ``.cuda()`` ... convert what this model owns. A tensor shared with the target is
        the target's: a conversion that would change it raises (before anything is converted) rather than convert
        the target behind its back; one that leaves it as it is (the target was converted first) passes."""
        shared = self.shared_parameters()
        changed = []
        for name, p in shared.items():
            probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))  # what the conversion makes of this tensor
            if (probe.dtype, probe.device) != (p.dtype, p.device):
                changed.append(f"{name} ({p.dtype} on {p.device} -> {probe.dtype} on {probe.device})")
        if changed:
            raise ValueError(f"this conversion would change {', '.join(changed)}: tensors the MTP shares with its "
                             "target (loaded with target=), which would break the target. Convert the target "
                             "instead and re-load the MTP with InklingMTP.from_pretrained(path, target=target) (or "
                             "convert the target first, then the MTP the same way)")
        for name in shared:  # hidden from the conversion, in place so the parameter order is kept
            self._parameters[name] = None
        try:
            return super()._apply(fn, recurse)
        finally:
            self._parameters.update(shared)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_target_ref", None)  # a weak reference does not pickle, and a copy shares nothing
        return state

    # -- validation (model/validation.py) ------------------------------------------------------------------------

    def check_parameters(self) -> None:
        """ValueError when the parameters are not of one dtype on one device, or a quantized model lost its int8
        kernels; see :func:`inkling_compiled.model.validation.check_parameters`."""
        validation.check_parameters(self)

    def check_inputs(self, input_ids: torch.Tensor | None, positions: torch.Tensor, previous_hidden: torch.Tensor,
                     cache: MTPCache | None = None, depth: int = 0, inputs_embeds: torch.Tensor | None = None, *,
                     drafting: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(input_ids, positions)`` as int64 after checking every argument (one host sync); see
        :func:`inkling_compiled.model.validation.check_inputs`."""
        return validation.check_inputs(self, input_ids, positions, previous_hidden, cache, depth, inputs_embeds,
                                       drafting=drafting)
