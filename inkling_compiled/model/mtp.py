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

from ..checkpoint.layout import SHARED_KEYS, CheckpointError
from ..checkpoint.reader import open_checkpoint
from ..checkpoint.writer import save_checkpoint
from ..config import DepthGeometry, MTPConfig
from . import int8, torchao_schemes
from .block import DecoderBlock
from .cache import DepthCache, MTPCache
from .depth_input import concat_normed, normed_embedding
from .head import mup_logits
from .int8 import Int8Linear, Quantization
from .norm import RMSNorm


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

    def __init__(self, config: MTPConfig):
        super().__init__()
        self.config = config
        h, v = config.hidden_size, config.vocab_size
        self.layers = nn.ModuleList(MTPDepth(config, g) for g in config.depths)
        self.chain_norm = RMSNorm(h, config.rms_norm_eps) if config.chain_hidden_post_norm else None
        # Shared with the target (docs/model.md §3.1): replaced by the target's own Parameters when loaded with
        # `target=`.
        self.embed_weight = nn.Parameter(torch.zeros(v, h))
        self.embed_norm_weight = nn.Parameter(torch.ones(h)) if config.use_embed_norm else None
        self.lm_head_weight = nn.Parameter(torch.zeros(v, h))
        # every module's own Parameter dict (entries are replaced by loading, the dicts are not): reading dtypes
        # through them costs a fifth of named_parameters(), on every validated call
        self._parameter_dicts = tuple(m._parameters for m in self.modules())
        # Set by quantize_(): a draft-only int8 copy of the head's first logits_vocab_size rows, 1/muP in its scales.
        self.quantized_head: Int8Linear | None = None
        self.quantization: Quantization | None = None

    # -- public API (docs/architecture.md §3) --------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None, target: nn.Module | None = None,
                        num_depths: int | None = None, mtp_log_scaling: bool = False,
                        progress: bool | None = None, quantize: str | None = None,
                        quantize_head: bool = True) -> InklingMTP:
        """Load from a raw Inkling checkpoint directory (eval mode, no autograd on its own weights).

        ``dtype`` defaults to the stored MTP dtype (or the target's), ``device`` to CPU (or the target's). ``target``
        (a transformers ``InklingForCausalLM`` / ``InklingForConditionalGeneration``) lends its embedding table,
        embed_norm and LM head as the very same Parameters. ``num_depths`` loads only the first depths (vLLM loads
        min(depths, speculative tokens)). Every mismatch between config and files is reported at once; see
        :func:`inkling_compiled.checkpoint.reader.open_checkpoint`. ``quantize="int8"`` quantizes the loaded model with
        :meth:`quantize_` (``head=quantize_head``); ``dtype`` then defaults to bfloat16 (without a target).
        """
        if quantize is not None:
            int8.check_scheme(quantize)
            _check_bool("quantize_head", quantize_head)
            if dtype is None and target is None:
                dtype = int8.ACTIVATION_DTYPE
        checkpoint = open_checkpoint(path, num_depths=num_depths, mtp_log_scaling=mtp_log_scaling)
        with torch.device("meta"):
            model = cls(checkpoint.config)
        shapes = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
        own, lent = checkpoint.read_state(shapes, dtype=dtype, device=device, target=target, progress=progress)
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
        _check_bool("head", head)
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
        save_checkpoint(path, self.config, dict(self.named_parameters(remove_duplicate=False)),
                        include_shared=include_shared)

    def new_cache(self, batch_size: int, max_length: int) -> MTPCache:
        """Static, position-addressed KV + conv-state buffers for every depth (free rollback)."""
        return MTPCache(self.config, batch_size, max_length, self.dtype, self.device)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, previous_hidden: torch.Tensor,
                cache: MTPCache | None = None, depth: int = 0,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Run depth ``depth`` over rows [B, T]: ``(input_ids or inputs_embeds, positions, previous_hidden)`` ->
        [B, T, H].

        ``input_ids`` are the tokens x_{t+depth+1}; ``inputs_embeds`` replaces them with already backbone-normed
        embeddings (multimodal rows, docs/model.md §7), to which only the depth's own embed_norm is applied. With a
        cache the rows are written at their positions (``cache.pad_position`` marks padding rows); without one the rows
        are the whole sequence. Eager calls are validated first (:meth:`check_inputs`, one host sync); traced calls
        (``torch.compile``) are not, and callers that validated once at their own boundary use
        :meth:`forward_unchecked`.
        """
        if not torch.compiler.is_compiling():
            self.check_inputs(input_ids, positions, previous_hidden, cache, depth, inputs_embeds)
        return self.forward_unchecked(input_ids, positions, previous_hidden, cache, depth, inputs_embeds)

    def forward_unchecked(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                          previous_hidden: torch.Tensor, cache: MTPCache | None = None, depth: int = 0,
                          inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` without input validation (no host sync): bad inputs crash or answer wrong here."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        return self.run_layer(self.layers[depth], inputs_embeds, previous_hidden, positions,
                              cache.depths[depth] if cache is not None else None)

    def run_layer(self, layer: MTPDepth, embeds: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor,
                  depth_cache: DepthCache | None) -> torch.Tensor:
        """One of ``self.layers`` over rows, then the chain norm; no validation. The drafter compiles this once per
        depth geometry and passes each depth's module and cache, so every depth of a geometry shares one graph."""
        hidden = layer(embeds, previous_hidden, positions, depth_cache)
        return self.chain_norm(hidden) if self.chain_norm is not None else hidden

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's own (backbone-normed) token embedding."""
        return normed_embedding(self.embed_weight, input_ids, self.embed_norm_weight, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(hidden / mup) @ lm_head.T`` truncated to the unpadded vocab: [..., logits_vocab_size]."""
        if self.quantized_head is not None:  # its rows are the unpadded vocab, its scales carry 1/mup
            return self.quantized_head(hidden)
        return mup_logits(hidden, self.lm_head_weight, self.config.mup, self.config.logits_vocab_size)

    def get_top_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens [...]: argmax over the unpadded vocab (muP cannot change it)."""
        return self.compute_logits(hidden).argmax(dim=-1)

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

    # -- validation ----------------------------------------------------------------------------------------------

    def check_parameters(self) -> None:
        """ValueError naming the tensors when the parameters are not all of one dtype on one device (the target was
        converted after loading with ``target=``, so its shared tensors changed and the MTP's own did not)."""
        kinds = {(p.dtype, p.device) for params in self._parameter_dicts for p in params.values() if p is not None}
        if len(kinds) > 1:
            groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
            for name, p in self.named_parameters():
                groups.setdefault((p.dtype, p.device), []).append(name)
            parts = [f"{dtype} on {device}: {_some(names)}"
                     for (dtype, device), names in sorted(groups.items(), key=lambda item: len(item[1]))]
            raise ValueError("the MTP's parameters are not all of one dtype on one device (" + "; ".join(parts)
                             + "). Was the target converted after loading? Its shared tensors "
                             f"({', '.join(n for n in self.SHARED if getattr(self, n) is not None)}) changed "
                             "with it: convert the MTP the same way (mtp.to(...)) or re-load it with target=")

    def check_inputs(self, input_ids: torch.Tensor | None, positions: torch.Tensor, previous_hidden: torch.Tensor,
                     cache: MTPCache | None = None, depth: int = 0, inputs_embeds: torch.Tensor | None = None, *,
                     drafting: bool = False) -> None:
        """Raise ValueError naming the problem for any bad argument, shape, dtype, device, id, position or value.

        Padding rows are those at ``cache.pad_position``; their positions and hidden values are not checked.
        ``drafting`` applies the Drafter's conventions instead: negative positions mark padding, and every sequence
        needs a real row (its draft is read off its last one). Reading the values costs one host sync.
        """
        if self.quantization is not None:  # e.g. converted with .to(torch.float32) after quantizing
            int8.check_runs_int8(self.device, self.dtype)
        self.check_parameters()
        h, n = self.config.hidden_size, self.config.num_depths
        if isinstance(depth, bool) or not isinstance(depth, int):
            raise ValueError(f"depth must be an int in [0, {n}), got {depth!r}")
        if not 0 <= depth < n:
            raise ValueError(f"depth {depth} out of range: this model has {n} MTP depth(s)")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        _check_tensor("positions", positions, ndim=2, integer=True, device=self.device)
        batch, seq = positions.shape
        if batch == 0 or seq == 0:
            raise ValueError(f"positions has no rows (shape {tuple(positions.shape)}): need B >= 1 and T >= 1")
        if input_ids is not None:
            _check_tensor("input_ids", input_ids, ndim=2, integer=True, device=self.device, shape=(batch, seq))
        else:
            _check_tensor("inputs_embeds", inputs_embeds, ndim=3, device=self.device, shape=(batch, seq, h),
                          dtype=self.dtype)
        _check_tensor("previous_hidden", previous_hidden, ndim=3, device=self.device, shape=(batch, seq, h),
                      dtype=self.dtype)
        if cache is not None:
            self._check_cache(cache, batch)
        if drafting:
            padding, note = positions < 0, "negative positions mark padding rows"
        elif cache is not None:
            padding, note = positions == cache.pad_position, f"{cache.pad_position} marks padding rows"
        else:
            padding, note = None, ""
        self._check_values(input_ids, inputs_embeds, positions, previous_hidden, padding, cache, note, drafting)

    def _check_cache(self, cache: MTPCache, batch: int) -> None:
        if not isinstance(cache, MTPCache):
            raise ValueError(f"cache must be an MTPCache (from new_cache), got {type(cache).__name__}")
        if batch > cache.batch_size:
            raise ValueError(f"batch of {batch} sequences exceeds the cache's batch_size {cache.batch_size}")
        if len(cache.depths) != self.config.num_depths:
            raise ValueError(f"cache has {len(cache.depths)} depth(s), the model {self.config.num_depths}")
        k = cache.depths[0].k
        if k.device != self.device or k.dtype != self.dtype:
            raise ValueError(f"cache is {k.dtype} on {k.device}, the model {self.dtype} on {self.device}")
        for i, (d, g) in enumerate(zip(cache.depths, self.config.depths)):
            got, want = (*d.k.shape[2:], d.conv_attn.shape[-1]), (g.num_kv_heads, g.head_dim, self.config.hidden_size)
            if got != want:
                raise ValueError(f"cache depth {i} holds (kv heads, head dim, hidden) {got}, the model's depth {i} "
                                 f"needs {want}: the cache was built for another model")

    def _check_values(self, input_ids, inputs_embeds, positions, previous_hidden, padding, cache, note,
                      drafting) -> None:
        """Ids in the table; real rows at positions >= 0, inside the cache and consecutive per sequence, with finite
        inputs (and, drafting, at least one per sequence). Reduced on the device to a few numbers, one host sync."""
        if padding is None:
            padding = torch.zeros_like(positions, dtype=torch.bool)
        real, pos, none = ~padding, positions.long(), torch.iinfo(torch.long).max
        first = pos.masked_fill(padding, none).amin(dim=1, keepdim=True)  # a sequence's earliest real row
        stats = [first.amin(), pos.masked_fill(padding, -1).amax(), first.amax()]
        if input_ids is not None:
            stats += torch.aminmax(input_ids.long())
        nonfinite = {name: real & ~x.isfinite().all(dim=-1)  # [B, T]: real rows holding a NaN or inf
                     for name, x in (("previous_hidden", previous_hidden), ("inputs_embeds", inputs_embeds))
                     if x is not None}
        stats += [bad.sum() for bad in nonfinite.values()]
        if cache is not None:  # the real rows, in column order, are at first, first + 1, ...
            broken = real & (pos - first + 1 != real.cumsum(dim=1))
            stats.append(broken.sum())
        values = torch.stack(stats).tolist()  # the one host sync
        lo, hi, last_first = values.pop(0), values.pop(0), values.pop(0)
        if drafting and last_first == none:
            row = int((first == none).nonzero()[0, 0])
            raise ValueError(f"sequence {row} has no real row (all its positions are negative): nothing to draft from")
        if input_ids is not None:
            lo_id, hi_id = values.pop(0), values.pop(0)
            vocab = self.embed_weight.shape[0]
            if lo_id < 0 or hi_id >= vocab:
                raise ValueError(f"token id {lo_id if lo_id < 0 else hi_id} out of range: ids must be in [0, {vocab}) "
                                 "(the embedding table's rows)")
        if lo < 0:
            raise ValueError(f"position {lo} is negative")
        for (name, bad), count in zip(nonfinite.items(), values):
            if count:
                b, t = bad.nonzero()[0].tolist()
                raise ValueError(f"{name} holds a NaN or inf at sequence {b}, row {t} (position "
                                 f"{int(positions[b, t])}): the inputs of real rows must be finite")
        if cache is None:
            return
        if hi >= cache.max_length:
            raise ValueError(f"position {hi} is past the cache capacity: max_length is {cache.max_length} "
                             f"(positions 0..{cache.max_length - 1}; {note})")
        if values[-1]:
            row = int(broken.any(dim=1).nonzero()[0])
            raise ValueError(f"sequence {row}: positions {positions[row][real[row]].tolist()} are not consecutive; "
                             f"with a cache the real rows of a sequence are consecutive positions ({note})")


def _some(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _check_tensor(name: str, t, *, ndim: int, device: torch.device, integer: bool = False,
                  shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if integer and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, the model runs in {dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the model on {device}")
