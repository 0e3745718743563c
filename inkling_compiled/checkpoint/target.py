"""The three shared tensors lent by a live transformers Inkling target (``from_pretrained(..., target=)``,
docs/model.md §3.6): its own Parameters, checked against the checkpoint config, never copied."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..config import MTPConfig, logits_vocab_size
from .layout import SAFETENSORS_NAMES, CheckpointError, aligned


def same_device(requested: torch.device, actual: torch.device) -> bool:
    """``"cuda"`` (no index) matches any CUDA device; an explicit index must match."""
    return requested.type == actual.type and (requested.index is None or requested.index == actual.index)


def target_shared_parameters(target: nn.Module, config: MTPConfig,
                             shapes: Mapping[str, torch.Size]) -> dict[str, nn.Parameter]:
    """The target's embedding table, backbone embed_norm gain and LM head, as its own Parameters (one that sits
    misaligned in a memory-mapped file is moved, in place, to an aligned allocation: the target keeps using it)."""
    get_text_config = getattr(getattr(target, "config", None), "get_text_config", None)
    text = get_text_config() if callable(get_text_config) else None
    if text is None or getattr(text, "model_type", None) != "inkling_text":
        raise CheckpointError(f"target must be a transformers Inkling model (InklingForCausalLM or "
                              f"InklingForConditionalGeneration), got {type(target).__name__}")
    compared = (("hidden_size", text.hidden_size, config.hidden_size),
                ("vocab_size", text.vocab_size, config.vocab_size),
                ("logits vocabulary (unpadded_vocab_size)", logits_vocab_size(target.config), config.logits_vocab_size),
                ("logits_mup_width_multiplier", text.logits_mup_width_multiplier, config.mup))
    mismatched = [f"{name}: target {theirs}, checkpoint {ours}" for name, theirs, ours in compared if theirs != ours]
    embedding = target.get_input_embeddings()
    embed_norm = getattr(embedding, "embed_norm", None)
    if (embed_norm is not None) != config.use_embed_norm:
        mismatched.append(f"embed_norm: the target's embedding {'has' if embed_norm is not None else 'has no'} "
                          f"embed_norm, the checkpoint config has use_embed_norm={config.use_embed_norm}")
    if mismatched:
        raise CheckpointError("target config does not match the MTP checkpoint config: " + "; ".join(mismatched))
    head_module = target.get_output_embeddings()
    if head_module is None:  # a bare InklingTextModel: the MTP shares the LM head, which only the CausalLM holds
        raise CheckpointError(f"target must be a transformers Inkling model with its LM head (InklingForCausalLM or "
                              f"InklingForConditionalGeneration), got {type(target).__name__}, which has none")
    shared = {"embed_weight": embedding.weight, "lm_head_weight": head_module.weight}
    if config.use_embed_norm:
        shared["embed_norm_weight"] = embed_norm.weight
    head = shared["lm_head_weight"]
    odd = [f"{n}: {p.dtype} on {p.device}, shape {list(p.shape)} (config: {list(shapes[n])})"
           for n, p in shared.items()
           if p.dtype not in SAFETENSORS_NAMES or (p.dtype, p.device) != (head.dtype, head.device)
           or p.shape != shapes[n]]
    if odd:
        raise CheckpointError("the target's shared tensors must be of one floating dtype on one device, with the "
                              "shapes the checkpoint config gives: " + "; ".join(odd))
    for param in shared.values():  # transformers' mmap loading leaves these misaligned too: realign in place, so
        with torch.no_grad():  # that the target (whose Parameter it stays) gets the faster layout as well
            param.data = aligned(param.data)
    return shared


