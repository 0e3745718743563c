"""One Inkling decoder block as used by every MTP depth (docs/model.md §4.5): pre-norm attention and dense MLP, each
branch passed through its own short conv *before* the residual add. No final norm."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import DepthGeometry, MTPConfig
from .attention import Attention
from .mlp import DenseMLP
from .norm import RMSNorm
from .short_conv import ShortConv

if TYPE_CHECKING:
    from .cache import DepthCache


class DecoderBlock(nn.Module):
    def __init__(self, config: MTPConfig, geometry: DepthGeometry):
        super().__init__()
        c = config
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn = Attention(c.hidden_size, geometry, c.d_rel, c.conv_kernel_size, c.rms_norm_eps,
                              c.log_scaling_n_floor, c.log_scaling_alpha)
        self.attn_sconv = ShortConv(c.hidden_size, c.conv_kernel_size)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DenseMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.use_global_scale)
        self.mlp_sconv = ShortConv(c.hidden_size, c.conv_kernel_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: DepthCache | None = None) -> torch.Tensor:
        u = self.attn(self.attn_norm(x), positions, cache)
        x = x + self.attn_sconv(u, positions, cache.conv_attn if cache is not None else None)
        y = self.mlp(self.mlp_norm(x))
        return x + self.mlp_sconv(y, positions, cache.conv_mlp if cache is not None else None)
