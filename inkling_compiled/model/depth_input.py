"""The input side of an MTP depth: embedding lookup, the two embedding norms, the hidden norm, the concat
(docs/model.md §4.2-4.4).

Kept as plain functions so the Inductor pass ``inkling_compiled.passes.fuse_draft_input`` traces exactly these to
build its patterns: what the pass matches is, by construction, what the model emits.
"""

import torch
import torch.nn.functional as F

from .norm import rms_norm


def normed_embedding(table: torch.Tensor, input_ids: torch.Tensor, pre_norm_weight: torch.Tensor | None,
                     eps: float) -> torch.Tensor:
    """``bf16(embed_norm(E[x]))``: the target's own normed token embedding (skipped norm when it has none).

    The result is in the table's dtype, i.e. rounded between the backbone norm and the depth's norm
    (docs/model.md §4.2).
    """
    embeds = F.embedding(input_ids, table)
    if pre_norm_weight is None:
        return embeds
    return rms_norm(embeds, pre_norm_weight, eps)


def concat_normed(hidden: torch.Tensor, embeds: torch.Tensor, hidden_norm_weight: torch.Tensor,
                  embed_norm_weight: torch.Tensor, eps: float, hidden_first: bool) -> torch.Tensor:
    """``[hidden_norm(g) | embed_norm(e)]`` (hidden first on Inkling; the other order behind the config flag)."""
    h = rms_norm(hidden, hidden_norm_weight, eps)
    e = rms_norm(embeds, embed_norm_weight, eps)
    return torch.cat([h, e] if hidden_first else [e, h], dim=-1)
