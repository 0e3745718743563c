"""Short convolution: depthwise causal conv with K taps and an identity residual, in fp32 (docs/model.md §4.7,
docs/protocol.md §6.6).

``SConv(x)_t = x_t + sum_k w[:, 0, k] * x_{t-(K-1)+k}`` with x = 0 before position 0, rounded once to x's dtype.
With a cache the conv *inputs* are stored by absolute position (docs/protocol.md §6.6): the current rows are written
first, then all K taps are read back by position, so re-running a position simply overwrites its slot and rollback is
free. A row's taps are its own sequence's earlier positions; slots before position 0 enter as exact zeros (a select, not
a multiply), so whatever a cache slot holds reaches only the rows whose taps cover it.
"""

import torch
import torch.nn.functional as F
from torch import nn


class ShortConv(nn.Module):
    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel_size))  # checkpoint layout [C, 1, K]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, C]; positions: [B, T]; state: [B_cache, S, C] conv inputs by position, or None (rows = whole
        sequence)."""
        taps = self._taps(x, positions, state) if state is not None else self._taps_stateless(x)
        w = self.weight.float()
        out = x.float()
        for k, tap in enumerate(taps):
            out = out + w[:, 0, k] * tap.float()
        return out.to(x.dtype)

    def _taps_stateless(self, x: torch.Tensor) -> list[torch.Tensor]:
        seq = x.shape[1]
        padded = F.pad(x, (0, 0, self.kernel_size - 1, 0))
        return [padded[:, k : k + seq] for k in range(self.kernel_size)]

    def _taps(self, x: torch.Tensor, positions: torch.Tensor, state: torch.Tensor) -> list[torch.Tensor]:
        rows = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(positions)
        state.index_put_((rows, positions), x.detach().to(state.dtype))  # inference state: no autograd history
        taps = []
        for k in range(self.kernel_size):
            back = positions - (self.kernel_size - 1 - k)
            tap = state[rows, back.clamp(min=0)]
            taps.append(torch.where((back >= 0)[..., None], tap, torch.zeros_like(tap)))
        return taps
