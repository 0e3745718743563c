"""An MTP depth's input block as one reduction kernel (docs/compile.md §4; docs/model.md §4.2-§4.4).

What the model emits per depth (``inkling_compiled.model.depth_input``)::

    e = normed_embedding(E, ids, w_pre, eps)       # bf16(rms_norm(E[ids], w_pre)); no norm when w_pre is None
    z = concat_normed(h, e, w_h, w_e, eps, True)   # cat([rms_norm(h, w_h), rms_norm(e, w_e)], -1), or embed-first

Stock Inductor already writes both halves straight into the concat buffer, but as two loop nests (two Triton
kernels on GPU): one per half. The replacements put the halves on the two rows of a ``[..., 2, H]`` tensor, so
every norm in the block is the same row-wise reduction over one iteration space and Inductor emits a single kernel
that writes the concat buffer; the final ``[..., 2, H] -> [..., 2H]`` reshape is free. Every output element goes
through the same ops in the same order as in the unfused graph, so the result is bitwise equal to stock compile.

Two fusions, tried in this order on the ``cat`` node:

* ``fuse_draft_input_embed``: gather + backbone norm + its rounding to the table dtype + both depth norms + cat.
* ``fuse_draft_input``: the two depth norms + cat, whatever produced the embedding: the ``inputs_embeds`` path, a raw
  gather (no backbone norm; Inductor inlines the gather into the kernel), or a chain the first fusion declined.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from ..model import depth_input as model_depth_input
from ..model import norm as model_norm
from ..model.depth_input import concat_normed, normed_embedding
from ..model.norm import rms_norm

if TYPE_CHECKING:
    from torch._inductor.pattern_matcher import Match, PatternMatcherPass

from .fusion import Fusion, is_python_scalar, register, same_shape, tensor_meta, trace, trace_without_round_trips

# scalar_workaround stand-in for eps: exact in fp32 and unequal to every other literal in these graphs (2, -1,
# True), so the traced pattern takes the graph's eps as an argument instead of ignoring it.
_EPS_PLACEHOLDER = 2.0**-20

# (activation dtype, norm-weight dtype) pairs: casts that are no-ops vanish from the graph, so each pair traces to a
# different pattern. fp16 traces like bf16 (dtypes are wildcards until the match is re-traced at its real dtypes).
_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32))
_RANKS = (2, 3)  # [N, H] rows or [B, T, H]


# --- shared pieces of the replacements -----------------------------------------------------------------------


def _row_mask(t: torch.Tensor) -> torch.Tensor:
    """``[2, 1]`` bool, True on row 0: selects per row of a ``[..., 2, H]`` tensor, broadcasting over H."""
    return (torch.arange(2, device=t.device) == 0).unsqueeze(-1)


def _rows(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``[..., H]`` pair -> ``[..., 2, H]``. A broadcasting ``where``, not stack/cat: a reduction reading a
    stack/cat output gets a copy kernel in front of it, while a ``where`` is inlined into the reduction."""
    return torch.where(_row_mask(first), first.unsqueeze(-2), second.unsqueeze(-2))


def _rms_norm_recomputed(make_x, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(make_x(), weight, eps)`` op for op, building ``make_x()`` afresh for each of its two reads.

    Inductor stores a pointwise value that has two readers once it loads more than 4 buffers
    (``realize_reads_threshold``); the rows fed to the depth norm after the backbone norm load 5 (hidden, ids,
    table, backbone rstd, backbone weight), and the stored ``[..., 2, H]`` copy is then reduced in a loop nest of
    its own (measured: 3 nests instead of 1). Two single-reader copies are inlined into the one kernel instead
    (their identical reductions are CSE'd there). The op order must stay that of
    :func:`inkling_compiled.model.norm.rms_norm` (tests compare bitwise).
    """
    x = make_x()
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (make_x().float() * torch.rsqrt(variance + eps) * weight.float()).to(x.dtype)


def _ordered(hidden_first: bool, hidden_side, embed_side):
    return (hidden_side, embed_side) if hidden_first else (embed_side, hidden_side)


# --- fusion "fuse_draft_input_embed": gather + backbone norm + both depth norms + cat -------------------------


def _embed_search(hidden_first: bool):
    # The model's own two calls (the pattern is what mtp.py emits, by construction).
    def concat_normed_from_ids(hidden, table, input_ids, pre_norm_weight, hidden_norm_weight, embed_norm_weight, eps):
        embeds = normed_embedding(table, input_ids, pre_norm_weight, eps)
        return concat_normed(hidden, embeds, hidden_norm_weight, embed_norm_weight, eps, hidden_first)

    return concat_normed_from_ids


def _embed_replace(hidden_first: bool):
    def concat_normed_from_ids_one_kernel(hidden, table, input_ids, pre_norm_weight, hidden_norm_weight,
                                        embed_norm_weight, eps):
        embed_row = ~_row_mask(hidden) if hidden_first else _row_mask(hidden)

        def depth_norm_input():
            # Row of the hidden: the hidden itself. Row of the embedding: its backbone norm, rounded to the table
            # dtype (docs/model.md §4.9). The backbone norm of the hidden row is computed too, then discarded: that
            # keeps both reductions in the same [..., 2] iteration space.
            gathered = normed_embedding(table, input_ids, None, eps)
            x = _rows(*_ordered(hidden_first, hidden, gathered))
            return torch.where(embed_row, rms_norm(x, pre_norm_weight, eps), x)

        weight = torch.where(_row_mask(hidden), *_ordered(hidden_first, hidden_norm_weight, embed_norm_weight))
        return _rms_norm_recomputed(depth_norm_input, weight, eps).flatten(-2)

    return concat_normed_from_ids_one_kernel


# --- fusion "fuse_draft_input": the two depth norms + cat -----------------------------------------------------


def _bare_search(hidden_first: bool):
    # concat_normed alone: the inputs_embeds path (no gather in the graph), or a gather without backbone norm.
    def concat_normed_from_embeds(hidden, embeds, hidden_norm_weight, embed_norm_weight, eps):
        return concat_normed(hidden, embeds, hidden_norm_weight, embed_norm_weight, eps, hidden_first)

    return concat_normed_from_embeds


def _bare_replace(hidden_first: bool):
    def concat_normed_from_embeds_one_kernel(hidden, embeds, hidden_norm_weight, embed_norm_weight, eps):
        # Recomputed rows even here: ``embeds`` may itself be an unstored pointwise chain (e.g. a backbone norm
        # with another eps), and then one shared copy of the rows would be stored and reduced in a pass of its own.
        weight = torch.where(_row_mask(hidden), *_ordered(hidden_first, hidden_norm_weight, embed_norm_weight))
        return _rms_norm_recomputed(lambda: _rows(*_ordered(hidden_first, hidden, embeds)), weight, eps).flatten(-2)

    return concat_normed_from_embeds_one_kernel


# --- predicates ----------------------------------------------------------------------------------------------


def _norm_eps_literals(match: Match) -> set:
    """The eps of every RMSNorm in the matched nodes: the scalar added to a ``mean`` (``variance + eps``)."""
    found = set()
    for node in match.nodes:
        if node.target is torch.ops.aten.add.Tensor and len(node.args) == 2:
            base, eps = node.args
            if isinstance(base, torch.fx.Node) and base.target is torch.ops.aten.mean.dim:
                found.add(eps)
    return found


def _one_literal_eps(match: Match) -> bool:
    """The norms being merged all add the same literal eps (the replacement applies one eps to every row).

    torch 2.13 hands the predicate the eps as a match argument; 2.11 re-traces with the real value, so its re-traced
    pattern holds eps as a literal and the match has no ``eps`` argument: then the literals alone decide.
    """
    literals = _norm_eps_literals(match)
    eps = match.kwargs.get("eps", next(iter(literals)) if len(literals) == 1 else None)
    return is_python_scalar(eps) and literals == {eps}


def _gains_fit(match: Match, hidden: torch.Tensor, names: tuple[str, ...]) -> bool:
    """Norm gains are plain ``[H]`` vectors (they are stacked into ``[2, H]``)."""
    for name in names:
        w = tensor_meta(match, name)
        if w is None or not same_shape(w.shape, hidden.shape[-1:]):
            return False
    return True


def _embed_chain_fits(match: Match) -> bool:
    hidden, table, ids = (tensor_meta(match, n) for n in ("hidden", "table", "input_ids"))
    if hidden is None or table is None or ids is None:
        return False
    return (
        _one_literal_eps(match)
        and hidden.dtype == table.dtype  # one [..., 2, H] tensor of one dtype (cat would otherwise promote)
        and table.dim() == 2
        and same_shape(table.shape[-1:], hidden.shape[-1:])
        and not ids.dtype.is_floating_point
        and _gains_fit(match, hidden, ("pre_norm_weight", "hidden_norm_weight", "embed_norm_weight"))
    )


def _two_norms_fit(match: Match) -> bool:
    hidden, embeds = tensor_meta(match, "hidden"), tensor_meta(match, "embeds")
    if hidden is None or embeds is None:
        return False
    return (
        _one_literal_eps(match)
        and hidden.dtype == embeds.dtype
        and same_shape(hidden.shape[-1:], embeds.shape[-1:])  # cat already forces the leading dims equal
        and _gains_fit(match, hidden, ("hidden_norm_weight", "embed_norm_weight"))
    )


# --- registration ----------------------------------------------------------------------------------------------


def _examples(act: torch.dtype, wdt: torch.dtype, rank: int):
    lead = (2, 3) if rank == 3 else (3,)  # no size-1 dims: at size 1 some ops are no-ops the tracer drops
    hidden = torch.empty(*lead, 8, dtype=act)
    table = torch.empty(5, 8, dtype=act)
    ids = torch.zeros(lead, dtype=torch.int64)  # real ids: tracing runs the gather
    w_pre, w_h, w_e = (torch.empty(8, dtype=wdt) for _ in range(3))
    return hidden, table, ids, w_pre, w_h, w_e


def _register_embed_chain(patterns: PatternMatcherPass) -> None:
    for (act, wdt), rank, hidden_first in itertools.product(_DTYPES, _RANKS, (True, False)):
        hidden, table, ids, w_pre, w_h, w_e = _examples(act, wdt, rank)
        # bf16: the rounding between the two embedding norms is gone from the graph torch 2.11 hands us
        for tracer in (trace, trace_without_round_trips) if act != torch.float32 else (trace,):
            register(_embed_search(hidden_first), _embed_replace(hidden_first),
                     (hidden, table, ids, w_pre, w_h, w_e), patterns, _embed_chain_fits, {"eps": _EPS_PLACEHOLDER},
                     tracer=tracer)


def _register_two_norms(patterns: PatternMatcherPass) -> None:
    for (act, wdt), rank, hidden_first in itertools.product(_DTYPES, _RANKS, (True, False)):
        hidden, _, _, _, w_h, w_e = _examples(act, wdt, rank)
        embeds = torch.empty_like(hidden)
        register(_bare_search(hidden_first), _bare_replace(hidden_first), (hidden, embeds, w_h, w_e),
                 patterns, _two_norms_fit, {"eps": _EPS_PLACEHOLDER})


_SOURCES = (__file__, model_depth_input.__file__, model_norm.__file__)

FUSIONS = (
    Fusion("fuse_draft_input_embed", _register_embed_chain, _SOURCES),
    Fusion("fuse_draft_input", _register_two_norms, _SOURCES),
)
