"""The target's merged input rows of a multimodal prompt, which the drafter's prefill reads (docs/model.md §7).

transformers' Inkling builds its language model's input rows as the normed token embeddings with the vision / audio
tower outputs scattered into the placeholder rows. :func:`merged_rows` rebuilds them with the target's own public
pieces (``get_input_embeddings``, ``get_image_features`` / ``get_audio_features``, ``get_placeholder_mask``); the
speculative loop then runs the target's prefill on these rows (so both models read the same tensor) and feeds them,
shifted one ahead, to the drafter.
"""

from __future__ import annotations

import torch

# generate()'s keyword arguments that carry a prompt's image and audio inputs
MULTIMODAL_KWARGS = ("pixel_values", "audio_input_ids", "audio_input_ids_mask", "mm_encoder_outputs")


def merged_rows(target, input_ids: torch.Tensor, *, pixel_values=None, audio_input_ids=None,
                audio_input_ids_mask=None, mm_encoder_outputs=None) -> torch.Tensor | None:
    """[B, L, H] the rows the target's language model reads for this prompt, or None for a text-only prompt.

    ``mm_encoder_outputs`` is what ``generate`` pre-encodes (``{"image": <vision output>}``); ``pixel_values`` are
    encoded here otherwise. A placeholder count that does not match the features is transformers' own ValueError.
    """
    image = (mm_encoder_outputs or {}).get("image")
    if image is None and pixel_values is None and audio_input_ids is None:
        return None
    base = target.model
    if not hasattr(base, "get_placeholder_mask"):
        raise ValueError(f"{type(target).__name__} takes no image or audio inputs (pixel_values / audio_input_ids / "
                         "mm_encoder_outputs); use InklingForConditionalGeneration")
    if image is not None and pixel_values is not None:
        raise ValueError("pass pixel_values or mm_encoder_outputs['image'], not both")
    if audio_input_ids_mask is not None and audio_input_ids is None:
        raise ValueError("audio_input_ids_mask was given without audio_input_ids")
    rows = base.get_input_embeddings()(input_ids)
    if image is None and pixel_values is not None:
        image = base.get_image_features(pixel_values, return_dict=True)
    if image is not None:
        rows = _scatter(base, input_ids, rows, image.pooler_output, base.config.image_token_id)
    if audio_input_ids is not None:
        audio = base.get_audio_features(audio_input_ids, audio_input_ids_mask).last_hidden_state
        rows = _scatter(base, input_ids, rows, audio, base.config.audio_token_id)
    return rows


def _scatter(base, input_ids: torch.Tensor, rows: torch.Tensor, features: torch.Tensor, token_id: int) -> torch.Tensor:
    features = features.to(rows.device, rows.dtype)
    return rows.masked_scatter(base.get_placeholder_mask(input_ids, rows, features, token_id), features)
