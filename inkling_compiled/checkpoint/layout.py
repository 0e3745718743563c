"""The raw Inkling layout (docs/model.md §3): file and key names, the three shared tensors, the w13 interleave, the
dtypes a weight may be stored in, the alignment loaded tensors get, the part of a tensor one tensor-parallel rank
reads (``Shard``), and ``CheckpointError``.

The key map is the identity under ``model.mtp.`` (module names follow the checkpoint's), with one transform:
``mlp.w13_dn.weight`` rows are interleaved gate/up on disk and held as [gate; up] in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MTP_PREFIX = "model.mtp."
MTP_FILE = "mtp.safetensors"
SHARED_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
W13_SUFFIX = "transformer_block.mlp.w13_dn.weight"
# InklingMTP parameter -> raw key of the target tensor it shares
SHARED_KEYS = {
    "embed_weight": "model.llm.embed.weight",
    "embed_norm_weight": "model.llm.embed_norm.weight",
    "lm_head_weight": "model.llm.unembed.weight",
}
SHARED_RAW_KEYS = tuple(SHARED_KEYS.values())
# The dtypes an MTP weight may be stored in and run in (safetensors header name -> torch dtype).
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
SAFETENSORS_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
ALIGNMENT = 64  # bytes: what PyTorch's CPU allocator guarantees, and what vectorised GEMM kernels expect


class CheckpointError(ValueError):
    """The checkpoint directory cannot give (or take) this MTP head: unreadable files, missing / unexpected /
    mis-shaped / non-floating / non-finite tensors, a config mismatch, or a save that would lose data."""


def raw_key(name: str) -> str:
    """Raw checkpoint key of an ``InklingMTP`` parameter name."""
    return SHARED_KEYS.get(name, MTP_PREFIX + name)


def is_draft_key(key: str) -> bool:
    """Whether a raw key is one the draft head reads: an MTP tensor or one of the three shared ones."""
    return key.startswith(MTP_PREFIX) or key in SHARED_RAW_KEYS


def interleave_rows(w: torch.Tensor) -> torch.Tensor:
    """[gate; up] -> gate0, up0, gate1, up1, ... (the on-disk w13_dn layout, docs/model.md §3.4)."""
    gate, up = w.chunk(2, dim=0)
    return torch.stack([gate, up], dim=1).reshape(w.shape)


def deinterleave_rows(w: torch.Tensor) -> torch.Tensor:
    """On-disk interleaved gate/up rows -> [gate (rows 0::2); up (rows 1::2)]."""
    return torch.cat([w[0::2], w[1::2]], dim=0)


@dataclass(frozen=True)
class Shard:
    """Part ``index`` of ``count`` of a tensor along ``dim`` (what one tensor-parallel rank holds, docs/model.md §11);
    with ``blocks`` > 1 the dim is ``blocks`` equal blocks (a fused [gate; up]) and the part is taken from each
    block, then concatenated. Shapes and spans refer to the in-memory layout (w13 de-interleaved)."""

    dim: int
    index: int
    count: int
    blocks: int = 1

    def ranges(self, size: int) -> list[tuple[int, int]]:
        """The [start, stop) spans of the full dim (``size``) that the part holds, in order."""
        block = size // self.blocks
        part = block // self.count
        return [(b * block + self.index * part, b * block + (self.index + 1) * part) for b in range(self.blocks)]

    def full_shape(self, local: torch.Size) -> tuple[int, ...]:
        return tuple(n * self.count if d == self.dim else n for d, n in enumerate(local))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The part of ``full``: a view when it is one span (no copy), else the spans concatenated."""
        spans = [full.narrow(self.dim, start, stop - start) for start, stop in self.ranges(full.shape[self.dim])]
        return spans[0] if len(spans) == 1 else torch.cat(spans, dim=self.dim)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its own aligned allocation. safetensors hands out tensors at arbitrary offsets of one buffer; a GEMV
    over a misaligned weight measured ~20 % slower (the small head: 8.9 vs 7.5 ms)."""
    return t if t.is_meta or t.data_ptr() % ALIGNMENT == 0 else t.clone()
