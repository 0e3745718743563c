"""``InklingMTP``'s input and parameter checks (``InklingMTP.check_inputs`` / ``check_parameters``), kept apart from
the module so that ``mtp.py`` reads like the math.

Eager calls are validated before anything is computed or written; each check raises a ValueError naming the
argument and the value. Ids and positions may be of any integer dtype: they are converted to int64 once, here.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import arguments
from ..arguments import ArgumentError
from . import int8
from .cache import MTPCache
from .tensor_parallel import CHECKSUM, checksum

# Functions here take the model as an ``nn.Module`` (an ``InklingMTP``): importing its class would be a cycle.


def check_parameters(model: nn.Module) -> None:
    """ValueError naming the tensors when the floating parameters are not all of one dtype on one device (the target
    was converted after loading with ``target=``, so its shared tensors changed and the MTP's own did not), or when a
    quantized model no longer runs int8 kernels (converted to float32 after quantizing, say).

    Reads the modules the model holds now: quantizing swaps modules, and a snapshot would check replaced tensors."""
    if model.quantization is not None:
        int8.check_runs_int8(model.device, model.dtype, error=ValueError)
    kinds = {(p.dtype if p.is_floating_point() else None, p.device)
             for m in model.modules() for p in m._parameters.values() if p is not None}
    if len({device for _, device in kinds}) == 1 and len({dtype for dtype, _ in kinds} - {None}) == 1:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for name, p in model.named_parameters():
        groups.setdefault((p.dtype, p.device), []).append(name)
    parts = [f"{dtype} on {device}: {_some(names)}"
             for (dtype, device), names in sorted(groups.items(), key=lambda item: len(item[1]))]
    raise ValueError("the MTP's parameters are not all of one dtype on one device (" + "; ".join(parts)
                     + "). Was the target converted after loading? Its shared tensors "
                     f"({', '.join(n for n in model.SHARED if getattr(model, n) is not None)}) changed "
                     "with it: convert the MTP the same way (mtp.to(...)) or re-load it with target=")


def check_inputs(model: nn.Module, input_ids: torch.Tensor | None, positions: torch.Tensor,
                 previous_hidden: torch.Tensor, cache: MTPCache | None = None, depth: int = 0,
                 inputs_embeds: torch.Tensor | None = None, *, drafting: bool = False
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(input_ids, positions)`` as int64, or ArgumentError naming the problem for any bad argument, shape, dtype,
    device, id, position or value.

    Padding rows are those at ``cache.pad_position``; their positions and hidden values are not checked.
    ``drafting`` applies the Drafter's conventions instead: negative positions mark padding, and every sequence
    needs a real row (its draft is read off its last one). Reading the values costs one host sync; a
    tensor-parallel model's ranks then compare their inputs in one exchange (:meth:`TensorParallel.agree`).
    """
    if model.parallel is not None:  # every rank the same inputs, or an error on every rank
        def run():
            checked = checked_inputs_here(model, input_ids, positions, previous_hidden, cache, depth, inputs_embeds,
                                          drafting)
            return checked, input_fields(*checked, previous_hidden, cache, depth, inputs_embeds, drafting)
        return model.parallel.agree("the inputs", INPUT_FIELDS, run, fix=SAME_INPUTS)
    return checked_inputs_here(model, input_ids, positions, previous_hidden, cache, depth, inputs_embeds, drafting)


# What tensor-parallel ranks compare of a call's inputs (padding rows' contents aside: they reach no output)
INPUT_FIELDS = ("batch", "rows", "depth", "inputs_embeds given", CHECKSUM + "input_ids / inputs_embeds",
                CHECKSUM + "positions", CHECKSUM + "previous_hidden", "cache batch_size", "cache max_length")
SAME_INPUTS = "Every rank passes the same inputs: the ranks split the weights, not the rows."


def input_fields(input_ids, positions, previous_hidden, cache, depth, inputs_embeds, drafting) -> dict:
    """:data:`INPUT_FIELDS` of checked inputs (``input_ids`` and ``positions`` as int64)."""
    real = positions >= 0 if drafting or cache is None else positions != cache.pad_position
    given = input_ids.masked_fill(~real, 0) if input_ids is not None else inputs_embeds.where(real[..., None], 0)
    return {"batch": positions.shape[0], "rows": positions.shape[1], "depth": depth,
            "inputs_embeds given": int(inputs_embeds is not None), CHECKSUM + "input_ids / inputs_embeds":
            checksum(given), CHECKSUM + "positions": checksum(positions.masked_fill(~real, -1)),
            CHECKSUM + "previous_hidden": checksum(previous_hidden.where(real[..., None], 0)),
            "cache batch_size": cache.batch_size if cache is not None else 0,
            "cache max_length": cache.max_length if cache is not None else 0}


def checked_inputs_here(model, input_ids, positions, previous_hidden, cache, depth, inputs_embeds, drafting):
    """:func:`check_inputs` on this rank alone (a caller agreeing with the other ranks itself: the Drafter)."""
    check_parameters(model)
    h, n = model.config.hidden_size, model.config.num_depths
    if not arguments.is_int(depth):
        raise ArgumentError(f"depth must be an int in [0, {n}), got {depth!r}")
    if not 0 <= depth < n:
        raise ArgumentError(f"depth {depth} out of range: this model has {n} MTP depth(s)")
    if (input_ids is None) == (inputs_embeds is None):
        raise ArgumentError("pass exactly one of input_ids and inputs_embeds")
    positions = arguments.integer_tensor("positions", positions, ndim=2)
    _check_device("positions", positions, model.device)
    batch, seq = positions.shape
    if batch == 0 or seq == 0:
        raise ArgumentError(f"positions has no rows (shape {tuple(positions.shape)}): need B >= 1 and T >= 1")
    if input_ids is not None:
        input_ids = arguments.integer_tensor("input_ids", input_ids, ndim=2)
        _check_tensor("input_ids", input_ids, device=model.device, shape=(batch, seq))
    else:
        _check_tensor("inputs_embeds", inputs_embeds, ndim=3, device=model.device, shape=(batch, seq, h),
                      dtype=model.dtype)
    _check_tensor("previous_hidden", previous_hidden, ndim=3, device=model.device, shape=(batch, seq, h),
                  dtype=model.dtype)
    if cache is not None:
        _check_cache(model, cache, batch)
    if drafting:
        padding, note = positions < 0, "negative positions mark padding rows"
    elif cache is not None:
        padding, note = positions == cache.pad_position, f"{cache.pad_position} marks padding rows"
    else:
        padding, note = None, ""
    _check_values(model, input_ids, inputs_embeds, positions, previous_hidden, padding, cache, note, drafting)
    return input_ids, positions


def _check_cache(model: nn.Module, cache: MTPCache, batch: int) -> None:
    if not isinstance(cache, MTPCache):
        raise ArgumentError(f"cache must be an MTPCache (from new_cache), got {type(cache).__name__}")
    if batch > cache.batch_size:
        raise ArgumentError(f"batch of {batch} sequences exceeds the cache's batch_size {cache.batch_size}")
    if len(cache.depths) != model.config.num_depths:
        raise ArgumentError(f"cache has {len(cache.depths)} depth(s), the model {model.config.num_depths}")
    k = cache.depths[0].k
    if k.device != model.device or k.dtype != model.dtype:
        raise ArgumentError(f"cache is {k.dtype} on {k.device}, the model {model.dtype} on {model.device}")
    for i, (d, g) in enumerate(zip(cache.depths, model.local_config.depths)):
        got, want = (*d.k.shape[2:], d.conv_attn.shape[-1]), (g.num_kv_heads, g.head_dim, model.config.hidden_size)
        if got != want:
            raise ArgumentError(f"cache depth {i} holds (kv heads, head dim, hidden) {got}, the model's depth {i} "
                                f"needs {want}: the cache was built for another model")


def _check_values(model, input_ids, inputs_embeds, positions, previous_hidden, padding, cache, note, drafting) -> None:
    """Ids in the table; real rows at positions >= 0, consecutive per sequence and inside the cache, with finite
    inputs (and, drafting, at least one per sequence). Reduced on the device to a few numbers, one host sync."""
    if padding is None:
        padding = torch.zeros_like(positions, dtype=torch.bool)
    real, pos, none = ~padding, positions, torch.iinfo(torch.long).max
    first = pos.masked_fill(padding, none).amin(dim=1, keepdim=True)  # a sequence's earliest real row
    stats = [first.amin(), pos.masked_fill(padding, -1).amax(), first.amax()]
    if input_ids is not None:
        stats += torch.aminmax(input_ids)
    nonfinite = {name: real & ~x.isfinite().all(dim=-1)  # [B, T]: real rows holding a NaN or inf
                 for name, x in (("previous_hidden", previous_hidden), ("inputs_embeds", inputs_embeds))
                 if x is not None}
    stats += [bad.sum() for bad in nonfinite.values()]
    broken = real & (pos - first + 1 != real.cumsum(dim=1))  # the real rows, in column order, are first, first + 1..
    stats.append(broken.sum())
    values = torch.stack(stats).tolist()  # the one host sync
    lo, hi, last_first = values.pop(0), values.pop(0), values.pop(0)
    if drafting and last_first == none:
        row = int((first == none).nonzero()[0, 0])
        raise ArgumentError(f"sequence {row} has no real row (all its positions are negative): nothing to draft from")
    if input_ids is not None:
        lo_id, hi_id = values.pop(0), values.pop(0)
        vocab = model.embed_weight.shape[0]
        if lo_id < 0 or hi_id >= vocab:
            raise ArgumentError(f"token id {lo_id if lo_id < 0 else hi_id} out of range: ids must be in [0, {vocab}) "
                             "(the embedding table's rows)")
    if lo < 0:
        raise ArgumentError(f"position {lo} is negative")
    for (name, bad), count in zip(nonfinite.items(), values):
        if count:
            b, t = bad.nonzero()[0].tolist()
            raise ArgumentError(f"{name} holds a NaN or inf at sequence {b}, row {t} (position "
                                f"{int(positions[b, t])}): the inputs of real rows must be finite")
    if cache is not None and hi >= cache.max_length:
        raise ArgumentError(f"position {hi} is past the cache capacity: max_length is {cache.max_length} "
                            f"(positions 0..{cache.max_length - 1}; {note})")
    if values[-1]:  # the short convolutions read a sequence's rows as consecutive positions, cached or not
        row = int(broken.any(dim=1).nonzero()[0])
        raise ArgumentError(f"sequence {row}: positions {positions[row][real[row]].tolist()} are not consecutive; "
                            "the real rows of a sequence are consecutive positions" + (f" ({note})" if note else ""))


def check_ids(model: nn.Module, input_ids) -> torch.Tensor:
    """Token ids of any shape and integer dtype as int64, on the model's device and inside its embedding table
    (else an index error, on CUDA a device assert)."""
    if not isinstance(input_ids, torch.Tensor):
        raise ArgumentError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    input_ids = arguments.integer_tensor("input_ids", input_ids, ndim=input_ids.dim())
    _check_device("input_ids", input_ids, model.device)
    arguments.ids_below("input_ids", input_ids, model.embed_weight.shape[0], "the embedding table's rows",
                        what="token id")
    return input_ids


def check_hidden(model: nn.Module, hidden) -> None:
    """The head's input: a tensor [..., H] in the model's dtype and on its device (else a matmul error, or an
    integer hidden silently promoted)."""
    if not isinstance(hidden, torch.Tensor):
        raise ArgumentError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dim() < 1 or hidden.shape[-1] != model.config.hidden_size:
        raise ArgumentError(f"hidden has shape {tuple(hidden.shape)}, expected (..., {model.config.hidden_size})")
    if hidden.dtype != model.dtype:
        raise ArgumentError(f"hidden has dtype {hidden.dtype}, the model runs in {model.dtype}")
    _check_device("hidden", hidden, model.device)


def check_head_input(model: nn.Module, hidden) -> None:
    """:func:`check_hidden`; a tensor-parallel model's ranks then compare the hidden in one exchange (a rank with a
    bad one would otherwise leave the others waiting in the head's gather)."""
    if model.parallel is None:
        return check_hidden(model, hidden)
    model.parallel.agree("the head's hidden states", HEAD_FIELDS, lambda: (check_hidden(model, hidden), {
        "hidden dims": hidden.dim(), "hidden elements": hidden.numel(), CHECKSUM + "hidden": checksum(hidden)}),
        fix=SAME_INPUTS)


HEAD_FIELDS = ("hidden dims", "hidden elements", CHECKSUM + "hidden")


def _some(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ArgumentError(f"{name} is on {t.device}, the model on {device}")


def _check_tensor(name: str, t, *, device: torch.device, shape: tuple[int, ...], ndim: int | None = None,
                  dtype: torch.dtype | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ArgumentError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if tuple(t.shape) != shape:
        raise ArgumentError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if dtype is not None and t.dtype != dtype:
        raise ArgumentError(f"{name} has dtype {t.dtype}, the model runs in {dtype}")
    _check_device(name, t, device)
