"""The muP LM head as one GEMM with the scale in its alpha (docs/compile.md §5; docs/model.md §5).

The model emits ``mup_logits``: ``F.linear(hidden / mup, U)[..., :vocab]``. Post-grad that is
``div -> (reshape) -> mm(., permute(U)) -> (reshape) -> slice``: a pointwise kernel for the division and an extern
``mm``. The replacement is ``addmm(unused, x2d, U.t(), beta=0, alpha=1/mup)``: one GEMM call that scales in its
fp32 epilogue, as vLLM does, and no pointwise kernel at all. In bf16 the logits can differ from the unfused compile
by 1 ulp (the scaled hidden is no longer rounded to bf16 before the GEMM); in fp32 by float rounding only.

The pattern stops at the GEMM, so the slice to the unpadded vocab, an ``argmax`` (``get_top_tokens``) or a
softmax stay behind as its consumers and never change what matches. Only the model's own spelling is registered,
and only the model's ops match (see :func:`~inkling_compiled.passes.fusion.emitted_by_model`). A tensor scale (0-d
or not) never matches: alpha must be a literal.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from ..model import head as model_head
from ..model.head import mup_logits

if TYPE_CHECKING:
    from torch._inductor.pattern_matcher import Match, PatternMatcherPass

from .fusion import Fusion, is_python_scalar, register, same_shape, tensor_meta

# scalar_workaround stand-in for the scale: exact in fp32 and unequal to every other literal in these graphs.
_SCALE_PLACEHOLDER = 1234.5

_DTYPES = (torch.float32, torch.bfloat16)  # dtypes only change casts around, not the GEMM graph; both for safety
_RANKS = (2, 3)  # 3-D adds the reshapes around the mm


def _unused_bias(x2d: torch.Tensor) -> torch.Tensor:
    """The ``addmm`` bias that ``beta=0`` ignores. ``new_empty`` is a bare allocation (``zeros`` would add a fill
    kernel); but Inductor's GEMM templates (max-autotune) compute ``bias * beta``, which is NaN for garbage memory,
    so those get real zeros (one element)."""
    from torch._inductor import config as inductor_config

    if inductor_config.max_autotune or inductor_config.max_autotune_gemm:
        return x2d.new_zeros(1)
    return x2d.new_empty(1)


def _scaled_linear(hidden: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * (hidden @ weight.T)`` as one GEMM over the rows of ``hidden`` (any leading shape)."""
    x2d = hidden.reshape(-1, hidden.shape[-1])
    out = torch.addmm(_unused_bias(x2d), x2d, weight.t(), beta=0, alpha=alpha)
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


# --- the model's spelling: (g / mup) @ U^T -------------------------------------------------------------------


def mup_logits_full_vocab(hidden, lm_head_weight, mup):
    # The model's function at full vocab: that slice is a no-op the tracer drops, so the pattern ends at the GEMM.
    return mup_logits(hidden, lm_head_weight, mup, lm_head_weight.shape[0])


def mup_logits_alpha(hidden, lm_head_weight, mup):
    return _scaled_linear(hidden, lm_head_weight, 1.0 / mup)


# --- predicate -------------------------------------------------------------------------------------------------


def _literal_scale_gemm(match: Match) -> bool:
    """A literal, finite, non-zero scale (never a tensor, never a symbolic value), and the matched ops really are
    ``hidden @ weight.T`` over the rows of ``hidden``.

    The patterns are not re-traced at the real shapes (see ``register(retrace=False)``), so the literals the first
    match ignored are checked here: the permute is the transpose, and the result has ``hidden``'s leading dims
    and the weight's rows (a reshape that keeps the last dim only merges or splits the leading dims).
    """
    mup = match.kwargs.get("mup")
    if not is_python_scalar(mup) or mup == 0 or mup != mup or abs(mup) == float("inf"):
        return False
    hidden, weight = tensor_meta(match, "hidden"), tensor_meta(match, "lm_head_weight")
    if hidden is None or weight is None or weight.dim() != 2 or hidden.dtype != weight.dtype:
        return False
    if not same_shape(hidden.shape[-1:], weight.shape[1:]):
        return False
    for node in match.nodes:
        if node.target is torch.ops.aten.permute.default and list(node.args[1]) != [1, 0]:
            return False
        if node.target is torch.ops.aten.mm.default:
            rows = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
            if rows is None or rows.dim() != 2 or not same_shape(rows.shape[1:], hidden.shape[-1:]):
                return False
    out = match.output_node().meta.get("val")
    return isinstance(out, torch.Tensor) and same_shape(out.shape, (*hidden.shape[:-1], weight.shape[0]))


# --- registration ----------------------------------------------------------------------------------------------


def _register(patterns: PatternMatcherPass) -> None:
    for dtype, rank in itertools.product(_DTYPES, (3, 2)):
        # 3-D first: its pattern (with the reshapes) is the larger one on the same graph.
        lead = (2, 3) if rank == 3 else (3,)  # no size-1 dims: the tracer would drop no-op reshapes around them
        hidden = torch.empty(*lead, 8, dtype=dtype)
        weight = torch.empty(5, 8, dtype=dtype)
        # retrace=False: the reshapes around the mm carry symbolic sizes under dynamic shapes (see register())
        register(mup_logits_full_vocab, mup_logits_alpha, (hidden, weight), patterns, _literal_scale_gemm,
                 {"mup": _SCALE_PLACEHOLDER}, retrace=False)


FUSIONS = (Fusion("fold_mup_scale", _register, (__file__, model_head.__file__)),)
