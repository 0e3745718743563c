"""Per-row rollback of the target's transformers cache after a verification (docs/protocol.md §6.9).

transformers' caches roll back batch-wide only (``cache.crop(-n)`` drops the last n slots of every sequence). With
per-row acceptance, sequence b keeps ``keep_b = a_b + 1`` of the ``T = K + 1`` verified rows and rejects the other
``r_b = T - keep_b``. :func:`rollback_rows` crops the ``c = min_b r_b`` slots every sequence rejected, then moves
each sequence's kept slots right by its extra count ``e_b = r_b - c`` and masks the ``e_b`` slots that come in at the
front, exactly like left padding (the attention mask gets zeros there):

* **Why roll, not holes.** Inkling's attention builds its relative bias, its sliding window and its causal order
  from *storage* distances (the key's index in the cache against the query's), not from token positions. Masking the
  rejected slots where they are would leave holes between a sequence's kept tokens and the next round's rows, so
  every later query would see its earlier tokens one hole too far (measured: up to 3.9 logits off). Rolled right, a
  sequence's kept tokens stay contiguous and end at the storage frontier, as if it had been run alone with more
  left padding; masked slots at the front are what left-padded ``generate`` already handles.
* **Full-attention layers**: keys and values ``[B, H, N, D]`` are gathered at ``j - e_b`` (the slots shifted in
  at the front repeat slot 0 and are masked).
* **Sliding layers** (recording their past since the prefill) hold the last ``W - 1`` slots plus the verified rows;
  the same shift, then back to their working size ``W - 1``. The slots shifted in at their front fall outside that
  size or under the mask, since both move with the same ``e_b``.
* **Short-conv states** hold the last inputs plus the verified rows' inputs; each sequence's state becomes the
  ``kernel`` inputs ending at its own frontier (``r_b`` before the end).

Cost, per round: one gather of every full layer's K/V (what ``DynamicCache.update`` already copies once per forward
with its ``torch.cat``), skipped when every sequence rejected the same count (then it is the plain crop);
``bench/RESULTS.md`` has the measured figures against the target forward. The query's own storage index enters only
full layers' log scaling (``log_scaling_n_floor``), which the rolled-in slots would shift: the loop checks that the
storage cannot reach that floor before it rolls.
"""

from __future__ import annotations

import torch


def _conv_layers(cache):
    return [layer for layer in cache.layers if hasattr(layer, "conv_states")]


def _shift_right(storage: torch.Tensor, shift: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """``out[b, ..., j, ...] = storage[b, ..., j - shift[b], ...]`` for ``j < length`` along ``dim`` (slot 0 repeated
    where ``j < shift[b]``)."""
    index = (torch.arange(length, device=storage.device)[None, :] - shift[:, None]).clamp_min(0)  # [B, length]
    view = [storage.shape[0]] + [1] * (storage.dim() - 1)
    view[dim] = length
    shape = list(storage.shape)
    shape[dim] = length
    return storage.gather(dim, index.view(view).expand(shape))


def rollback_rows(cache, attention_mask: torch.Tensor, rejected: torch.Tensor, common: int, ragged: bool
                  ) -> torch.Tensor:
    """Drop each sequence's last ``rejected[b]`` slots from ``cache`` (a recording Inkling ``DynamicCache`` just after
    a verify forward) and return the attention mask that goes with it.

    ``common`` is ``min(rejected)`` (host int), ``ragged`` whether any row rejected more (host bool: without it the
    rollback is the batch-wide crop). ``attention_mask`` [B, N] covers the verified rows; the result is [B, N - common].
    """
    extra = rejected - common  # [B]: slots each sequence moves right
    length = attention_mask.shape[1] - common
    for layer in _conv_layers(cache):
        for index, state in layer.conv_states.items():
            if state is None:
                continue
            kernel, end = layer.conv_kernel_size[index], state.shape[-1] - common
            if not ragged:
                layer.conv_states[index] = state[..., end - kernel:end]
                continue
            start = state.shape[-1] - kernel - rejected  # [B]: the first input of each sequence's state
            taps = (start[:, None] + torch.arange(kernel, device=state.device)[None, :])[:, None, :]
            layer.conv_states[index] = state.gather(-1, taps.expand(-1, state.shape[1], -1))
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is None or keys.dim() != 4:
            continue
        kept = keys.shape[2] - common
        if ragged:
            layer.keys = _shift_right(keys, extra, kept, dim=2)
            layer.values = _shift_right(layer.values, extra, kept, dim=2)
        elif common:
            layer.keys, layer.values = keys[:, :, :kept], layer.values[:, :, :kept]
        if getattr(layer, "is_sliding", False):
            layer.cumulative_length -= common
            working = layer.sliding_window - 1
            if layer.keys.shape[2] > working:
                layer.keys, layer.values = layer.keys[:, :, -working:], layer.values[:, :, -working:]
    if not ragged:
        return attention_mask[:, :length]
    shifted = _shift_right(attention_mask, extra, length, dim=1)
    front = torch.arange(length, device=attention_mask.device)[None, :] < extra[:, None]
    return shifted.masked_fill(front, 0)


def select_rows(cache, index: torch.Tensor) -> None:
    """Keep only the sequences ``index`` [B'] of ``cache`` (K/V and conv states of every layer), so that finished
    sequences drop out of the target's forward. transformers' ``batch_select_indices`` leaves conv states alone."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        for state_index, state in getattr(layer, "conv_states", {}).items():
            if state is not None:
                layer.conv_states[state_index] = state.index_select(0, index)
