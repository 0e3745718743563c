"""The MTP view of an Inkling config: per-depth geometry and the few fields the draft head reads (spec §2).

transformers' config classes do the parsing (``InklingConfig`` promotes the top-level ``mtp_config`` into its
``text_config``); this module turns the result into a small frozen dataclass that the modules are built from, and
rejects values this implementation does not support with a message naming the field.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field

from transformers import InklingConfig, InklingTextConfig

SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


class ConfigError(ValueError):
    """A config value that the MTP head cannot be built from."""


@dataclass(frozen=True)
class DepthGeometry:
    """Attention geometry of one MTP depth (spec §2.3)."""

    sliding: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None  # keys visible including self; None = plain causal
    rel_extent: int  # E: relative bias is zero at distances >= E
    log_scaling: bool  # apply tau (spec §4.6 step 5) on this depth


@dataclass(frozen=True)
class MTPConfig:
    hidden_size: int
    vocab_size: int  # rows of the shared embed / unembed tables (padded)
    logits_vocab_size: int  # logits kept (unpadded_vocab_size, or vocab_size)
    rms_norm_eps: float
    depths: tuple[DepthGeometry, ...]
    d_rel: int
    conv_kernel_size: int
    intermediate_size: int
    hidden_act: str
    mup: float
    chain_hidden_post_norm: bool
    hidden_states_first: bool
    use_embed_norm: bool
    use_global_scale: bool
    log_scaling_n_floor: int | None
    log_scaling_alpha: float
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # config.json as read, for save_pretrained

    @property
    def num_depths(self) -> int:
        return len(self.depths)

    @classmethod
    def from_hf(cls, config, *, mtp_log_scaling: bool = False, raw: dict | None = None) -> MTPConfig:
        """Build from an ``InklingConfig`` or ``InklingTextConfig``.

        ``mtp_log_scaling`` applies tau on full-attention depths (SGLang / transformers); the default follows vLLM
        and tokenspeed, which do not pass tau into the MTP block (spec §8 item 18).
        """
        text = config.get_text_config() if isinstance(config, InklingConfig) else config
        if not isinstance(text, InklingTextConfig):
            raise ConfigError(f"expected an InklingConfig or InklingTextConfig, got {type(config).__name__}")
        n = text.num_mtp_layers
        if not n or n < 1:
            raise ConfigError(
                f"config has no MTP depths (num_mtp_layers={n!r}; mtp_config.num_nextn_predict_layers must be >= 1)"
            )
        local = list(text.mtp_local_layer_ids or [])
        bad = [i for i in local if not 0 <= i < n]
        if bad:
            raise ConfigError(f"mtp_local_layer_ids {bad} out of range for {n} MTP depths")
        if text.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"unsupported hidden_act {text.hidden_act!r}; supported: {SUPPORTED_ACTIVATIONS}")
        if getattr(text, "final_logit_softcapping", None) is not None:
            raise ConfigError("final_logit_softcapping is not supported together with the muP LM head")
        mup = text.logits_mup_width_multiplier
        if mup is None or mup <= 0:
            raise ConfigError(f"logits_mup_width_multiplier must be positive, got {mup!r}")
        unpadded = text.unpadded_vocab_size
        if unpadded is not None and not 0 < unpadded <= text.vocab_size:
            raise ConfigError(f"unpadded_vocab_size {unpadded} must be in (0, vocab_size={text.vocab_size}]")
        depths = tuple(_depth_geometry(text, i in local, mtp_log_scaling) for i in range(n))
        return cls(
            hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            logits_vocab_size=logits_vocab_size(text),
            rms_norm_eps=text.rms_norm_eps,
            depths=depths,
            d_rel=text.d_rel,
            conv_kernel_size=text.conv_kernel_size,
            intermediate_size=text.intermediate_size,
            hidden_act=text.hidden_act,
            mup=float(mup),
            chain_hidden_post_norm=bool(text.chain_hidden_post_norm),
            hidden_states_first=bool(text.mtp_hidden_states_first),
            use_embed_norm=bool(getattr(text, "use_embed_norm", True)),
            use_global_scale=bool(getattr(text, "use_global_scale", True)),
            log_scaling_n_floor=text.log_scaling_n_floor,
            log_scaling_alpha=text.log_scaling_alpha,
            raw=raw if raw is not None else config.to_dict(),
        )


def logits_vocab_size(text: InklingTextConfig) -> int:
    """Token ids the LM head scores: the unpadded vocab when the config has one (the table rows past it are padding)."""
    return text.unpadded_vocab_size or text.vocab_size


def _depth_geometry(text: InklingTextConfig, sliding: bool, mtp_log_scaling: bool) -> DepthGeometry:
    if sliding:
        heads, kv, dim = text.swa_num_attention_heads, text.swa_num_key_value_heads, text.swa_head_dim
        window = extent = text.sliding_window_size  # a sliding depth's bias extent is its window (spec §2.3)
    else:
        heads, kv, dim = text.num_attention_heads, text.num_key_value_heads, text.head_dim
        window, extent = None, text.rel_extent
    if kv < 1:
        raise ConfigError(f"{'swa_' if sliding else ''}num_key_value_heads must be >= 1, got {kv}")
    if heads % kv:
        raise ConfigError(f"{'swa_' if sliding else ''}num_attention_heads={heads} is not a multiple of kv heads={kv}")
    return DepthGeometry(
        sliding=sliding,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=dim,
        window=window,
        rel_extent=extent,
        log_scaling=mtp_log_scaling and not sliding and text.log_scaling_n_floor is not None,
    )


def read_config_json(path: str | os.PathLike) -> tuple[InklingConfig | InklingTextConfig, dict]:
    """Parse ``path/config.json`` (``inkling_mm_model`` or ``inkling_text``) with transformers' classes."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config.json in {path}")
    with open(file) as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    # from_dict writes the promoted mtp_config fields into the nested text_config dict: parse a copy, so that
    # `raw` stays the file as read
    if model_type == InklingConfig.model_type:
        return InklingConfig.from_dict(copy.deepcopy(raw)), raw
    if model_type == InklingTextConfig.model_type:
        return InklingTextConfig.from_dict(copy.deepcopy(raw)), raw
    raise ConfigError(
        f"{file}: model_type {model_type!r} is not an Inkling config "
        f"(expected {InklingConfig.model_type!r} or {InklingTextConfig.model_type!r})"
    )
