"""The shared LM head with muP (docs/model.md §5): logits = (g / mup) @ U^T, truncated to the unpadded vocab.

A plain function so the pass ``inkling_compiled.passes.fold_mup_scale`` traces the same graph the model emits; under
``torch.compile`` the division is folded into the GEMM's alpha.
"""

import torch
import torch.nn.functional as F


def mup_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor, mup: float, vocab: int) -> torch.Tensor:
    """Logits of the shared head for ``hidden`` (not yet divided by muP), keeping the first ``vocab`` ids."""
    logits = F.linear(hidden / mup, lm_head_weight)
    return logits[..., :vocab]
