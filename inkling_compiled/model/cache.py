"""Static, position-addressed draft caches (docs/protocol.md §6.6).

Per depth: K (post-sconv, post-k_norm) and V (post-sconv) per absolute position, and the four short-conv input
streams (k, v, attention branch, MLP branch) per absolute position. Buffers are allocated once with fixed addresses
(CUDA-graph friendly) and written by position, so recomputing a position overwrites it: rejected rows never need a
rollback. Each buffer has one extra row, ``pad_position == max_length``: a scratch slot that padding rows write to
and that no real query can see (real positions are < max_length, and keys are visible only at distances >= 0).
The buffers are inference state: what is stored is detached, so they never record autograd history.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..arguments import positive_int
from ..config import MTPConfig


@dataclass
class DepthCache:
    k: torch.Tensor  # [B, S, Hkv, d]
    v: torch.Tensor  # [B, S, Hkv, d]
    conv_k: torch.Tensor  # [B, S, Hkv*d]
    conv_v: torch.Tensor  # [B, S, Hkv*d]
    conv_attn: torch.Tensor  # [B, S, H]
    conv_mlp: torch.Tensor  # [B, S, H]
    key_positions: torch.Tensor  # [S] = arange(S): the absolute position of each slot

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, window: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store the new rows at their positions; return (keys, values, key positions) the rows may attend to.

        Full attention: every slot of the first ``B`` sequences. Sliding window W: only the W + T - 1 slots ending at
        the call's last row (a sequence's real rows are consecutive positions), so a decode step reads W keys
        whatever the context length. Slots before position 0 or past the scratch slot get a key position in the
        future of every real row: causality masks them.
        """
        batch, seq = positions.shape
        rows = torch.arange(batch, device=k.device)[:, None]
        self.k.index_put_((rows.expand_as(positions), positions), k.detach())
        self.v.index_put_((rows.expand_as(positions), positions), v.detach())
        if window is None:
            return self.k[:batch], self.v[:batch], self.key_positions[None, :].expand(batch, -1)
        pad = self.pad_position
        first = torch.where(positions == pad, pad, positions).amin(dim=1, keepdim=True)  # earliest real row
        slots = first - (window - 1) + torch.arange(window + seq - 1, device=k.device)  # [B, W + T - 1]
        index = slots.clamp(0, pad)
        key_positions = torch.where(slots < 0, pad + window + seq, slots)
        return self.k[rows, index], self.v[rows, index], key_positions

    @property
    def pad_position(self) -> int:
        """The scratch slot's position (the last one): padding rows are written there, no real query sees it."""
        return self.key_positions.shape[0] - 1

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.conv_k, self.conv_v, self.conv_attn, self.conv_mlp]


class MTPCache:
    """All depths' caches for up to ``batch_size`` sequences of up to ``max_length`` positions."""

    def __init__(self, config: MTPConfig, batch_size: int, max_length: int, dtype: torch.dtype,
                 device: torch.device | str):
        batch_size, max_length = positive_int("batch_size", batch_size), positive_int("max_length", max_length)
        self.batch_size, self.max_length = batch_size, max_length
        slots = max_length + 1

        def buf(*shape):  # never an inference tensor: every later call updates it in place, outside inference mode too
            with torch.inference_mode(False):
                return torch.zeros(batch_size, slots, *shape, dtype=dtype, device=device)

        try:
            buffers = [
                dict(
                    k=buf(g.num_kv_heads, g.head_dim),
                    v=buf(g.num_kv_heads, g.head_dim),
                    conv_k=buf(g.num_kv_heads * g.head_dim),
                    conv_v=buf(g.num_kv_heads * g.head_dim),
                    conv_attn=buf(config.hidden_size),
                    conv_mlp=buf(config.hidden_size),
                )
                for g in config.depths
            ]
            # after the buffers: a cache too large to allocate fails there, before max_length + 1 positions are filled
            # (an 8 GB arange, seconds, for a max_length of 1e9)
            key_positions = torch.arange(slots, device=device)
            self.depths = [DepthCache(**b, key_positions=key_positions) for b in buffers]
        except RuntimeError as e:  # torch.OutOfMemoryError too: name the sizes, not the allocator's internals
            # a size past what torch can index fails before allocating ("Storage size calculation overflowed")
            if not any(word in str(e) for word in ("alloc", "overflow")) and not isinstance(e, torch.OutOfMemoryError):
                raise
            per_slot = sum(4 * g.num_kv_heads * g.head_dim + 2 * config.hidden_size for g in config.depths)
            need = batch_size * slots * per_slot * torch.empty(0, dtype=dtype).element_size()
            raise MemoryError(f"the MTP cache for batch_size={batch_size}, max_length={max_length} needs {need:,} "
                              f"bytes on {torch.device(device)}, which could not be allocated: choose a smaller "
                              "batch or length") from e

    @property
    def pad_position(self) -> int:
        """Position to give padding rows: a scratch slot that real rows never attend to."""
        return self.max_length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.depths for t in d.tensors())

    def zero_(self) -> MTPCache:
        for depth in self.depths:
            for t in depth.tensors():
                t.zero_()
        return self
