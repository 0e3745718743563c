"""Inkling relative-position attention for one MTP depth (docs/model.md §4.6).

q/k/v/r projections; short convs on K and V *before* k_norm; per-head q/k RMSNorm with one shared gain; scale
1/head_dim (q and k are unit-RMS per head); a learned relative bias ``R[i, h, i-j]`` for ``0 <= i-j < E`` added after
scaling; causal mask, plus a window of W keys (self included) on sliding depths; GQA with contiguous head groups.
Positions are absolute target positions and enter only through the distances ``i - j``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import DepthGeometry
from .norm import RMSNorm
from .short_conv import ShortConv

if TYPE_CHECKING:
    from .cache import DepthCache


class RelativeLogits(nn.Module):
    """``R[t, h, :] = r[t, h, :] @ proj``: each row's mix of the bias-vs-distance profiles (fp32, one rounding)."""

    def __init__(self, d_rel: int, extent: int):
        super().__init__()
        self.proj = nn.Parameter(torch.zeros(d_rel, extent))  # checkpoint key has no `.weight` suffix

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        return (r.float() @ self.proj.float()).to(r.dtype)


def log_scaling(positions: torch.Tensor, n_floor: int, alpha: float) -> torch.Tensor:
    """tau_t = 1 + alpha * ln(max((pos_t + 1) / n_floor, 1)), fp32 [B, T] (docs/model.md §4.6 step 5)."""
    return 1.0 + alpha * torch.log(((positions + 1).float() / n_floor).clamp(min=1.0))


def relative_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel: torch.Tensor,
                       q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, scale: float,
                       real_queries: torch.Tensor | None = None) -> torch.Tensor:
    """Scores ``q.k * scale + bias`` (fp32), masked causal/windowed by absolute position, softmax, weighted values.

    q: [B, T, Hq, d]; k, v: [B, S, Hkv, d]; rel: [B, T, Hq, E]; q_pos: [B, T]; k_pos: [B, S]. Returns [B, T, Hq, d].
    ``real_queries`` [B, T] (cached calls: False on padding rows) isolates the real rows from every cache slot none of
    them may see: such a slot's value is replaced by zeros, since its zero probability times a NaN or inf it may hold
    (a padding row, a stale or rejected row at a later position) would still be NaN. Masked keys are already harmless
    (their scores are overwritten by -inf). Without a cache every key is one of the call's own rows.
    """
    batch, seq, heads, dim = q.shape
    kv_heads, extent = k.shape[2], rel.shape[-1]
    group = heads // kv_heads
    dist = q_pos[:, :, None] - k_pos[:, None, :]  # [B, T, S]
    index = dist.clamp(0, extent - 1)[:, :, None, :].expand(batch, seq, heads, dist.shape[-1])
    bias = rel.float().gather(-1, index)
    bias = torch.where(((dist >= 0) & (dist < extent))[:, :, None, :], bias, 0.0)  # [B, T, Hq, S]
    visible = dist >= 0
    if window is not None:
        visible = visible & (dist < window)

    qg = q.float().view(batch, seq, kv_heads, group, dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, d]
    kt = k.float().permute(0, 2, 3, 1)[:, :, None]  # [B, Hkv, 1, d, S]
    scores = (qg @ kt) * scale + bias.view(batch, seq, kv_heads, group, -1).permute(0, 2, 3, 1, 4)
    scores = scores.masked_fill(~visible[:, None, None], -math.inf)
    probs = torch.softmax(scores, dim=-1)
    values = v.float()
    if real_queries is not None:
        seen = (visible & real_queries[:, :, None]).any(dim=1)  # [B, S]: some real row of the call may read the slot
        values = torch.where(seen[:, :, None, None], values, 0.0)
    out = probs @ values.permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, G, T, d]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, seq, heads, dim).to(q.dtype)


class Attention(nn.Module):
    def __init__(self, hidden_size: int, geometry: DepthGeometry, d_rel: int, conv_kernel_size: int, eps: float,
                 log_scaling_n_floor: int | None, log_scaling_alpha: float):
        super().__init__()
        g = geometry
        self.geometry = g
        self.scale = 1.0 / g.head_dim
        self.n_floor, self.alpha = log_scaling_n_floor, log_scaling_alpha
        self.wq_du = nn.Linear(hidden_size, g.num_heads * g.head_dim, bias=False)
        self.wk_dv = nn.Linear(hidden_size, g.num_kv_heads * g.head_dim, bias=False)
        self.wv_dv = nn.Linear(hidden_size, g.num_kv_heads * g.head_dim, bias=False)
        self.wr_du = nn.Linear(hidden_size, g.num_heads * d_rel, bias=False)
        self.wo_ud = nn.Linear(g.num_heads * g.head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(g.head_dim, eps)
        self.k_norm = RMSNorm(g.head_dim, eps)
        self.k_sconv = ShortConv(g.num_kv_heads * g.head_dim, conv_kernel_size)
        self.v_sconv = ShortConv(g.num_kv_heads * g.head_dim, conv_kernel_size)
        self.rel_logits_proj = RelativeLogits(d_rel, g.rel_extent)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: DepthCache | None = None) -> torch.Tensor:
        g = self.geometry
        batch, seq, _ = x.shape
        q = self.q_norm(self.wq_du(x).view(batch, seq, g.num_heads, g.head_dim))
        k = self.k_sconv(self.wk_dv(x), positions, cache.conv_k if cache is not None else None)
        v = self.v_sconv(self.wv_dv(x), positions, cache.conv_v if cache is not None else None)
        k = self.k_norm(k.view(batch, seq, g.num_kv_heads, g.head_dim))
        v = v.view(batch, seq, g.num_kv_heads, g.head_dim)
        rel = self.rel_logits_proj(self.wr_du(x).view(batch, seq, g.num_heads, -1))
        if g.log_scaling:
            tau = log_scaling(positions, self.n_floor, self.alpha)[:, :, None, None]
            q = (q.float() * tau).to(q.dtype)
            rel = (rel.float() * tau).to(rel.dtype)

        if cache is None:
            keys, values, key_pos, real = k, v, positions, None
        else:
            keys, values, key_pos = cache.write_kv(k, v, positions, g.window)
            real = positions != cache.pad_position
        out = relative_attention(q, keys, values, rel, positions, key_pos, g.window, self.scale, real)
        return self.wo_ud(out.reshape(batch, seq, -1))
