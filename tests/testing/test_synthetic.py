"""The synthetic raw-layout checkpoint is only useful if transformers reads it exactly as a real one: every tensor
lands where the raw name says (w13 de-interleaved), nothing is missing, and MTP depths do not collide."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import inkling_compiled.checkpoint as C
from inkling_compiled.testing import synthetic as S

pytestmark = pytest.mark.floor  # make test-floor: exercises a dependency at its lowest version


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return S.cached_checkpoint("tiny", root=tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def raw(ckpt) -> dict[str, torch.Tensor]:
    out = {}
    for file in ckpt.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def target(ckpt):
    return S.load_hf_target(ckpt)


def _expected_native(raw: dict, prefix_raw: str, sub_native: str) -> torch.Tensor:
    """What transformers should hold for one decoder-layer tensor, derived by hand from the raw tensor."""
    fused = {"mlp.gate_proj.weight": ("mlp.w13_dn.weight", 0, 0), "mlp.up_proj.weight": ("mlp.w13_dn.weight", 0, 1),
             "mlp.shared_experts.gate_proj": ("mlp.shared_experts.shared_w13_weight", 1, 0),
             "mlp.shared_experts.up_proj": ("mlp.shared_experts.shared_w13_weight", 1, 1)}
    if sub_native in fused:
        name, dim, half = fused[sub_native]  # gate = rows 0::2, up = rows 1::2 along `dim`
        return raw[prefix_raw + name][(slice(None),) * dim + (slice(half, None, 2),)]
    if sub_native == "mlp.experts.gate_up_proj":  # routed experts stay fused: [gate rows | up rows]
        w = raw[prefix_raw + "mlp.experts.w13_weight"]
        return torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)
    return raw[prefix_raw + S._raw_layer_entry(sub_native, ())[0]]


def test_target_loads_raw_layout_without_missing_keys(ckpt, raw):
    from transformers import InklingForConditionalGeneration

    model, info = InklingForConditionalGeneration.from_pretrained(str(ckpt), output_loading_info=True)
    assert not info["missing_keys"]
    assert all(k.startswith("model.mtp.") for k in info["unexpected_keys"])
    assert not info["mismatched_keys"] and not info["error_msgs"]

    p = dict(model.named_parameters()) | dict(model.named_buffers())
    lm = "model.language_model."
    assert torch.equal(p[lm + "embed_tokens.weight"], raw["model.llm.embed.weight"])
    assert torch.equal(p[lm + "embed_tokens.embed_norm.weight"], raw["model.llm.embed_norm.weight"])
    assert torch.equal(p["lm_head.weight"], raw["model.llm.unembed.weight"])
    assert torch.equal(p[lm + "norm.weight"], raw["model.llm.norm.weight"])
    w13 = raw["model.llm.layers.0.mlp.w13_dn.weight"]
    assert torch.equal(p[lm + "layers.0.mlp.gate_proj.weight"], w13[0::2])
    assert torch.equal(p[lm + "layers.0.mlp.up_proj.weight"], w13[1::2])
    assert torch.equal(p[lm + "layers.1.self_attn.q_proj.weight"], raw["model.llm.layers.1.attn.wq_du.weight"])
    assert torch.equal(p[lm + "layers.1.mlp.gate.e_score_correction_bias"], raw["model.llm.layers.1.mlp.gate.bias"])
    assert torch.equal(p["model.vision_tower.encoder_layers.1.projection.weight"],
                       raw["model.visual.layers.linear_1.weight"])
    assert torch.equal(p["model.audio_tower.embed_audio_tokens.embed_audio_tokens.weight"],
                       raw["model.audio.encoder.weight"])

    # every trunk tensor, MoE included, sits where its raw name says
    checked = 0
    for name, tensor in p.items():
        m = re.fullmatch(r"model\.language_model\.layers\.(\d+)\.(.+)", name)
        if m:
            expected = _expected_native(raw, f"model.llm.layers.{m.group(1)}.", m.group(2))
            assert torch.equal(tensor, expected), name
            checked += 1
    assert checked == sum(1 for k in p if k.startswith(lm + "layers."))
    assert any(".mlp.experts." in k for k in p), "tiny trunk should contain a MoE layer"


@pytest.mark.parametrize("text_config", [[1], "x"])
def test_a_target_config_whose_text_config_is_no_mapping_is_a_config_error(ckpt, tmp_path, text_config):
    """The pad-id check read before transformers' own was an AttributeError on it."""
    edited = Path(shutil.copytree(ckpt, tmp_path / "edited"))
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "text_config": text_config}))
    with pytest.raises(S.ConfigError, match=re.escape(f"{edited / 'config.json'}: transformers cannot build")):
        S.load_hf_target(edited)


def test_mtp_model_loads_every_depth(ckpt, raw, target):
    mtp = S.load_hf_mtp(target)
    text = target.config.text_config
    assert len(mtp.layers) == text.num_mtp_layers == 2
    for k, layer in enumerate(mtp.layers):
        pre = f"model.mtp.layers.{k}."
        assert torch.equal(layer.hnorm.weight, raw[pre + "hidden_norm.weight"])
        assert torch.equal(layer.enorm.weight, raw[pre + "embed_norm.weight"])
        assert torch.equal(layer.eh_proj.weight, raw[pre + "input_proj.weight"])
        w13 = raw[pre + "transformer_block.mlp.w13_dn.weight"]
        assert torch.equal(layer.mtp_block.mlp.gate_proj.weight, w13[0::2])
        assert torch.equal(layer.mtp_block.mlp.up_proj.weight, w13[1::2])
        assert torch.equal(layer.mtp_block.mlp.global_scale, raw[pre + "transformer_block.mlp.global_scale"])
        proj = layer.mtp_block.self_attn.rel_logits_proj.proj
        assert torch.equal(proj, raw[pre + "transformer_block.attn.rel_logits_proj.proj"])
        sliding = k in text.mtp_local_layer_ids
        assert proj.shape == (text.d_rel, text.sliding_window_size if sliding else text.rel_extent)
        for name, tensor in layer.mtp_block.named_parameters():
            assert torch.equal(tensor, _expected_native(raw, pre + "transformer_block.", name)), (k, name)
    n_raw = sum(1 for key in raw if key.startswith("model.mtp."))
    assert n_raw == 20 * text.num_mtp_layers
    n_native = sum(1 for n, _ in mtp.named_parameters() if n.startswith("layers."))
    assert n_native == n_raw + text.num_mtp_layers  # w13_dn splits into gate_proj + up_proj


def test_causal_lm_from_target_matches_and_from_pretrained_is_the_trap(ckpt, target):
    from transformers import InklingForCausalLM

    ids = torch.tensor([[1, 17, 42, 99, 3, 250, 7, 300, 12, 5, 8, 64]])
    with torch.no_grad():
        ref = target(ids).logits
        ours = S.hf_causal_lm_from(target)(ids).logits
        trap, info = InklingForCausalLM.from_pretrained(str(ckpt), output_loading_info=True)
        wrong = trap.eval()(ids).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    assert "lm_head.weight" in info["missing_keys"]  # raw names are not understood, weights stay random
    assert (wrong - ref).abs().max() > 1e-2
    # the multimodal target drops padded logits
    assert ref.shape[-1] == target.config.text_config.unpadded_vocab_size == 500


def test_cached_checkpoint_reuses_dir_and_index_covers_shards(ckpt, tmp_path):
    again = S.cached_checkpoint("tiny", root=ckpt.parent)
    assert again == ckpt
    stamps = {f.name: f.stat().st_mtime_ns for f in ckpt.iterdir()}
    assert S.cached_checkpoint("tiny", root=ckpt.parent) == ckpt
    assert stamps == {f.name: f.stat().st_mtime_ns for f in ckpt.iterdir()}
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(".tmp")]
    assert S.cached_checkpoint("tiny", root=ckpt.parent, seed=1) != ckpt

    files = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert "model.safetensors" not in files  # transformers would ignore the index
    shards = [f for f in files if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f)]
    assert len(shards) >= 2 and set(files) == set(shards) | {C.MTP_FILE}
    weight_map = json.loads((ckpt / C.INDEX_FILE).read_text())["weight_map"]
    seen = {}
    for f in files:
        with safe_open(str(ckpt / f), framework="pt") as h:
            seen.update(dict.fromkeys(h.keys(), f))
    assert seen == weight_map
    config = json.loads((ckpt / "config.json").read_text())
    assert config["dtype"] == config["text_config"]["dtype"] == "float32"
    assert config["mtp_config"] == {"num_nextn_predict_layers": 2, "chain_hidden_post_norm": False,
                                    "local_layer_ids": [0]}


def test_the_checkpoint_cache_variable_takes_a_quoted_home(monkeypatch):
    monkeypatch.setenv("INKLING_COMPILED_CACHE", "~/checkpoints")  # no shell expanded it: not ./~/checkpoints
    assert S.default_cache_root() == Path.home() / "checkpoints"


def test_unsharded_variant_and_reference_tensors(ckpt, raw, tmp_path):
    path = S.write_checkpoint(tmp_path / "flat", S.tiny_config(), sharded=False)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "mtp.safetensors"]
    for p in (path, ckpt):  # same seed -> same tensors whatever the file layout
        ref = S.mtp_reference_tensors(p)
        assert set(ref) == {k for k in raw if k.startswith("model.mtp.")} | set(C.SHARED_RAW_KEYS)
        assert all(torch.equal(ref[k], raw[k]) for k in ref)


def test_weights_are_random_everywhere(raw):
    for name, t in raw.items():
        assert t.numel() == 1 or t.float().std() > 1e-3, name
        assert not torch.all(t == 1) and not torch.all(t == 0), name
    # same-shaped tensors differ, so a swap is visible
    assert not torch.equal(raw["model.mtp.layers.0.hidden_norm.weight"], raw["model.mtp.layers.0.embed_norm.weight"])
    assert not torch.equal(raw["model.mtp.layers.0.transformer_block.mlp.global_scale"],
                           raw["model.mtp.layers.1.transformer_block.mlp.global_scale"])
    assert not torch.equal(raw["model.llm.embed.weight"], raw["model.llm.unembed.weight"])


def test_generate_plain_and_mtp_agree(target):
    ids = torch.tensor([[1, 17, 42, 99, 3, 250, 7, 300]])
    mask = torch.ones_like(ids)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    mtp = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4, use_mtp=True)
    assert plain.shape == (1, ids.shape[1] + 4)
    assert torch.equal(plain, mtp)


def test_preset_geometry_matches_spec():
    from transformers import InklingConfig

    full = InklingConfig.from_dict(S.full_config()).text_config
    assert (full.hidden_size, full.num_attention_heads, full.head_dim) == (6144, 64, 128)
    assert (full.num_key_value_heads, full.swa_num_key_value_heads, full.intermediate_size) == (8, 16, 24576)
    assert (full.vocab_size, full.unpadded_vocab_size, full.num_mtp_layers) == (201024, 200058, 8)
    assert full.mtp_local_layer_ids == [0, 2, 4, 5, 6, 7]
    small = InklingConfig.from_dict(S.small_config()).text_config
    dims = (small.hidden_size, small.intermediate_size, small.vocab_size, small.num_mtp_layers)
    assert dims == (1024, 2816, 32000, 1)
    tiny = InklingConfig.from_dict(S.tiny_config(num_mtp_layers=3, local_layer_ids=[0, 2], use_unpadded=False))
    assert tiny.text_config.num_hidden_layers >= 3 and tiny.text_config.unpadded_vocab_size is None
    assert tiny.text_config.mtp_layer_types == ["hybrid_sliding", "hybrid", "hybrid_sliding"]

    _, mtp = S.raw_tensor_shapes(S.full_config())  # meta device: shapes only
    assert len(mtp) == 160
    assert mtp["model.mtp.layers.0.input_proj.weight"] == (6144, 12288)
    assert mtp["model.mtp.layers.0.transformer_block.mlp.w13_dn.weight"] == (49152, 6144)
    assert mtp["model.mtp.layers.0.transformer_block.attn.rel_logits_proj.proj"] == (16, 512)
    assert mtp["model.mtp.layers.1.transformer_block.attn.rel_logits_proj.proj"] == (16, 1024)
    assert mtp["model.mtp.layers.1.transformer_block.attn.wk_dv.weight"] == (1024, 6144)
    assert mtp["model.mtp.layers.0.transformer_block.attn.wk_dv.weight"] == (2048, 6144)
