"""The MTP view of an Inkling config (docs/model.md §2): per-depth geometry, field aliases, and clear errors for values
the draft head cannot be built from."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from transformers import InklingConfig, InklingTextConfig, LlamaConfig

from inkling_compiled import ConfigError, MTPConfig
from inkling_compiled.config import (
    FIELD_RULES,
    TEXT_ALIASES,
    TEXT_DEFAULTS,
    logits_vocab_size,
    parse_config_dict,
    plain_text_fields,
    read_config_json,
)
from inkling_compiled.testing import synthetic as S
from tests.helpers import tiny_text_config

pytestmark = pytest.mark.floor  # make test-floor: exercises a dependency at its lowest version


def _mm(**overrides) -> InklingConfig:
    return InklingConfig.from_dict(S.tiny_config(**overrides))


def _text_dict(mm: dict) -> dict:
    """The bare ``inkling_text`` form of an ``inkling_mm_model`` dict (MTP fields under their HF names)."""
    text = dict(mm["text_config"])
    text.update(num_mtp_layers=mm["mtp_config"]["num_nextn_predict_layers"],
                mtp_local_layer_ids=mm["mtp_config"]["local_layer_ids"],
                chain_hidden_post_norm=mm["mtp_config"]["chain_hidden_post_norm"])
    return text


# ------------------------------------------------------------------------------------------------ geometry


def test_tiny_geometry_sliding_and_full_depths():
    c = MTPConfig.from_hf(_mm())
    assert c.num_depths == 2
    assert (c.hidden_size, c.vocab_size, c.logits_vocab_size) == (64, 512, 500)
    assert (c.intermediate_size, c.conv_kernel_size, c.d_rel, c.hidden_act) == (128, 4, 16, "silu")  # ckpt aliases
    assert c.mup == 24.0 and not c.chain_hidden_post_norm and c.hidden_states_first
    sliding, full = c.depths
    assert sliding.sliding and sliding.window == 8 and sliding.rel_extent == 8  # a sliding depth's extent is W
    assert not full.sliding and full.window is None and full.rel_extent == 16
    assert not any(d.log_scaling for d in c.depths)


def test_full_size_geometry_matches_spec_table():
    c = MTPConfig.from_hf(InklingConfig.from_dict(S.full_config()))
    assert [d.sliding for d in c.depths] == [True, False, True, False, True, True, True, True]
    for d in c.depths:
        assert (d.num_heads, d.head_dim) == (64, 128)
        assert (d.num_kv_heads, d.window, d.rel_extent) == ((16, 512, 512) if d.sliding else (8, None, 1024))
    assert (c.hidden_size, c.intermediate_size) == (6144, 24576)
    assert (c.vocab_size, c.logits_vocab_size) == (201024, 200058)


def test_mtp_local_layer_ids_replace_the_trunks():
    # 4 trunk layers are local at 0 and 2; the MTP's own local ids (1, 3) decide the draft's sliding depths
    c = MTPConfig.from_hf(_mm(num_mtp_layers=4, local_layer_ids=(1, 3)))
    assert [d.sliding for d in c.depths] == [False, True, False, True]


def test_bare_text_config_equals_multimodal_config():
    mm = S.tiny_config()
    assert MTPConfig.from_hf(InklingTextConfig.from_dict(_text_dict(mm))) == MTPConfig.from_hf(
        InklingConfig.from_dict(mm))


def test_log_scaling_only_on_full_depths_and_only_when_asked():
    text = tiny_text_config(log_scaling_n_floor=4)
    assert [d.log_scaling for d in MTPConfig.from_hf(text).depths] == [False, False]
    assert [d.log_scaling for d in MTPConfig.from_hf(text, mtp_log_scaling=True).depths] == [False, True]
    no_floor = tiny_text_config(log_scaling_n_floor=None)
    assert not any(d.log_scaling for d in MTPConfig.from_hf(no_floor, mtp_log_scaling=True).depths)


def test_unpadded_vocab_defaults_to_vocab():
    c = MTPConfig.from_hf(tiny_text_config(unpadded_vocab_size=None))
    assert c.logits_vocab_size == c.vocab_size == 256


def test_config_is_frozen_and_keeps_raw():
    raw = S.tiny_config()
    c = MTPConfig.from_hf(InklingConfig.from_dict(raw), raw=raw)
    assert c.raw is raw
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 1


# ------------------------------------------------------------------------------------------------ errors


def test_unsupported_activation():
    with pytest.raises(ConfigError, match=r"unsupported hidden_act 'relu2'; supported: \('silu'"):
        MTPConfig.from_hf(tiny_text_config(hidden_act="relu2"))


@pytest.mark.parametrize("n", [None, 0])
def test_no_mtp_layers(n):
    with pytest.raises(ConfigError, match=rf"config has no MTP depths \(num_mtp_layers={n}"):
        MTPConfig.from_hf(tiny_text_config(num_mtp_layers=n, mtp_local_layer_ids=None))


def test_no_mtp_config_in_multimodal_config():
    raw = S.tiny_config()
    del raw["mtp_config"]
    with pytest.raises(ConfigError, match=r"config has no MTP depths \(num_mtp_layers=None"):
        MTPConfig.from_hf(InklingConfig.from_dict(raw))


@pytest.mark.parametrize("ids, bad", [([0, 2], [2]), ([-1], [-1]), ([0, 5, 1], [5])])
def test_local_layer_ids_out_of_range(ids, bad):
    with pytest.raises(ConfigError, match=rf"mtp_local_layer_ids {bad} out of range for 2 MTP depths".replace(
            "[", r"\[").replace("]", r"\]")):
        MTPConfig.from_hf(tiny_text_config(mtp_local_layer_ids=ids))


@pytest.mark.parametrize("mup", [0.0, -24.0])
def test_non_positive_mup(mup):
    with pytest.raises(ConfigError, match=rf"logits_mup_width_multiplier must be > 0, got {mup}"):
        MTPConfig.from_hf(tiny_text_config(logits_mup_width_multiplier=mup))


def test_unpadded_vocab_larger_than_vocab():
    with pytest.raises(ConfigError, match=r"unpadded_vocab_size 257 must be in \(0, vocab_size=256\]"):
        MTPConfig.from_hf(tiny_text_config(unpadded_vocab_size=257))


NAN, INF = float("nan"), float("inf")
# (field, value, message): every field the head reads, with a value it cannot work with
UNWORKABLE = [
    ("sliding_window_size", 0, "sliding_window_size must be >= 1, got 0"),
    ("rel_extent", 0, "rel_extent must be >= 1, got 0"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps must be > 0, got -1e-06"),
    ("rms_norm_eps", 0.0, "rms_norm_eps must be > 0, got 0.0"),
    ("rms_norm_eps", NAN, "rms_norm_eps must be finite, got nan"),
    ("rms_norm_eps", INF, "rms_norm_eps must be finite, got inf"),
    ("num_attention_heads", 0, "num_attention_heads must be >= 1, got 0"),
    ("swa_num_attention_heads", -2, "swa_num_attention_heads must be >= 1, got -2"),
    ("head_dim", 0, "head_dim must be >= 1, got 0"),
    ("swa_head_dim", 0, "swa_head_dim must be >= 1, got 0"),
    ("hidden_size", 0, "hidden_size must be >= 1, got 0"),
    ("vocab_size", -1, "vocab_size must be >= 1, got -1"),
    ("unpadded_vocab_size", 0, "unpadded_vocab_size must be >= 1, got 0"),
    ("d_rel", 0, "d_rel must be >= 1, got 0"),
    ("conv_kernel_size", 0, "conv_kernel_size must be >= 1, got 0"),
    ("intermediate_size", -1, "intermediate_size must be >= 1, got -1"),
    ("logits_mup_width_multiplier", NAN, "logits_mup_width_multiplier must be finite, got nan"),
    ("logits_mup_width_multiplier", INF, "logits_mup_width_multiplier must be finite, got inf"),
    ("log_scaling_n_floor", 0, "log_scaling_n_floor must be >= 1, got 0"),
    ("log_scaling_alpha", NAN, "log_scaling_alpha must be finite, got nan"),
    ("log_scaling_alpha", -INF, "log_scaling_alpha must be finite, got -inf"),
    ("num_mtp_layers", 10**9, "num_mtp_layers must be <= 1024, got 1000000000"),
    # sizes whose weights would overflow torch's storage size while the modules are built on the meta device
    ("hidden_size", 10**12, f"hidden_size must be <= {2**24}, got {10**12}"),
    ("vocab_size", 10**17, f"vocab_size must be <= {2**24}, got {10**17}"),
    ("intermediate_size", 10**18, f"intermediate_size must be <= {2**24}, got {10**18}"),
]
# values a transformers without strict field types (or an extra field it does not type) lets through
MISTYPED = [
    ("hidden_size", True, "hidden_size must be an int, got True"),
    ("sliding_window_size", 1.5, "sliding_window_size must be an int, got 1.5"),
    ("head_dim", "32", "head_dim must be an int, got '32'"),
    ("num_mtp_layers", True, "num_mtp_layers must be an int, got True"),
    ("unpadded_vocab_size", 1.5, "unpadded_vocab_size must be an int or None, got 1.5"),
    ("rms_norm_eps", True, "rms_norm_eps must be a number, got True"),
    ("logits_mup_width_multiplier", "24", "logits_mup_width_multiplier must be a number, got '24'"),
    ("use_embed_norm", "false", "use_embed_norm must be a bool, got 'false'"),
    ("chain_hidden_post_norm", 1, "chain_hidden_post_norm must be a bool, got 1"),
]


def _text_with(**fields) -> InklingTextConfig:
    """The tiny text config holding ``fields`` as given, past transformers' own field typing."""
    text = tiny_text_config()
    for name, value in fields.items():
        object.__setattr__(text, name, value)
    return text


@pytest.mark.parametrize("name, value, message", UNWORKABLE + MISTYPED,
                         ids=[f"{n}={v!r}" for n, v, _ in UNWORKABLE + MISTYPED])
def test_unworkable_field_values(name, value, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        MTPConfig.from_hf(_text_with(**{name: value}))


def test_every_read_field_has_a_rule():
    """The table covers the fields MTPConfig is built from (a new field without a rule would go unchecked)."""
    assert {"hidden_size", "vocab_size", "rms_norm_eps", "d_rel", "conv_kernel_size", "intermediate_size",
            "logits_mup_width_multiplier", "log_scaling_n_floor", "log_scaling_alpha", "sliding_window_size",
            "rel_extent", "use_embed_norm", "use_global_scale"} <= set(FIELD_RULES)
    assert {name for name, _, _ in UNWORKABLE + MISTYPED} <= set(FIELD_RULES)


def test_all_bad_fields_named_at_once():
    with pytest.raises(ConfigError, match=r"^sliding_window_size must be >= 1, got 0; "
                                          r"rms_norm_eps must be finite, got nan$"):
        MTPConfig.from_hf(_text_with(sliding_window_size=0, rms_norm_eps=NAN))


def test_local_layer_ids_must_be_ints():
    with pytest.raises(ConfigError, match=r"mtp_local_layer_ids \[True\] out of range for 2 MTP depths"):
        MTPConfig.from_hf(_text_with(mtp_local_layer_ids=[True]))


def test_mtp_log_scaling_must_be_a_bool():
    with pytest.raises(TypeError, match=r"mtp_log_scaling must be a bool, got 'yes'"):
        MTPConfig.from_hf(tiny_text_config(), mtp_log_scaling="yes")


@pytest.mark.parametrize("unpadded, expected", [(250, 250), (None, 256)])
def test_logits_vocab_size(unpadded, expected):
    text = tiny_text_config(unpadded_vocab_size=unpadded)
    assert logits_vocab_size(text) == expected == MTPConfig.from_hf(text).logits_vocab_size
    assert logits_vocab_size(_mm()) == 500  # a multimodal config: its text config's


def test_softcapping_rejected():
    text = tiny_text_config()
    text.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="final_logit_softcapping is not supported"):
        MTPConfig.from_hf(text)


@pytest.mark.parametrize("fields, name", [
    (dict(num_attention_heads=3, num_key_value_heads=2), "num_attention_heads=3"),
    (dict(swa_num_attention_heads=3, swa_num_key_value_heads=2), "swa_num_attention_heads=3"),
])
def test_heads_not_multiple_of_kv_heads(fields, name):
    with pytest.raises(ConfigError, match=rf"^{name} is not a multiple of kv heads=2"):
        MTPConfig.from_hf(tiny_text_config(**fields))


@pytest.mark.parametrize("prefix", ["", "swa_"])
def test_zero_kv_heads(prefix):
    with pytest.raises(ConfigError, match=rf"^{prefix}num_key_value_heads must be >= 1, got 0"):
        MTPConfig.from_hf(tiny_text_config(**{f"{prefix}num_key_value_heads": 0}))


def test_non_inkling_config():
    with pytest.raises(ConfigError, match="expected an InklingConfig or InklingTextConfig, got LlamaConfig"):
        MTPConfig.from_hf(LlamaConfig())


# ------------------------------------------------------------------------------------------------ config.json


def _write(tmp_path, raw: dict):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_read_config_json_multimodal_and_text(tmp_path):
    mm = S.tiny_config()
    config, raw = read_config_json(_write(tmp_path, mm))
    assert isinstance(config, InklingConfig) and raw == mm
    assert config.text_config.num_mtp_layers == 2 and config.text_config.mtp_local_layer_ids == [0]
    text = {"model_type": "inkling_text", **_text_dict(mm)}
    config, raw = read_config_json(_write(tmp_path, text))
    assert type(config) is InklingTextConfig and config.num_mtp_layers == 2 and raw == text


def test_read_config_json_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json in .*"):
        read_config_json(tmp_path)


@pytest.mark.parametrize("model_type", ["llama", None])
def test_read_config_json_wrong_model_type(tmp_path, model_type):
    raw = S.tiny_config()
    raw["model_type"] = model_type
    with pytest.raises(ConfigError, match=rf"model_type {model_type!r} is not an Inkling config \(expected "
                                          r"'inkling_mm_model' or 'inkling_text'\)"):
        read_config_json(_write(tmp_path, raw))


@pytest.mark.parametrize("content, message", [
    (b'{"model_type": "inkling_mm_model",', r"invalid JSON: Expecting property name enclosed in double quotes at "
                                            r"line 1 column 35"),
    (b"\xff\xfe{}", r"not UTF-8 text \(invalid start byte at byte 0\)"),
    (b"[1, 2]", r"expected a JSON object, got list"),
    (b'"inkling"', r"expected a JSON object, got str"),
    (b'{"model_type": "llama", "model_type": "inkling_text"}', r"key\(s\) \['model_type'\] given twice in one JSON "
                                                             r"object"),
], ids=["truncated", "not-utf8", "list", "string", "repeated-key"])
def test_read_config_json_corrupt(tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path / 'config.json'))}: {message}"):
        read_config_json(tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw.update(mtp_config=[1]), r"'list' object has no attribute 'get'"),
    (lambda raw: raw.update(text_config="inkling"), r"text_config"),
    (lambda raw: raw["text_config"].update(logits_mup_width_multiplier=24), r"logits_mup_width_multiplier"),
], ids=["mtp-config-list", "text-config-string", "int-for-float"])
def test_read_config_json_transformers_rejects(tmp_path, edit, message):
    raw = S.tiny_config()
    edit(raw)
    with pytest.raises(ConfigError, match=rf"config\.json: transformers cannot parse it: .*{message}"):
        read_config_json(_write(tmp_path, raw))


# ------------------------------------------------------------------------------------------------ without transformers


def test_the_defaults_and_aliases_read_without_transformers_are_transformers_own():
    defaults = InklingTextConfig()
    assert {name: getattr(defaults, name) for name in TEXT_DEFAULTS} == TEXT_DEFAULTS
    aliases = {alias: name for alias, name in InklingTextConfig.attribute_map.items()
               if name in TEXT_DEFAULTS or name in FIELD_RULES}
    assert aliases == TEXT_ALIASES


def _both_ways(raw: dict):
    """(read directly, parsed by transformers): each an MTPConfig or the ConfigError message (naming the file)."""
    def parsed():
        hf = parse_config_dict(raw, "config.json")
        try:
            return MTPConfig.from_hf(hf, raw=raw)
        except ConfigError as e:
            raise ConfigError(f"config.json: {e}") from e

    def outcome(build):
        try:
            return build()
        except ConfigError as e:
            return str(e)

    return outcome(lambda: MTPConfig.from_config_dict(raw, "config.json")), outcome(parsed)


@pytest.mark.parametrize("preset", sorted(S.PRESETS))
@pytest.mark.parametrize("form", ["multimodal", "text"])
def test_plain_configs_read_without_transformers_as_transformers_reads_them(preset, form):
    raw = S.preset_config(preset)
    if form == "text":
        raw = {"model_type": "inkling_text", **_text_dict(raw)}
    assert plain_text_fields(raw) is not None
    direct, parsed = _both_ways(raw)
    assert direct == parsed


@pytest.mark.parametrize("edit, plain", [
    (lambda t: t.pop("swa_head_dim"), True),  # transformers' default
    (lambda t: t.update(dense_intermediate_size=None, intermediate_size=48), True),
    (lambda t: t.update(embedding_multiplier=t.pop("logits_mup_width_multiplier") / 2), True),  # an alias alone
    (lambda t: t.update(conv_kernel_size=3), False),  # given twice (sconv_kernel_size too)
    (lambda t: t.update(logits_mup_width_multiplier=24), False),  # an int for a float: transformers rejects it
    (lambda t: t.update(hidden_size=0), True),  # our rule's error, either way
    (lambda t: t.update(local_layer_ids=None, mtp_local_layer_ids=["0"]), False),
    (lambda t: t.update(hidden_act="relu"), True),
], ids=["default", "no-dense-width", "alias", "alias-and-name", "int-for-float", "zero-width", "string-ids",
        "activation"])
def test_configs_read_without_transformers_agree_or_go_through_it(edit, plain):
    raw = S.tiny_config()
    edit(raw["text_config"])
    assert (plain_text_fields(raw) is not None) == plain
    direct, parsed = _both_ways(raw)
    assert direct == parsed


def test_a_multimodal_config_without_a_text_section_goes_through_transformers():
    raw = S.tiny_config()
    raw["mtp_config"] = [1]
    assert plain_text_fields(raw) is None
    with pytest.raises(ConfigError, match=r"^where: transformers cannot parse it"):
        MTPConfig.from_config_dict(raw, "where")
