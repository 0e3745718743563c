"""Raw Inkling checkpoint layout <-> ``InklingMTP`` (spec §3, design §2): exact loading (w13 de-interleave, per-depth
rel-bias widths), reading only what the draft needs, sharing the target's tensors without copies, a bit-exact
save/load round trip, and one clear message for every kind of broken checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import inkling_compiled.checkpoint as C
from inkling_compiled import CheckpointError, ConfigError, InklingMTP
from inkling_compiled.testing import synthetic as S
from tests.helpers import random_mtp, tiny_text_config

SHARED = set(C.SHARED_KEYS.values())
W13 = "transformer_block.mlp.w13_dn.weight"


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def sharded(ckpt_root) -> Path:
    return S.cached_checkpoint("tiny", root=ckpt_root)


@pytest.fixture(scope="module")
def flat(ckpt_root) -> Path:
    return S.write_checkpoint(ckpt_root / "flat", S.tiny_config(), sharded=False)


@pytest.fixture(scope="module")
def ref(sharded) -> dict[str, torch.Tensor]:
    return S.mtp_reference_tensors(sharded)


@pytest.fixture(scope="module")
def model(sharded) -> InklingMTP:
    return InklingMTP.from_pretrained(sharded)


@pytest.fixture(scope="module")
def target(sharded):
    return S.load_hf_target(sharded)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_mtp(path: Path, edit) -> None:
    """Rewrite ``mtp.safetensors`` with ``edit(tensors)`` and keep the index's weight_map in step."""
    tensors = load_file(path / C.MTP_FILE)
    edit(tensors)
    save_file(tensors, str(path / C.MTP_FILE), metadata={"format": "pt"})
    index = path / C.INDEX_FILE
    if index.is_file():
        data = json.loads(index.read_text())
        weight_map = {k: v for k, v in data["weight_map"].items() if v != C.MTP_FILE}
        weight_map.update(dict.fromkeys(tensors, C.MTP_FILE))
        data["weight_map"] = weight_map
        index.write_text(json.dumps(data))


def _edit_config(path: Path, edit) -> None:
    raw = json.loads((path / "config.json").read_text())
    edit(raw)
    (path / "config.json").write_text(json.dumps(raw))


def _expected(name: str, ref: dict) -> torch.Tensor:
    """What parameter ``name`` must hold: the raw tensor, w13 rows de-interleaved to [gate (0::2); up (1::2)]."""
    raw = ref[C.raw_key(name)]
    return torch.cat([raw[0::2], raw[1::2]]) if name.endswith(W13) else raw


def _assert_matches_raw(model: InklingMTP, ref: dict, dtype=torch.float32) -> None:
    names = [n for n, _ in model.named_parameters()]
    assert {C.raw_key(n) for n in names} == {k for k in ref if not k.startswith("model.mtp.layers.")
                                             or int(k.split(".")[3]) < model.config.num_depths}
    for name, p in model.named_parameters():
        assert p.dtype == dtype, name
        assert torch.equal(p, _expected(name, ref).to(dtype)), name


class _Recorder:
    """Wraps ``safe_open`` to record every tensor whose data is read (headers and get_slice shapes are free)."""

    def __init__(self):
        self.read: list[str] = []

    def __call__(self, *args, **kwargs):
        recorder, handle = self, safe_open(*args, **kwargs)

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def get_tensor(self, key):
                recorder.read.append(key)
                return handle.get_tensor(key)

            def __getattr__(self, name):
                return getattr(handle, name)

        return Handle()


# ------------------------------------------------------------------------------------------------ loading


def test_sharded_load_equals_raw_tensors(model, ref):
    _assert_matches_raw(model, ref)
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_loaded_weights_are_aligned(model):
    """safetensors returns tensors at arbitrary buffer offsets; misaligned weights make CPU GEMVs ~20 % slower."""
    assert {p.data_ptr() % C.ALIGNMENT for p in model.parameters()} == {0}


def test_sharded_and_unsharded_load_identically(model, flat):
    other = InklingMTP.from_pretrained(flat)
    assert other.config == model.config
    a, b = dict(model.named_parameters()), dict(other.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_w13_rows_are_deinterleaved(model, ref):
    inter = model.config.intermediate_size
    for i, layer in enumerate(model.layers):
        raw = ref[f"model.mtp.layers.{i}.{W13}"]
        ours = layer.transformer_block.mlp.w13_dn.weight
        assert ours.shape == raw.shape == (2 * inter, model.config.hidden_size)
        assert torch.equal(ours[:inter], raw[0::2])  # gate
        assert torch.equal(ours[inter:], raw[1::2])  # up
        assert not torch.equal(ours, raw)


def test_rel_logits_proj_width_per_depth(model, sharded):
    text = json.loads((sharded / "config.json").read_text())["text_config"]
    widths = [layer.transformer_block.attn.rel_logits_proj.proj.shape for layer in model.layers]
    # depth 0 sliding (window), depth 1 full (rel_extent)
    assert widths == [(text["d_rel"], text["sliding_window_size"]), (text["d_rel"], text["rel_extent"])]
    assert text["sliding_window_size"] != text["rel_extent"]


def test_bare_text_config_loads(flat, model, tmp_path):
    path = _copy(flat, tmp_path / "text")

    def to_text(raw):
        text = raw.pop("text_config")
        mtp = raw.pop("mtp_config")
        raw.clear()
        raw.update(text, num_mtp_layers=mtp["num_nextn_predict_layers"], mtp_local_layer_ids=mtp["local_layer_ids"],
                   chain_hidden_post_norm=mtp["chain_hidden_post_norm"])

    _edit_config(path, to_text)
    assert json.loads((path / "config.json").read_text())["model_type"] == "inkling_text"
    other = InklingMTP.from_pretrained(path)
    assert other.config == model.config
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("which", ["sharded", "flat"])
def test_reads_only_mtp_and_shared_tensors(which, request, ref, monkeypatch):
    path = request.getfixturevalue(which)
    recorder = _Recorder()
    monkeypatch.setattr(C, "safe_open", recorder)
    InklingMTP.from_pretrained(path)
    assert len(recorder.read) == len(set(recorder.read))  # each tensor read once
    assert set(recorder.read) == set(ref)  # every model.mtp.* tensor + the three shared ones, nothing else
    assert not [k for k in recorder.read if k.startswith("model.llm.layers.")]


def test_num_depths_one_loads_only_depth_zero(sharded, ref, monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(C, "safe_open", recorder)
    one = InklingMTP.from_pretrained(sharded, num_depths=1)
    assert one.config.num_depths == 1 and len(one.layers) == 1
    assert one.layers[0].transformer_block.attn.geometry.sliding
    assert not [k for k in recorder.read if k.startswith("model.mtp.layers.1.")]
    assert set(recorder.read) == {k for k in ref if not k.startswith("model.mtp.layers.1.")}
    _assert_matches_raw(one, ref)


@pytest.mark.parametrize("n", [0, 3])
def test_num_depths_out_of_range(sharded, n):
    with pytest.raises(CheckpointError, match=rf"num_depths={n} but the checkpoint has 2 MTP depth\(s\)"):
        InklingMTP.from_pretrained(sharded, num_depths=n)


def test_dtype_conversion(sharded, ref):
    bf16 = InklingMTP.from_pretrained(sharded, dtype=torch.bfloat16)
    _assert_matches_raw(bf16, ref, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.new_cache(1, 4).depths[0].k.dtype == torch.bfloat16


def test_default_dtype_is_the_stored_one(tmp_path, ref):
    path = S.write_checkpoint(tmp_path / "bf16", S.tiny_config(), dtype=torch.bfloat16, sharded=False)
    loaded = InklingMTP.from_pretrained(path)
    assert loaded.dtype == torch.bfloat16
    _assert_matches_raw(loaded, ref, dtype=torch.bfloat16)  # seeded per name: the fp32 values rounded


# ------------------------------------------------------------------------------------------------ target sharing


def _shared_params(target):
    emb = target.get_input_embeddings()
    return {"embed_weight": emb.weight, "embed_norm_weight": emb.embed_norm.weight,
            "lm_head_weight": target.get_output_embeddings().weight}


def _assert_shares(mtp: InklingMTP, target) -> None:
    for name, param in _shared_params(target).items():
        ours = getattr(mtp, name)
        assert ours is param, name  # the very same Parameter object
        assert ours.data_ptr() == param.data_ptr(), name  # no copy of the storage
    ids = {id(p) for p in mtp.parameters()}
    assert all(id(p) in ids for p in _shared_params(target).values())


def test_target_conditional_generation_shares_tensors(sharded, target, ref):
    grads = {n: p.requires_grad for n, p in _shared_params(target).items()}
    mtp = InklingMTP.from_pretrained(sharded, target=target)
    _assert_shares(mtp, target)
    _assert_matches_raw(mtp, ref)
    assert {n: p.requires_grad for n, p in _shared_params(target).items()} == grads  # target left as it was
    assert not any(p.requires_grad for n, p in mtp.named_parameters() if n not in C.SHARED_KEYS)


def test_target_causal_lm_shares_tensors(sharded, target, ref, monkeypatch):
    lm = S.hf_causal_lm_from(target)
    recorder = _Recorder()
    monkeypatch.setattr(C, "safe_open", recorder)
    mtp = InklingMTP.from_pretrained(sharded, target=lm)
    _assert_shares(mtp, lm)
    assert set(recorder.read) == set(ref) - SHARED  # the shared tensors are not read from disk at all
    _assert_matches_raw(mtp, ref)


def test_target_dtype_is_adopted(sharded, target):
    mtp = InklingMTP.from_pretrained(sharded, target=target, dtype=torch.float32, device="cpu")
    assert mtp.dtype == torch.float32 and mtp.device == torch.device("cpu")


def test_target_with_contradicting_dtype(sharded, target):
    with pytest.raises(CheckpointError, match=r"dtype=torch\.bfloat16 requested, but the target's shared tensors "
                                              r"are torch\.float32"):
        InklingMTP.from_pretrained(sharded, target=target, dtype=torch.bfloat16)


def test_target_with_contradicting_device(sharded, target):
    with pytest.raises(CheckpointError, match=r"device=meta requested, but the target lives on cpu"):
        InklingMTP.from_pretrained(sharded, target=target, device="meta")


def test_device_matching_rule():
    assert C._same_device(torch.device("cuda"), torch.device("cuda", 1))
    assert C._same_device(torch.device("cuda", 1), torch.device("cuda", 1))
    assert not C._same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not C._same_device(torch.device("cpu"), torch.device("cuda", 0))


def test_target_with_other_dims(sharded):
    from transformers import InklingForCausalLM

    other = InklingForCausalLM(tiny_text_config(hidden_size=32, vocab_size=256))
    with pytest.raises(CheckpointError, match=r"target config does not match the MTP checkpoint config: "
                                              r"hidden_size: target 32, checkpoint 64; "
                                              r"vocab_size: target 256, checkpoint 512"):
        InklingMTP.from_pretrained(sharded, target=other)


@pytest.mark.parametrize("kind", ["module", "llama"])
def test_non_inkling_target(sharded, kind):
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        other = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, vocab_size=512))
        name = "LlamaForCausalLM"
    else:
        other, name = nn.Linear(64, 512), "Linear"
    with pytest.raises(CheckpointError, match=rf"target must be a transformers Inkling model .*got {name}$"):
        InklingMTP.from_pretrained(sharded, target=other)


# ------------------------------------------------------------------------------------------------ save


def _assert_bit_exact(a: InklingMTP, b: InklingMTP) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype, name
        assert torch.equal(pa[name], pb[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip_is_bit_exact(sharded, tmp_path, dtype):
    mtp = InklingMTP.from_pretrained(sharded, dtype=dtype)
    mtp.save_pretrained(tmp_path / "out")
    back = InklingMTP.from_pretrained(tmp_path / "out")
    assert back.config == mtp.config
    _assert_bit_exact(mtp, back)


def test_save_writes_the_raw_layout(model, ref, tmp_path):
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / C.MTP_FILE), framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert saved.keys() == {k for k in ref if k.startswith("model.mtp.")}
    for key, tensor in saved.items():
        assert torch.equal(tensor, ref[key]), key  # w13 re-interleaved: equal to the original raw tensor
    shared = load_file(tmp_path / C.SHARED_FILE)
    assert shared.keys() == SHARED and all(torch.equal(shared[k], ref[k]) for k in SHARED)
    assert json.loads((tmp_path / "config.json").read_text())["mtp_config"]["num_nextn_predict_layers"] == 2


def test_save_keeps_the_original_config(model, sharded, tmp_path):
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((sharded / "config.json").read_text())


def test_save_one_depth_writes_one_depth_config(sharded, ref, tmp_path):
    one = InklingMTP.from_pretrained(sharded, num_depths=1)
    one.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["mtp_config"]["num_nextn_predict_layers"] == 1
    assert raw["mtp_config"]["local_layer_ids"] == [0]
    with safe_open(str(tmp_path / C.MTP_FILE), framework="pt") as f:
        assert not [k for k in f.keys() if not k.startswith("model.mtp.layers.0.")]
    back = InklingMTP.from_pretrained(tmp_path)
    assert back.config.num_depths == 1
    _assert_bit_exact(one, back)


def test_save_one_depth_of_a_text_config_model(tmp_path):
    mtp = random_mtp(tiny_text_config(num_mtp_layers=2, mtp_local_layer_ids=[1]))
    mtp.save_pretrained(tmp_path / "two")
    one = InklingMTP.from_pretrained(tmp_path / "two", num_depths=1)
    one.save_pretrained(tmp_path / "one")
    raw = json.loads((tmp_path / "one" / "config.json").read_text())
    assert raw["model_type"] == "inkling_text"
    assert raw["num_mtp_layers"] == 1 and raw["mtp_local_layer_ids"] == []
    back = InklingMTP.from_pretrained(tmp_path / "one")
    assert back.config.num_depths == 1 and not back.config.depths[0].sliding
    _assert_bit_exact(one, back)


def test_save_without_shared_then_load_reports_them_missing(model, tmp_path):
    model.save_pretrained(tmp_path, include_shared=False)
    assert not (tmp_path / C.SHARED_FILE).exists()
    with pytest.raises(CheckpointError, match=r"missing 3 tensor\(s\): \['model\.llm\.embed\.weight', "
                                              r"'model\.llm\.embed_norm\.weight', 'model\.llm\.unembed\.weight'\]"):
        InklingMTP.from_pretrained(tmp_path)


def test_save_from_target_loaded_model(sharded, target, ref, tmp_path):
    mtp = InklingMTP.from_pretrained(sharded, target=target)
    mtp.save_pretrained(tmp_path)
    _assert_bit_exact(mtp, InklingMTP.from_pretrained(tmp_path))


# ------------------------------------------------------------------------------------------------ broken checkpoints


@pytest.fixture
def broken(sharded, tmp_path) -> Path:
    return _copy(sharded, tmp_path / "broken")


@pytest.fixture
def broken_flat(flat, tmp_path) -> Path:
    return _copy(flat, tmp_path / "broken_flat")


KEY = "model.mtp.layers.0.hidden_norm.weight"


@pytest.mark.parametrize("which", ["broken", "broken_flat"])
def test_missing_key(which, request):
    path = request.getfixturevalue(which)
    _edit_mtp(path, lambda t: t.pop(KEY))
    with pytest.raises(CheckpointError, match=rf"missing 1 tensor\(s\): \['{KEY}'\]"):
        InklingMTP.from_pretrained(path)


def test_missing_key_still_listed_in_index(broken):
    tensors = load_file(broken / C.MTP_FILE)
    del tensors[KEY]
    save_file(tensors, str(broken / C.MTP_FILE))  # the index still names it
    with pytest.raises(CheckpointError, match=rf"missing 1 tensor\(s\): \['{KEY}'\]"):
        InklingMTP.from_pretrained(broken)


def test_missing_mtp_file_named_by_index(broken):
    (broken / C.MTP_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"(?s)missing 40 tensor\(s\): .*files named in "
                                              r"model\.safetensors\.index\.json do not exist: \['mtp\.safetensors'\]"):
        InklingMTP.from_pretrained(broken)


def test_missing_shared_shard_named_by_index(broken):
    weight_map = json.loads((broken / C.INDEX_FILE).read_text())["weight_map"]
    shard = weight_map["model.llm.unembed.weight"]
    (broken / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"(?s)'model\.llm\.unembed\.weight'.*do not exist: \['{shard}'\]"):
        InklingMTP.from_pretrained(broken)


FOO = "model.mtp.layers.0.foo.weight"


@pytest.mark.parametrize("which", ["broken", "broken_flat"])
def test_unexpected_key(which, request):
    path = request.getfixturevalue(which)
    _edit_mtp(path, lambda t: t.__setitem__(FOO, torch.zeros(3)))
    with pytest.raises(CheckpointError, match=rf"unexpected 1 tensor\(s\) under model\.mtp\.: \['{FOO}'\]"):
        InklingMTP.from_pretrained(path)


def test_unexpected_key_not_in_index(broken):
    tensors = load_file(broken / C.MTP_FILE)
    tensors[FOO] = torch.zeros(3)
    save_file(tensors, str(broken / C.MTP_FILE))  # the index does not know it: the MTP shard's header still counts
    with pytest.raises(CheckpointError, match=rf"unexpected 1 tensor\(s\) under model\.mtp\.: \['{FOO}'\]"):
        InklingMTP.from_pretrained(broken)


def test_extra_depth_is_unexpected_unless_skipped(broken, ref):
    extra = {k.replace("layers.1.", "layers.2."): v for k, v in ref.items() if k.startswith("model.mtp.layers.1.")}
    _edit_mtp(broken, lambda t: t.update(extra))
    with pytest.raises(CheckpointError, match=r"unexpected 20 tensor\(s\) under model\.mtp\.: "
                                              r"\['model\.mtp\.layers\.2\."):
        InklingMTP.from_pretrained(broken)


def test_mis_shaped_key(broken):
    key = "model.mtp.layers.1.input_proj.weight"
    _edit_mtp(broken, lambda t: t.__setitem__(key, torch.zeros(64, 100)))
    with pytest.raises(CheckpointError, match=rf"mis-shaped 1 tensor\(s\): {key}: checkpoint \[64, 100\], "
                                              r"config expects \[64, 128\]"):
        InklingMTP.from_pretrained(broken)


def test_mis_shaped_shared_key(broken_flat):
    tensors = load_file(broken_flat / C.SHARED_FILE)
    tensors["model.llm.embed_norm.weight"] = torch.ones(65)
    save_file(tensors, str(broken_flat / C.SHARED_FILE))
    with pytest.raises(CheckpointError, match=r"model\.llm\.embed_norm\.weight: checkpoint \[65\], "
                                              r"config expects \[64\]"):
        InklingMTP.from_pretrained(broken_flat)


def test_all_problems_reported_at_once(broken):
    def edit(t):
        del t[KEY]
        t[FOO] = torch.zeros(1)
        t["model.mtp.layers.1.input_proj.weight"] = torch.zeros(1, 1)

    _edit_mtp(broken, edit)
    with pytest.raises(CheckpointError, match=r"(?s)checkpoint does not match its config:\n  missing 1.*\n  "
                                              r"unexpected 1.*\n  mis-shaped 1"):
        InklingMTP.from_pretrained(broken)


def test_chain_norm_present_but_disabled(broken):
    _edit_mtp(broken, lambda t: t.__setitem__("model.mtp.chain_norm.weight", torch.ones(64)))
    with pytest.raises(CheckpointError, match=r"model\.mtp\.chain_norm\.weight is present but "
                                              r"chain_hidden_post_norm is false in the config"):
        InklingMTP.from_pretrained(broken)


def test_chain_norm_enabled_but_absent(broken):
    _edit_config(broken, lambda raw: raw["mtp_config"].update(chain_hidden_post_norm=True))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): \['model\.mtp\.chain_norm\.weight'\]"):
        InklingMTP.from_pretrained(broken)


def test_chain_norm_enabled_and_present_loads(broken):
    gain = torch.rand(64) + 0.5
    _edit_mtp(broken, lambda t: t.__setitem__("model.mtp.chain_norm.weight", gain))
    _edit_config(broken, lambda raw: raw["mtp_config"].update(chain_hidden_post_norm=True))
    mtp = InklingMTP.from_pretrained(broken)
    assert mtp.config.chain_hidden_post_norm and torch.equal(mtp.chain_norm.weight, gain)


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw["text_config"].update(hidden_act="relu2"), r"unsupported hidden_act 'relu2'"),
    (lambda raw: raw.pop("mtp_config"), r"config has no MTP depths \(num_mtp_layers=None"),
    (lambda raw: raw["mtp_config"].update(num_nextn_predict_layers=0), r"config has no MTP depths \(num_mtp_layers=0"),
    (lambda raw: raw["mtp_config"].update(local_layer_ids=[0, 2]), r"mtp_local_layer_ids \[2\] out of range for 2"),
    (lambda raw: raw["text_config"].update(logits_mup_width_multiplier=0.0),
     r"logits_mup_width_multiplier must be positive, got 0\.0"),
    (lambda raw: raw["text_config"].update(logits_mup_width_multiplier=-24.0),
     r"logits_mup_width_multiplier must be positive, got -24\.0"),
    (lambda raw: raw["text_config"].update(unpadded_vocab_size=513),
     r"unpadded_vocab_size 513 must be in \(0, vocab_size=512\]"),
], ids=["relu2", "no-mtp-config", "zero-depths", "local-id-range", "mup-zero", "mup-negative", "unpadded-gt-vocab"])
def test_unsupported_config_values(broken, edit, message):
    _edit_config(broken, edit)
    with pytest.raises(ConfigError, match=message):
        InklingMTP.from_pretrained(broken)


def test_wrong_model_type(broken):
    _edit_config(broken, lambda raw: raw.update(model_type="deepseek_v3"))
    with pytest.raises(ConfigError, match=r"config\.json: model_type 'deepseek_v3' is not an Inkling config"):
        InklingMTP.from_pretrained(broken)


def test_missing_config_json(broken):
    (broken / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no config\.json in .*broken"):
        InklingMTP.from_pretrained(broken)


def test_no_safetensors_files(sharded, tmp_path):
    (tmp_path / "empty").mkdir()
    shutil.copy(sharded / "config.json", tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files in .*empty"):
        InklingMTP.from_pretrained(tmp_path / "empty")


def test_integer_mtp_tensors_rejected(broken_flat):
    def to_int(t):
        for k in list(t):
            t[k] = t[k].to(torch.int32)

    _edit_mtp(broken_flat, to_int)
    with pytest.raises(CheckpointError, match=r"is stored as I32; MTP weights must be floating point"):
        InklingMTP.from_pretrained(broken_flat)
