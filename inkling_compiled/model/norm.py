"""RMSNorm, the one norm every Inkling MTP module uses (docs/model.md §4.1, §4.9).

Computed in fp32 and rounded once to the input dtype: ``w * x / sqrt(mean(x^2) + eps)``. This is vLLM's rounding
(``x * rstd * w`` in fp32, one cast); transformers rounds the normalised value before the gain, a <= 1-ulp
difference in bf16 and none in fp32. The Inductor pass ``fuse_draft_input`` matches the graph of :func:`rms_norm`,
so the model and the pass share this single definition.
"""

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-gain RMSNorm over the last dim, fp32 math, one rounding to ``x.dtype``."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return (x32 * torch.rsqrt(variance + eps) * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    """Module wrapper around :func:`rms_norm` with a ``weight`` gain (checkpoint key ``*.weight``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
