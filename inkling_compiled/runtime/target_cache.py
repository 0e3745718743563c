"""Per-row rollback of the target's transformers cache after a verification (docs/protocol.md §6.9).

transformers' caches roll back batch-wide only (``cache.crop(-n)`` drops the last n slots of every sequence). With
per-row acceptance, sequence b keeps ``keep_b = a_b + 1`` of the ``T = K + 1`` verified rows and rejects the other
``r_b = T - keep_b``. :func:`rollback_rows` crops the ``c = min_b r_b`` slots every sequence rejected, then moves
each sequence's kept slots right by its extra count ``e_b = r_b - c`` and masks the ``e_b`` slots that come in at the
front, exactly like left padding (the attention mask gets zeros there):

* **Why roll, not holes.** Inkling's attention builds its relative bias, its sliding window and its causal order
  from *storage* distances (the key's index in the cache against the query's), not from token positions. Masking the
  rejected slots where they are would leave holes between a sequence's kept tokens and the next round's rows, so
  every later query would see its earlier tokens one hole too far (the output then leaves the target's greedy
  continuation: tests/runtime/test_perrow.py). Rolled right, a sequence's kept tokens stay contiguous and end at
  the storage frontier, as if it had been run alone with more left padding; masked slots at the front are what
  left-padded ``generate`` already handles.
* **Full-attention layers**: in keys and values ``[B, H, N, D]`` each moving row's slot j takes slot ``j - e_b``
  (in place; the slots shifted in at the front keep stale values, finite and masked).
* **Sliding layers** (recording their past since the prefill) hold the last ``W - 1`` slots plus the verified rows;
  the same shift, then back to their working size ``W - 1``. The slots shifted in at their front fall outside that
  size or under the mask, since both move with the same ``e_b``.
* **Short-conv states** hold the last inputs plus the verified rows' inputs; each sequence's state becomes the
  ``kernel`` inputs ending at its own frontier (``r_b`` before the end).

Cost, per round: a copy of the moving rows' K/V in every layer (at most what ``DynamicCache.update`` already copies
once per forward with its ``torch.cat``), nothing when every sequence rejected the same count (then it is the plain
crop); ``bench/RESULTS.md`` has the measured figures against the target forward. The per-row counts come to the
host with the round's one sync. The query's own storage index enters only full layers' log scaling
(``log_scaling_n_floor``), which the rolled-in slots would shift: the loop checks that the storage cannot reach
that floor before it rolls.
"""

from __future__ import annotations

import torch


def _conv_layers(cache):
    return [layer for layer in cache.layers if hasattr(layer, "conv_states")]


def _shift_rows_right(storage: torch.Tensor, groups: list[tuple[int, torch.Tensor]], length: int, fill=None
                      ) -> torch.Tensor:
    """The first ``length`` slots (dim 2 of K/V [B, H, N, D], dim 1 of a mask [B, N]) with the rows of each
    ``(shift, rows)`` group moved right by ``shift`` slots, in place: the slots coming in at the front keep what they
    held (``fill`` if given). Only the rows that move are copied, one group of rows at a time; the storage is the
    layer's own (``DynamicCache.update`` builds a new one each forward)."""
    time_dim = 1 if storage.dim() == 2 else 2
    out = storage.narrow(time_dim, 0, length)
    for shift, rows in groups:
        moved = storage.index_select(0, rows).narrow(time_dim, 0, length - shift)  # a copy: source and target overlap
        if time_dim == 1:
            out[rows, shift:] = moved
            if fill is not None:
                out[rows, :shift] = fill
        else:
            out[rows, :, shift:] = moved
    return out


def _conv_taps(kernel: int, inputs: int, rejected: torch.Tensor) -> torch.Tensor:
    """[B, 1, kernel]: the indices of each sequence's ``kernel`` conv inputs ending ``rejected[b]`` before the end of
    a state holding ``inputs`` inputs."""
    start = inputs - kernel - rejected  # [B]: the first input of each sequence's state
    return (start[:, None] + torch.arange(kernel, device=rejected.device)[None, :])[:, None, :]


def rollback_rows(cache, attention_mask: torch.Tensor, rejected: list[int]) -> torch.Tensor:
    """Drop each sequence's last ``rejected[b]`` slots from ``cache`` (a recording Inkling ``DynamicCache`` just after
    a verify forward) and return the attention mask that goes with it.

    ``attention_mask`` [B, N] covers the verified rows; the result is [B, N - min(rejected)]. When every sequence
    rejected the same count this is the batch-wide crop; otherwise the sequences that rejected more move right.
    """
    common = min(rejected)
    length = attention_mask.shape[1] - common
    device = attention_mask.device
    groups = [(shift, torch.tensor([b for b, r in enumerate(rejected) if r - common == shift], device=device))
              for shift in sorted({r - common for r in rejected} - {0})]  # rows moving right by the same count
    rejected_t = torch.tensor(rejected, device=device) if groups else None
    taps = {}  # (kernel, inputs) -> indices, shared by the states of that shape
    for layer in _conv_layers(cache):
        for index, state in layer.conv_states.items():
            if state is None:
                continue
            kernel, inputs = layer.conv_kernel_size[index], state.shape[-1]
            if not groups:
                layer.conv_states[index] = state[..., inputs - common - kernel:inputs - common]
                continue
            if (kernel, inputs) not in taps:
                taps[kernel, inputs] = _conv_taps(kernel, inputs, rejected_t)
            layer.conv_states[index] = state.gather(-1, taps[kernel, inputs].expand(-1, state.shape[1], -1))
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is None or keys.dim() != 4:
            continue
        kept = keys.shape[2] - common
        layer.keys = _shift_rows_right(keys, groups, kept)
        layer.values = _shift_rows_right(layer.values, groups, kept)
        if getattr(layer, "is_sliding", False):
            layer.cumulative_length -= common
            working = layer.sliding_window - 1
            if layer.keys.shape[2] > working:
                layer.keys, layer.values = layer.keys[:, :, -working:], layer.values[:, :, -working:]
    return _shift_rows_right(attention_mask.clone() if groups else attention_mask, groups, length, fill=0)


def select_rows(cache, index: torch.Tensor) -> None:
    """Keep only the sequences ``index`` [B'] of ``cache`` (K/V and conv states of every layer), so that finished
    sequences drop out of the target's forward. transformers' ``batch_select_indices`` leaves conv states alone."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        for state_index, state in getattr(layer, "conv_states", {}).items():
            if state is not None:
                layer.conv_states[state_index] = state.index_select(0, index)
