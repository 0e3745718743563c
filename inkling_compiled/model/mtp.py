"""The MTP depth layer and ``InklingMTP``, the public draft head (spec §4, §5; design §2).

Depth k at row t reads (previous hidden g^{k-1}_t, token x_{t+k+1}) at the target's absolute position t and returns
its raw block output g^k_t, which is both the next depth's hidden and (divided by muP) the shared LM head's input.
The embedding table, the backbone ``embed_norm`` and the LM head belong to the target and are shared, never copied.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..config import DepthGeometry, MTPConfig
from .block import DecoderBlock
from .cache import DepthCache, MTPCache
from .draft_input import backbone_embedding, draft_input
from .head import mup_logits
from .norm import RMSNorm


class MTPDepth(nn.Module):
    """hidden_norm / embed_norm / concat / input_proj (2H -> H) / one decoder block (spec §4.4-4.5)."""

    def __init__(self, config: MTPConfig, geometry: DepthGeometry):
        super().__init__()
        self.eps, self.hidden_first = config.rms_norm_eps, config.hidden_states_first
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.transformer_block = DecoderBlock(config, geometry)

    def forward(self, embeds: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor,
                cache: DepthCache | None = None) -> torch.Tensor:
        x = draft_input(previous_hidden, embeds, self.hidden_norm.weight, self.embed_norm.weight, self.eps,
                        self.hidden_first)
        return self.transformer_block(self.input_proj(x), positions, cache)


class InklingMTP(nn.Module):
    """Inkling's multi-token-prediction draft head: any number of depths over the target's shared tensors."""

    def __init__(self, config: MTPConfig):
        super().__init__()
        self.config = config
        h, v = config.hidden_size, config.vocab_size
        self.layers = nn.ModuleList(MTPDepth(config, g) for g in config.depths)
        self.chain_norm = RMSNorm(h, config.rms_norm_eps) if config.chain_hidden_post_norm else None
        # Shared with the target (spec §3.1): replaced by the target's own Parameters when loaded with `target=`.
        self.embed_weight = nn.Parameter(torch.zeros(v, h))
        self.embed_norm_weight = nn.Parameter(torch.ones(h)) if config.use_embed_norm else None
        self.lm_head_weight = nn.Parameter(torch.zeros(v, h))

    # -- public API (design §2) ------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None, target: nn.Module | None = None,
                        num_depths: int | None = None, mtp_log_scaling: bool = False,
                        progress: bool | None = None) -> InklingMTP:
        """Load from a raw Inkling checkpoint directory; see :func:`inkling_compiled.checkpoint.load_mtp`."""
        from ..checkpoint import load_mtp

        return load_mtp(path, dtype=dtype, device=device, target=target, num_depths=num_depths,
                        mtp_log_scaling=mtp_log_scaling, progress=progress)

    def save_pretrained(self, path: str | os.PathLike, *, include_shared: bool = True) -> None:
        """Write the raw layout back; see :func:`inkling_compiled.checkpoint.save_mtp`."""
        from ..checkpoint import save_mtp

        save_mtp(self, path, include_shared=include_shared)

    def new_cache(self, batch_size: int, max_length: int) -> MTPCache:
        """Static, position-addressed KV + conv-state buffers for every depth (free rollback)."""
        return MTPCache(self.config, batch_size, max_length, self.dtype, self.device)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, previous_hidden: torch.Tensor,
                cache: MTPCache | None = None, depth: int = 0,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Run depth ``depth`` over rows [B, T]: ``(input_ids or inputs_embeds, positions, previous_hidden)`` -> [B, T, H].

        ``input_ids`` are the tokens x_{t+depth+1}; ``inputs_embeds`` replaces them with already backbone-normed
        embeddings (multimodal rows, spec §7), to which only the depth's own embed_norm is applied. With a cache the
        rows are written at their positions (``cache.pad_position`` marks padding rows); without one the rows are the
        whole sequence.
        """
        if not torch.compiler.is_compiling():
            self.check_inputs(input_ids, positions, previous_hidden, cache, depth, inputs_embeds)
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
        return backbone_embedding(self.embed_weight, input_ids, self.embed_norm_weight, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(hidden / mup) @ lm_head.T`` truncated to the unpadded vocab: [..., logits_vocab_size]."""
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

    # -- validation ----------------------------------------------------------------------------------------------

    def check_inputs(self, input_ids: torch.Tensor | None, positions: torch.Tensor, previous_hidden: torch.Tensor,
                     cache: MTPCache | None = None, depth: int = 0,
                     inputs_embeds: torch.Tensor | None = None) -> None:
        """Raise ValueError naming the problem for any bad shape, dtype, device, id or position (reads values: syncs)."""
        h, n = self.config.hidden_size, self.config.num_depths
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
            lo, hi = int(input_ids.min()), int(input_ids.max())
            vocab = self.embed_weight.shape[0]
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} out of range: ids must be in [0, {vocab}) (the embedding table's rows)")
        else:
            _check_tensor("inputs_embeds", inputs_embeds, ndim=3, device=self.device, shape=(batch, seq, h),
                          dtype=self.dtype)
        _check_tensor("previous_hidden", previous_hidden, ndim=3, device=self.device, shape=(batch, seq, h),
                      dtype=self.dtype)
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0:
            raise ValueError(f"position {lo} is negative")
        if cache is not None:
            if batch > cache.batch_size:
                raise ValueError(f"batch of {batch} sequences exceeds the cache's batch_size {cache.batch_size}")
            if len(cache.depths) != n:
                raise ValueError(f"cache has {len(cache.depths)} depth(s), the model {n}")
            real = positions[positions != cache.pad_position]
            if real.numel() and int(real.max()) >= cache.max_length:
                raise ValueError(f"position {int(real.max())} is past the cache capacity: max_length is "
                                 f"{cache.max_length} (positions 0..{cache.max_length - 1}; "
                                 f"{cache.pad_position} marks padding rows)")
            for row, row_positions in enumerate(positions.tolist()):
                real_row = [p for p in row_positions if p != cache.pad_position]
                if real_row != list(range(real_row[0], real_row[0] + len(real_row)) if real_row else []):
                    raise ValueError(f"sequence {row}: positions {real_row} are not consecutive; with a cache the real "
                                     f"rows of a sequence are consecutive positions ({cache.pad_position} marks "
                                     "padding rows)")
            if cache.depths[0].k.device != self.device or cache.depths[0].k.dtype != self.dtype:
                raise ValueError(f"cache is {cache.depths[0].k.dtype} on {cache.depths[0].k.device}, "
                                 f"the model {self.dtype} on {self.device}")


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
