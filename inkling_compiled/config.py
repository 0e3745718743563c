"""The MTP view of an Inkling config: per-depth geometry and the few fields the draft head reads (docs/model.md §2).

transformers' config classes are the authority on parsing (``InklingConfig`` promotes the top-level ``mtp_config``
into its ``text_config``); this module turns the result into a small frozen dataclass that the modules are built
from, and rejects values this implementation does not support with a message naming the field.

A checkpoint directory's config.json is read without importing transformers (about 1.6 s) when it spells every field
the head reads plainly (:func:`plain_text_fields`: the same promotion, the aliases and defaults transformers applies,
values of the types its strict classes accept); anything else goes through transformers' classes, so that their
verdict (and error) stands. Fields the head never reads are then not checked.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import InklingConfig, InklingTextConfig

from .arguments import check_bool, is_int, is_number

SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")
CONFIG_FILE = "config.json"


class ConfigError(ValueError):
    """A config value that the MTP head cannot be built from."""


@dataclass(frozen=True)
class DepthGeometry:
    """Attention geometry of one MTP depth (docs/model.md §2.3)."""

    sliding: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None  # keys visible including self; None = plain causal
    rel_extent: int  # E: relative bias is zero at distances >= E
    log_scaling: bool  # apply tau (docs/model.md §4.6 step 5) on this depth


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
        """Build from an ``InklingConfig`` or ``InklingTextConfig``, rejecting every value the head cannot work with.

        ``mtp_log_scaling`` applies tau on full-attention depths (SGLang / transformers); the default follows vLLM
        and tokenspeed, which do not pass tau into the MTP block (docs/model.md §8 item 18).
        """
        from transformers import InklingConfig, InklingTextConfig

        text = config.get_text_config() if isinstance(config, InklingConfig) else config
        if not isinstance(text, InklingTextConfig):
            raise ConfigError(f"expected an InklingConfig or InklingTextConfig, got {type(config).__name__}")
        return cls._from_text(text, mtp_log_scaling, raw if raw is not None else config.to_dict())

    @classmethod
    def from_config_dict(cls, raw: dict, where, *, mtp_log_scaling: bool = False) -> MTPConfig:
        """Build from a config.json dict, each error prefixed by ``where``: read directly when
        :func:`plain_text_fields` can, else parsed by transformers' classes (:func:`parse_config_dict`)."""
        text = plain_text_fields(raw)
        parsed = parse_config_dict(raw, where) if text is None else None
        try:
            if parsed is not None:
                return cls.from_hf(parsed, mtp_log_scaling=mtp_log_scaling, raw=raw)
            return cls._from_text(SimpleNamespace(**text), mtp_log_scaling, raw)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from e

    @classmethod
    def _from_text(cls, text, mtp_log_scaling: bool, raw: dict) -> MTPConfig:
        """From the text config's attributes (an ``InklingTextConfig``, or :func:`plain_text_fields` as attributes)."""
        check_bool("mtp_log_scaling", mtp_log_scaling)
        n = text.num_mtp_layers
        if n is None or is_int(n) and n < 1:
            raise ConfigError(
                f"config has no MTP depths (num_mtp_layers={n!r}; mtp_config.num_nextn_predict_layers must be >= 1)"
            )
        fields = {name: getattr(text, name, FIELD_DEFAULTS.get(name)) for name in FIELD_RULES}
        problems = [p for name, rule in FIELD_RULES.items() if (p := rule.problem(name, fields[name])) is not None]
        if problems:
            raise ConfigError("; ".join(problems))
        local = list(text.mtp_local_layer_ids or [])
        bad = [i for i in local if not (is_int(i) and 0 <= i < n)]
        if bad:
            raise ConfigError(f"mtp_local_layer_ids {bad} out of range for {n} MTP depths")
        if text.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"unsupported hidden_act {text.hidden_act!r}; supported: {SUPPORTED_ACTIVATIONS}")
        if getattr(text, "final_logit_softcapping", None) is not None:
            raise ConfigError("final_logit_softcapping is not supported together with the muP LM head")
        unpadded = text.unpadded_vocab_size
        if unpadded is not None and unpadded > text.vocab_size:
            raise ConfigError(f"unpadded_vocab_size {unpadded} must be in (0, vocab_size={text.vocab_size}]")
        sliding = set(local)
        depths = tuple(_depth_geometry(text, i in sliding, mtp_log_scaling) for i in range(n))
        return cls(
            hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            logits_vocab_size=text.unpadded_vocab_size or text.vocab_size,
            rms_norm_eps=float(text.rms_norm_eps),
            depths=depths,
            d_rel=text.d_rel,
            conv_kernel_size=text.conv_kernel_size,
            intermediate_size=text.intermediate_size,
            hidden_act=text.hidden_act,
            mup=float(text.logits_mup_width_multiplier),
            chain_hidden_post_norm=fields["chain_hidden_post_norm"],
            hidden_states_first=fields["mtp_hidden_states_first"],
            use_embed_norm=fields["use_embed_norm"],
            use_global_scale=fields["use_global_scale"],
            log_scaling_n_floor=text.log_scaling_n_floor,
            log_scaling_alpha=float(text.log_scaling_alpha),
            raw=raw,
        )


def logits_vocab_size(config) -> int:
    """Logits an Inkling config (transformers') keeps: ``unpadded_vocab_size`` (real tokens), else ``vocab_size``."""
    text = config.get_text_config()
    return text.unpadded_vocab_size or text.vocab_size


# ------------------------------------------------------------------------------------------------ field rules


_KINDS = {int: ("an int", is_int), float: ("a number", is_number), bool: ("a bool", lambda v: isinstance(v, bool))}


@dataclass(frozen=True)
class FieldRule:
    """What one config field must hold: its kind (``int``; ``float`` = any finite real number; ``bool``), bounds
    (``minimum`` / ``maximum`` inclusive, ``above`` exclusive) and whether None is allowed."""

    kind: type
    minimum: int | None = None
    maximum: int | None = None
    above: float | None = None
    optional: bool = False

    def problem(self, name: str, value) -> str | None:
        """What is wrong with ``value``, naming the field and the value; None if the rule holds."""
        if value is None and self.optional:
            return None
        kind, holds = _KINDS[self.kind]
        if not holds(value):
            return f"{name} must be {kind}{' or None' if self.optional else ''}, got {value!r}"
        if self.kind is not bool and not math.isfinite(value):
            return f"{name} must be finite, got {value!r}"
        if self.minimum is not None and value < self.minimum:
            return f"{name} must be >= {self.minimum}, got {value!r}"
        if self.maximum is not None and value > self.maximum:
            return f"{name} must be <= {self.maximum}, got {value!r}"
        if self.above is not None and not value > self.above:
            return f"{name} must be > {self.above:g}, got {value!r}"
        return None


MAX_DEPTHS = 1024
# A size bound far above any real model's (Inkling's largest size is its ~200k vocabulary) that keeps the product of
# two sizes (a weight's elements) under 2**48: the modules are built on the meta device before the tensors' shapes
# are compared, and a corrupt size must fail here, by name, not as an overflow inside torch.
MAX_SIZE = 2**24
_COUNT = FieldRule(int, minimum=1, maximum=MAX_SIZE)
_POSITIVE = FieldRule(float, above=0)
_FLAG = FieldRule(bool)
# Every InklingTextConfig field the draft head reads, and what it must hold.
FIELD_RULES: dict[str, FieldRule] = {
    # more depths than any draft head has; a corrupt count must not build a billion modules before failing
    "num_mtp_layers": FieldRule(int, minimum=1, maximum=MAX_DEPTHS),
    "hidden_size": _COUNT,
    "vocab_size": _COUNT,
    "unpadded_vocab_size": FieldRule(int, minimum=1, maximum=MAX_SIZE, optional=True),
    "num_attention_heads": _COUNT,
    "num_key_value_heads": _COUNT,
    "head_dim": _COUNT,
    "swa_num_attention_heads": _COUNT,
    "swa_num_key_value_heads": _COUNT,
    "swa_head_dim": _COUNT,
    "sliding_window_size": _COUNT,
    "rel_extent": _COUNT,
    "d_rel": _COUNT,
    "conv_kernel_size": _COUNT,
    "intermediate_size": _COUNT,
    "rms_norm_eps": _POSITIVE,
    "logits_mup_width_multiplier": _POSITIVE,
    "log_scaling_n_floor": FieldRule(int, minimum=1, optional=True),
    "log_scaling_alpha": FieldRule(float),
    "chain_hidden_post_norm": _FLAG,
    "mtp_hidden_states_first": _FLAG,
    "use_embed_norm": _FLAG,
    "use_global_scale": _FLAG,
}
FIELD_DEFAULTS = {"use_embed_norm": True, "use_global_scale": True}  # not InklingTextConfig fields: on unless set


def _depth_geometry(text, sliding: bool, mtp_log_scaling: bool) -> DepthGeometry:
    if sliding:
        heads, kv, dim = text.swa_num_attention_heads, text.swa_num_key_value_heads, text.swa_head_dim
        window = extent = text.sliding_window_size  # a sliding depth's bias extent is its window (docs/model.md §2.3)
    else:
        heads, kv, dim = text.num_attention_heads, text.num_key_value_heads, text.head_dim
        window, extent = None, text.rel_extent
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


# ------------------------------------------------------------------------------------------------ config.json


def read_json_object(file: Path, error: type[ValueError]) -> dict:
    """The JSON object held in ``file``. Anything else (bytes that are not UTF-8, invalid JSON, a key given twice in
    one object, a top level that is not an object) raises ``error`` naming the file and the problem."""

    def no_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
        keys = [k for k, _ in pairs]
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            raise error(f"{file}: key(s) {repeated} given twice in one JSON object (which one is meant?)")
        return dict(pairs)

    try:
        data = json.loads(file.read_bytes().decode("utf-8"), object_pairs_hook=no_repeated_keys)
    except UnicodeDecodeError as e:
        raise error(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise error(f"{file}: invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    if not isinstance(data, dict):
        raise error(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config_json(path: str | os.PathLike) -> tuple[InklingConfig | InklingTextConfig, dict]:
    """Parse ``path/config.json`` (``inkling_mm_model`` or ``inkling_text``) with transformers' classes."""
    raw = read_config_file(path)
    return parse_config_dict(raw, Path(path) / CONFIG_FILE), raw


def read_config_file(path: str | os.PathLike) -> dict:
    """``path/config.json`` as a dict (FileNotFoundError if there is none; ConfigError if it is no JSON object)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}")
    return read_json_object(file, ConfigError)


def parse_config_dict(raw: dict, where) -> InklingConfig | InklingTextConfig:
    """A config.json dict as transformers' Inkling config class; ConfigError naming ``where`` if it is none."""
    from transformers import InklingConfig, InklingTextConfig

    model_type = raw.get("model_type")
    classes = {InklingConfig.model_type: InklingConfig, InklingTextConfig.model_type: InklingTextConfig}
    if model_type not in classes:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not an Inkling config "
            f"(expected {InklingConfig.model_type!r} or {InklingTextConfig.model_type!r})"
        )
    # from_dict writes the promoted mtp_config fields into the nested text_config dict: parse a copy, so that
    # `raw` stays as given
    try:
        return classes[model_type].from_dict(copy.deepcopy(raw))
    except Exception as e:  # transformers' parsing fails in many ways (strict field types, a section not an object)
        raise ConfigError(f"{where}: transformers cannot parse it: {e}") from e


# ------------------------------------------------------------------------------------------------ without transformers

MODEL_TYPES = ("inkling_mm_model", "inkling_text")  # InklingConfig's, InklingTextConfig's
# What InklingTextConfig holds for a field the head reads when config.json leaves it out, and the config.json
# spellings it maps onto those fields (its attribute_map); tests compare both with the installed transformers.
TEXT_DEFAULTS = {
    "vocab_size": 201024, "unpadded_vocab_size": None, "hidden_size": 6144, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 128, "swa_num_attention_heads": 64, "swa_num_key_value_heads": 16,
    "swa_head_dim": 128, "sliding_window_size": 512, "d_rel": 16, "rel_extent": 1024, "log_scaling_n_floor": None,
    "log_scaling_alpha": 0.1, "rms_norm_eps": 1e-6, "conv_kernel_size": 4, "intermediate_size": 24576,
    "hidden_act": "silu", "logits_mup_width_multiplier": 24.0, "num_mtp_layers": None, "chain_hidden_post_norm": False,
    "mtp_hidden_states_first": True, "mtp_local_layer_ids": None,
}
TEXT_ALIASES = {"sconv_kernel_size": "conv_kernel_size", "embedding_multiplier": "logits_mup_width_multiplier",
                "sliding_window": "sliding_window_size"}
# InklingConfig's promotion of the top-level mtp_config: text field <- (mtp_config key, value when absent)
MTP_PROMOTED = {"num_mtp_layers": ("num_nextn_predict_layers", None),
                "chain_hidden_post_norm": ("chain_hidden_post_norm", False),
                "mtp_local_layer_ids": ("local_layer_ids", None)}


def plain_text_fields(raw: dict) -> dict | None:
    """The text config's fields as transformers would read them from ``raw``, for the fields the head reads, when
    that takes no judgement: the sections are objects, no field is given under two spellings, and every value read
    has the type transformers' strict classes require (an int is not a float there). None otherwise: the caller
    then lets transformers parse ``raw`` (and report what is wrong with it)."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        return None
    if model_type == MODEL_TYPES[0]:
        text, mtp = raw.get("text_config"), raw.get("mtp_config") or {}
        if not (isinstance(text, dict) and isinstance(mtp, dict)):
            return None
        text = dict(text)
        for name, (key, absent) in MTP_PROMOTED.items():
            text.setdefault(name, mtp.get(key, absent))
    else:
        text = dict(raw)
    for alias, name in TEXT_ALIASES.items():
        if alias in text:
            if name in text:
                return None
            text[name] = text.pop(alias)
    if text.get("dense_intermediate_size") is not None:  # its dense MLP width (intermediate_size is the experts')
        text["intermediate_size"] = text["dense_intermediate_size"]
    fields = {**TEXT_DEFAULTS, **{name: text[name] for name in (*TEXT_DEFAULTS, *FIELD_RULES,
                                                                 "final_logit_softcapping") if name in text}}
    plain = all(_strictly(rule, fields[name]) for name, rule in FIELD_RULES.items() if name in fields)
    ids = fields["mtp_local_layer_ids"]
    plain = plain and isinstance(fields["hidden_act"], str) and (
        ids is None or isinstance(ids, list) and all(is_int(i) for i in ids))
    return fields if plain else None


def _strictly(rule: FieldRule, value) -> bool:
    """``value`` has the JSON type a strict dataclass field of the rule's kind takes (the bounds are checked later)."""
    if value is None:
        return rule.optional
    return isinstance(value, float) if rule.kind is float else _KINDS[rule.kind][1](value)
