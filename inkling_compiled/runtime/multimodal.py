"""The target's merged input rows of a multimodal prompt, which the drafter's prefill reads (docs/model.md §7).

transformers' Inkling builds its language model's input rows as the normed token embeddings with the vision / audio
tower outputs scattered into the placeholder rows. :func:`merged_rows` rebuilds them with the target's own public
pieces (``get_input_embeddings``, ``get_image_features`` / ``get_audio_features``, ``get_placeholder_mask``); the
speculative loop then runs the target's prefill on these rows (so both models read the same tensor) and feeds them,
shifted one ahead, to the drafter.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch

from ..arguments import ArgumentError, ids_below, integer_tensor

# generate()'s keyword arguments that carry a prompt's image and audio inputs
MULTIMODAL_KWARGS = ("pixel_values", "audio_input_ids", "audio_input_ids_mask", "mm_encoder_outputs")
# the mm_encoder_outputs keys transformers' Inkling reads (generate pre-encodes images only; audio is encoded inside)
ENCODER_OUTPUT_KEYS = ("image",)


def check_drafter_takes_rows(drafter, media: dict) -> None:
    """A multimodal prompt's rows reach ``drafter.draft`` as ``inputs_embeds``, which a text-only drafter may leave
    out of its signature (``DraftSource``): refused by name before any model call, not a TypeError after the
    target's prefill. ``media``: the :data:`MULTIMODAL_KWARGS` given."""
    encoded = media.get("mm_encoder_outputs")
    if (media.get("pixel_values") is None and media.get("audio_input_ids") is None
            and not (isinstance(encoded, Mapping) and encoded.get("image") is not None)):
        return
    parameters = inspect.signature(drafter.draft).parameters.values()
    if not any(p.name == "inputs_embeds" or p.kind is p.VAR_KEYWORD for p in parameters):
        raise ArgumentError(f"an image or audio prompt needs a drafter whose draft takes inputs_embeds (the merged "
                            f"rows, docs/model.md §7); {type(drafter).__name__}.draft does not")


def merged_rows(target, input_ids: torch.Tensor, *, pixel_values=None, audio_input_ids=None,
                audio_input_ids_mask=None, mm_encoder_outputs=None) -> torch.Tensor | None:
    """[B, L, H] the rows the target's language model reads for this prompt, or None for a text-only prompt.

    ``mm_encoder_outputs`` is what ``generate`` pre-encodes (``{"image": <vision output>}``); ``pixel_values`` are
    encoded here otherwise. A placeholder count that does not match the features is transformers' own ValueError.
    """
    if not (mm_encoder_outputs is None or isinstance(mm_encoder_outputs, Mapping)):
        raise ArgumentError(f"mm_encoder_outputs must be a dict (generate's {{'image': <vision output>}}) or None, "
                            f"got {type(mm_encoder_outputs).__name__}")
    unknown = [key for key in (mm_encoder_outputs or {}) if key not in ENCODER_OUTPUT_KEYS]
    if unknown:  # transformers' Inkling would ignore them: an audio given there was silently left out
        raise ArgumentError(f"mm_encoder_outputs takes only the key 'image' (the target's vision output), got "
                            f"{unknown}")
    if audio_input_ids_mask is not None and audio_input_ids is None:
        raise ArgumentError("audio_input_ids_mask was given without audio_input_ids")
    image = (mm_encoder_outputs or {}).get("image")
    if image is None and pixel_values is None and audio_input_ids is None:
        return None
    base = target.model
    if not hasattr(base, "get_placeholder_mask"):
        raise ArgumentError(f"{type(target).__name__} takes no image or audio inputs (pixel_values / audio_input_ids / "
                            "mm_encoder_outputs); use InklingForConditionalGeneration")
    if image is not None and pixel_values is not None:
        raise ArgumentError("pass pixel_values or mm_encoder_outputs['image'], not both")
    pixel_values, audio_input_ids = _checked_media(target, pixel_values, audio_input_ids, audio_input_ids_mask)
    rows = base.get_input_embeddings()(input_ids)
    if image is None and pixel_values is not None:
        image = base.get_image_features(pixel_values, return_dict=True)
    if image is not None:
        rows = _scatter(base, input_ids, rows, _image_features(target, image), base.config.image_token_id)
    if audio_input_ids is not None:
        audio = base.get_audio_features(audio_input_ids, audio_input_ids_mask).last_hidden_state
        rows = _scatter(base, input_ids, rows, audio, base.config.audio_token_id)
    return rows


def _checked_media(target, pixel_values, audio_input_ids, audio_input_ids_mask):
    """(pixel_values, audio_input_ids as int64), or an ArgumentError naming the input whose type, shape, dtype,
    device or values the towers cannot take (they failed deep inside, or, for an id outside the codebook, with a
    device assert on CUDA; a NaN patch decoded garbage)."""
    config, embedding = target.config, target.model.get_input_embeddings().weight
    if pixel_values is not None:
        vision = config.vision_config
        patch = (vision.temporal_patch_size, vision.patch_size, vision.patch_size, vision.num_channels)
        tower = target.model.vision_tower  # a PreTrainedModel: the dtype of its floating-point parameters
        if (not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 5
                or tuple(pixel_values.shape[1:]) != patch or pixel_values.dtype != tower.dtype
                or pixel_values.device != tower.device):
            raise ArgumentError(f"pixel_values must be a {tower.dtype} tensor on {tower.device} of shape [patches, "
                                f"{', '.join(map(str, patch))}] (the target's vision patches), got "
                                f"{_described(pixel_values)}")
        if pixel_values.shape[0] == 0:  # the vision tower's reshape of no patches failed deep inside it
            raise ArgumentError("pixel_values hold no patches (shape [0, ...]); leave them out for a prompt without "
                                "images")
        if not bool(pixel_values.isfinite().all()):
            raise ArgumentError("pixel_values hold a NaN or inf")
    if audio_input_ids is not None:
        audio = config.audio_config
        audio_input_ids = integer_tensor("audio_input_ids", audio_input_ids, ndim=3)
        if audio_input_ids.shape[-1] != audio.num_codebooks or audio_input_ids.device != embedding.device:
            raise ArgumentError(f"audio_input_ids must be on {embedding.device} of shape [audios, frames, "
                                f"{audio.num_codebooks}] (the target's codebooks), got {_described(audio_input_ids)}")
        ids_below("audio_input_ids", audio_input_ids, audio.codebook_size, "the codebook")
    mask = audio_input_ids_mask
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != audio_input_ids.shape[:2]
                             or not bool(((mask == 0) | (mask == 1)).all())):
        raise ArgumentError(f"audio_input_ids_mask must be a 0 / 1 tensor of shape {list(audio_input_ids.shape[:2])} "
                            f"(audio_input_ids' [audios, frames]), got {_described(mask)}")
    return pixel_values, audio_input_ids


def _image_features(target, image) -> torch.Tensor:
    """The pooler_output of ``mm_encoder_outputs['image']``, or an ArgumentError saying what it must be (a bare
    tensor was an AttributeError from inside the merge; features of another width fail the placeholder count or,
    with the same element count, merge garbage)."""
    hidden = target.config.get_text_config().hidden_size
    features = getattr(image, "pooler_output", None)
    if not (isinstance(features, torch.Tensor) and features.is_floating_point() and features.dim() >= 2
            and features.shape[-1] == hidden):
        got = _described(image) if features is None else f"one whose pooler_output is {_described(features)}"
        raise ArgumentError(f"mm_encoder_outputs['image'] must be the target's vision output, as "
                            f"get_image_features(pixel_values, return_dict=True) returns it (its pooler_output a "
                            f"floating-point tensor [patches, 1, {hidden}]), got {got}")
    if not bool(features.isfinite().all()):  # as pixel_values: garbage rows the target would be prefilled with
        raise ArgumentError("the image features (mm_encoder_outputs['image'].pooler_output, which generate encodes "
                            "from pixel_values) hold a NaN or inf")
    return features


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor on {value.device} of shape {list(value.shape)}"
    return type(value).__name__


def _scatter(base, input_ids: torch.Tensor, rows: torch.Tensor, features: torch.Tensor, token_id: int) -> torch.Tensor:
    features = features.to(rows.device, rows.dtype)
    return rows.masked_scatter(base.get_placeholder_mask(input_ids, rows, features, token_id), features)
