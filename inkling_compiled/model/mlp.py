"""Dense MTP MLP: ``global_scale * W_down(act(W_gate m) * (W_up m))`` (docs/model.md §4.5, §8 items 6, 13, 14).

``w13_dn`` is held as ONE [2I, H] GEMM whose rows are [gate; up]. The checkpoint interleaves them
(gate, up, gate, up, ...); ``inkling_compiled.checkpoint`` de-interleaves on load and re-interleaves on save.
"""

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,  # exact erf GELU, as transformers' ACT2FN["gelu"]
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, use_global_scale: bool):
        super().__init__()
        self.act = ACTIVATIONS[hidden_act]
        self.w13_dn = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.w2_md = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.global_scale = nn.Parameter(torch.ones(1)) if use_global_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13_dn(x).chunk(2, dim=-1)
        y = self.w2_md(self.act(gate) * up)
        return y if self.global_scale is None else y * self.global_scale
