"""The models a run compares: ``checkpoint`` weights load the preset's seeded synthetic checkpoint into transformers
and into ours (shared embedding / head); ``random`` weights (the ``full`` default) build both on the device with
random init. ``full`` keeps the real per-depth dims with 1 MTP depth and a 2-layer trunk."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import InklingConfig, InklingForConditionalGeneration
from transformers.modeling_layers import MtpModel

from inkling_compiled import InklingMTP, MTPConfig
from inkling_compiled.testing.synthetic import cached_checkpoint, load_hf_mtp, load_hf_target, preset_config, randomize_
from inkling_compiled.training.distill import distill


@dataclass
class Models:
    preset: str
    weights: str  # "checkpoint" | "random"
    device: torch.device
    dtype: torch.dtype
    mtp: InklingMTP
    target: object | None = None  # transformers InklingForConditionalGeneration
    hf_mtp: object | None = None  # transformers MtpModel
    checkpoint: Path | None = None

    @property
    def config(self):
        return self.mtp.config

    def describe(self) -> dict:
        c, g = self.mtp.config, self.mtp.config.depths[0]
        return {"preset": self.preset, "weights": self.weights, "checkpoint": str(self.checkpoint or ""),
                "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "logits_vocab_size": c.logits_vocab_size,
                "intermediate_size": c.intermediate_size, "depth0": {
                    "sliding": g.sliding, "heads": g.num_heads, "kv_heads": g.num_kv_heads, "head_dim": g.head_dim,
                    "window": g.window, "rel_extent": g.rel_extent},
                "num_depths": c.num_depths,
                "mtp_parameters": sum(p.numel() for n, p in self.mtp.named_parameters() if n.startswith("layers."))}


def load_models(preset: str, *, device="cpu", dtype=torch.float32, weights: str | None = None,
                peer: bool = True) -> Models:
    """Build ``preset``'s models on ``device`` in ``dtype`` (see module doc); ``peer=False`` skips transformers."""
    device, weights = torch.device(device), weights or ("random" if preset == "full" else "checkpoint")
    overrides = dict(num_mtp_layers=1, local_layer_ids=(0,), num_hidden_layers=2) if preset == "full" else {}
    target = hf_mtp = path = None
    if weights == "random":
        raw = preset_config(preset, **overrides)
        hf_config = InklingConfig.from_dict(raw)
        if peer:
            torch.manual_seed(0)
            with torch.device(device):
                target = InklingForConditionalGeneration._from_config(hf_config, dtype=dtype)
                hf_mtp = MtpModel(target, hf_config.text_config.num_mtp_layers).to(dtype)
        with torch.device("meta"):
            mtp = InklingMTP(MTPConfig.from_hf(hf_config, raw=raw))
        mtp = randomize_(mtp.to_empty(device=device).to(dtype), 0, mup=mtp.config.mup)  # the checkpoints' scales
    else:
        path = cached_checkpoint(preset, **overrides)
        if peer:
            target = load_hf_target(path, dtype=dtype).to(device)
            hf_mtp = load_hf_mtp(target).to(device=device, dtype=dtype)
        mtp = InklingMTP.from_pretrained(path, dtype=dtype, device=device, target=target)  # shares the target's
    if peer:
        target.eval().requires_grad_(False)
        hf_mtp.eval().requires_grad_(False)
    return Models(preset, weights, device, dtype, mtp.eval().requires_grad_(False), target, hf_mtp, path)


def distilled(preset: str = "tiny8", steps: int | None = None) -> Path:
    """The synthetic ``preset`` with its MTP self-distilled (both cached after the first run)."""
    return distill(cached_checkpoint(preset), progress=True, **({"steps": steps} if steps else {}))


def left_pad(prompts: list[torch.Tensor], pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D prompts of different lengths as one left-padded batch: (ids, attention mask)."""
    ids = pad_sequence(prompts, batch_first=True, padding_value=pad_token_id, padding_side="left")
    return ids, pad_sequence([torch.ones_like(p) for p in prompts], batch_first=True, padding_side="left")
