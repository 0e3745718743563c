"""Raw Inkling checkpoint layout <-> ``InklingMTP`` (docs/model.md §3, docs/architecture.md §3): exact loading (w13
de-interleave, per-depth rel-bias widths), reading only what the draft needs, sharing the target's tensors without
copies, a bit-exact save/load round trip, one clear message for every kind of broken checkpoint or argument, and saves
that are atomic (a failure at any file leaves the directory byte-for-byte as it was), keep an index true to what was
written and never destroy tensors they do not own."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import inkling_compiled.checkpoint as C
from inkling_compiled import CheckpointError, ConfigError, InklingMTP
from inkling_compiled.arguments import ArgumentError
from inkling_compiled.checkpoint import reader, writer
from inkling_compiled.checkpoint.target import same_device
from inkling_compiled.testing import synthetic as S
from tests.helpers import random_mtp, tiny_text_config

pytestmark = pytest.mark.floor  # make test-floor: exercises a dependency at its lowest version

SHARED = set(C.SHARED_RAW_KEYS)
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
    monkeypatch.setattr(reader, "safe_open", recorder)
    InklingMTP.from_pretrained(path)
    assert len(recorder.read) == len(set(recorder.read))  # each tensor read once
    assert set(recorder.read) == set(ref)  # every model.mtp.* tensor + the three shared ones, nothing else
    assert not [k for k in recorder.read if k.startswith("model.llm.layers.")]


def test_num_depths_one_loads_only_depth_zero(sharded, ref, monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(reader, "safe_open", recorder)
    one = InklingMTP.from_pretrained(sharded, num_depths=1)
    assert one.config.num_depths == 1 and len(one.layers) == 1
    assert one.layers[0].transformer_block.attn.geometry.sliding
    assert not [k for k in recorder.read if k.startswith("model.mtp.layers.1.")]
    assert set(recorder.read) == {k for k in ref if not k.startswith("model.mtp.layers.1.")}
    _assert_matches_raw(one, ref)


def test_an_opened_checkpoint_is_immutable(sharded):
    """One function builds it; nothing changes it afterwards (reading a state included)."""
    opened = C.open_checkpoint(sharded, num_depths=1)
    before = (dict(opened.located), dict(opened.headers))
    with pytest.raises(dataclasses.FrozenInstanceError):
        opened.config = None
    with pytest.raises(TypeError):
        opened.located["x"] = Path("y")
    shapes = {n: p.shape for n, p in InklingMTP.from_pretrained(sharded, num_depths=1).named_parameters()}
    own, _ = opened.read_state(shapes)
    assert set(own) == set(shapes)
    assert (dict(opened.located), dict(opened.headers)) == before
    assert opened.config.num_depths == 1 and opened.stored_depths == 2


def test_num_depths_out_of_range(sharded):
    with pytest.raises(CheckpointError, match=r"num_depths=3 but the checkpoint has 2 MTP depth\(s\)"):
        InklingMTP.from_pretrained(sharded, num_depths=3)
    for n in (0, -1):  # no depth at all is no count the checkpoint could hold
        with pytest.raises(ArgumentError, match=rf"^num_depths must be an int >= 1, got {n} \(or None: every depth\)$"):
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
    monkeypatch.setattr(reader, "safe_open", recorder)
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
    assert same_device(torch.device("cuda"), torch.device("cuda", 1))
    assert same_device(torch.device("cuda", 1), torch.device("cuda", 1))
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not same_device(torch.device("cpu"), torch.device("cuda", 0))


def test_target_with_another_logits_vocabulary_or_mup(sharded):
    from transformers import InklingForCausalLM

    other = InklingForCausalLM(tiny_text_config(hidden_size=64, vocab_size=512, unpadded_vocab_size=480,
                                                logits_mup_width_multiplier=12.0))
    with pytest.raises(CheckpointError, match=r"logits vocabulary \(unpadded_vocab_size\): target 480, checkpoint "
                                              r"\d+; logits_mup_width_multiplier: target 12.0, checkpoint [\d.]+$"):
        InklingMTP.from_pretrained(sharded, target=other)


def test_target_with_other_dims(sharded):
    from transformers import InklingForCausalLM

    other = InklingForCausalLM(tiny_text_config(hidden_size=32, vocab_size=256))
    with pytest.raises(CheckpointError, match=r"target config does not match the MTP checkpoint config: "
                                              r"hidden_size: target 32, checkpoint 64; "
                                              r"vocab_size: target 256, checkpoint 512"):
        InklingMTP.from_pretrained(sharded, target=other)


def test_a_target_without_its_lm_head_is_refused(sharded):
    text_model = S.load_hf_target(sharded).model  # InklingTextModel: an Inkling config, no LM head to share
    with pytest.raises(CheckpointError, match=rf"with its LM head .*got {type(text_model).__name__}, which has none$"):
        InklingMTP.from_pretrained(sharded, target=text_model)


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
    assert a.config == b.config
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


def test_a_save_that_would_drop_depths_it_did_not_load_is_refused(sharded, tmp_path):
    shutil.copytree(sharded, tmp_path / "c")
    before = _snapshot(tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"holds MTP depth\(s\) \[1\], which this model lacks and the save "
                                              r"would drop \(save to a new directory\)$"):
        InklingMTP.from_pretrained(tmp_path / "c", num_depths=1).save_pretrained(tmp_path / "c")
    assert _snapshot(tmp_path / "c") == before


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
     r"logits_mup_width_multiplier must be > 0, got 0\.0"),
    (lambda raw: raw["text_config"].update(logits_mup_width_multiplier=-24.0),
     r"logits_mup_width_multiplier must be > 0, got -24\.0"),
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
    with pytest.raises(CheckpointError, match=r"40 tensor\(s\) stored in a dtype that is not F32/BF16/F16/F64: "
                                              r"model\.mtp\.layers\.0\.embed_norm\.weight: I32"):
        InklingMTP.from_pretrained(broken_flat)


# ------------------------------------------------------------------------------------------------ stored dtypes

LAST = "model.mtp.layers.1.transformer_block.mlp_sconv.weight"  # sorts last: a check of the first key misses it


@pytest.mark.parametrize("stored, name", [(torch.int8, "I8"), (torch.int64, "I64"), (torch.bool, "BOOL"),
                                          (torch.complex64, "C64"), (torch.float8_e4m3fn, "F8_E4M3")])
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_one_non_floating_tensor_among_floats(broken, stored, name, dtype):
    _edit_mtp(broken, lambda t: t.__setitem__(LAST, t[LAST].to(stored)))
    with pytest.raises(CheckpointError, match=rf"1 tensor\(s\) stored in a dtype that is not F32/BF16/F16/F64: "
                                              rf"{re.escape(LAST)}: {name}$"):
        InklingMTP.from_pretrained(broken, dtype=dtype)


def test_non_floating_shared_tensor(broken_flat):
    tensors = load_file(broken_flat / C.SHARED_FILE)
    tensors["model.llm.unembed.weight"] = tensors["model.llm.unembed.weight"].to(torch.int16)
    save_file(tensors, str(broken_flat / C.SHARED_FILE))
    with pytest.raises(CheckpointError, match=r"model\.llm\.unembed\.weight: I16"):
        InklingMTP.from_pretrained(broken_flat, dtype=torch.float32)


def test_mixed_float_dtypes_need_a_dtype(broken, ref):
    _edit_mtp(broken, lambda t: t.__setitem__(LAST, t[LAST].to(torch.float16)))
    with pytest.raises(CheckpointError, match=r"the MTP tensors are stored in several dtypes \{'F16': 1, 'F32': 39\}; "
                                              r"pass dtype= to load them all in one"):
        InklingMTP.from_pretrained(broken)
    mtp = InklingMTP.from_pretrained(broken, dtype=torch.float32)
    assert {p.dtype for p in mtp.parameters()} == {torch.float32}


@pytest.mark.parametrize("dtype, error, message", [
    (torch.int8, ValueError, r"got torch\.int8"),
    (torch.bool, ValueError, r"got torch\.bool"),
    (torch.complex64, ValueError, r"got torch\.complex64"),
    (torch.float8_e4m3fn, ValueError, r"got torch\.float8_e4m3fn"),
    ("bfloat16", TypeError, r"got str 'bfloat16'"),
    (16, TypeError, r"got int 16"),
])
def test_dtype_must_be_a_supported_float(sharded, dtype, error, message):
    with pytest.raises(error, match=r"^dtype must be None or one of \['torch\.bfloat16', 'torch\.float16', "
                                    r"'torch\.float32', 'torch\.float64'\].*" + message):
        InklingMTP.from_pretrained(sharded, dtype=dtype)


# ------------------------------------------------------------------------------------------------ non-finite values


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_rejected(broken, value):
    def poison(t):
        t[LAST] = t[LAST].clone()
        t[LAST].view(-1)[3] = value

    _edit_mtp(broken, poison)
    with pytest.raises(CheckpointError, match=rf"tensors hold NaN or inf values \(as torch\.float32\): "
                                              rf"\['{re.escape(LAST)}'\]"):
        InklingMTP.from_pretrained(broken)


def test_overflow_on_conversion_rejected(broken):
    """A finite fp32 weight beyond float16's range becomes inf on conversion: refused, naming the dtype."""
    key = "model.mtp.layers.0.input_proj.weight"

    def big(t):
        t[key] = t[key].clone()
        t[key][0, 0] = 1e6

    _edit_mtp(broken, big)
    InklingMTP.from_pretrained(broken)  # fine as stored
    with pytest.raises(CheckpointError, match=rf"\(as torch\.float16\): \['{key}'\]"):
        InklingMTP.from_pretrained(broken, dtype=torch.float16)


# ------------------------------------------------------------------------------------------------ unreadable files


def _truncate(file: Path, keep: int | None = None) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:keep if keep is not None else len(data) // 2])


@pytest.mark.parametrize("which", ["broken", "broken_flat"])
@pytest.mark.parametrize("damage, message", [
    (lambda f: _truncate(f), r"incomplete metadata, file not fully covered"),
    (lambda f: _truncate(f, 30), r"invalid header length"),
    (lambda f: f.write_bytes(b""), r"header too small"),
    (lambda f: f.write_bytes(b"\x10" + b"x" * 200), r"header"),
], ids=["truncated-data", "truncated-header", "empty", "garbage"])
def test_unreadable_mtp_shard_named(which, request, damage, message):
    path = request.getfixturevalue(which)
    damage(path / C.MTP_FILE)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path / C.MTP_FILE))}: not a readable safetensors "
                                              rf"file \(.*{message}"):
        InklingMTP.from_pretrained(path)


def test_truncated_target_shard_named(broken):
    shard = json.loads((broken / C.INDEX_FILE).read_text())["weight_map"]["model.llm.unembed.weight"]
    _truncate(broken / shard)
    with pytest.raises(CheckpointError, match=rf"{re.escape(shard)}: not a readable safetensors file \(.*incomplete"):
        InklingMTP.from_pretrained(broken)


@pytest.mark.parametrize("content, message", [
    (b'{"weight_map": {', r"invalid JSON: Expecting property name enclosed in double quotes"),
    (b"[]", r"expected a JSON object, got list"),
    (b'{"metadata": {}}', r"'weight_map' must be an object mapping tensor keys to files, got NoneType"),
    (b'{"weight_map": ["mtp.safetensors"]}', r"'weight_map' must be an object mapping tensor keys to files, got list"),
    (b'{"weight_map": {"model.llm.embed.weight": 3}}', r"not: 'model\.llm\.embed\.weight': 3"),
    (b'{"weight_map": {"model.llm.embed.weight": null}}', r"not: 'model\.llm\.embed\.weight': None"),
    (b'{"weight_map": {"model.llm.embed.weight": "../other/model.safetensors"}}', r"'\.\./other/model\.safetensors'"),
    (b'{"weight_map": {"model.llm.embed.weight": "/etc/model.safetensors"}}', r"'/etc/model\.safetensors'"),
    (b'{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', r"key\(s\) \['a'\] given twice"),
], ids=["truncated", "list", "no-weight-map", "weight-map-list", "int-entry", "null-entry", "parent-dir", "absolute",
        "repeated-key"])
def test_corrupt_index_named(broken, content, message):
    (broken / C.INDEX_FILE).write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(broken / C.INDEX_FILE))}: .*{message}"):
        InklingMTP.from_pretrained(broken)


@pytest.mark.parametrize("content, message", [
    (b"{", r"invalid JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
    (b"[1]", r"expected a JSON object, got list"),
], ids=["truncated", "list"])
def test_corrupt_config_json_named(broken, content, message):
    (broken / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(broken / 'config.json'))}: {message}"):
        InklingMTP.from_pretrained(broken)


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw["text_config"].update(sliding_window_size=0), r"sliding_window_size must be >= 1, got 0"),
    (lambda raw: raw["text_config"].update(rel_extent=0), r"rel_extent must be >= 1, got 0"),
    (lambda raw: raw["text_config"].update(rms_norm_eps=-1e-6), r"rms_norm_eps must be > 0, got -1e-06"),
    (lambda raw: raw["text_config"].update(num_attention_heads=0), r"num_attention_heads must be >= 1, got 0"),
    (lambda raw: raw["text_config"].update(logits_mup_width_multiplier=float("nan")),
     r"logits_mup_width_multiplier must be finite, got nan"),
    (lambda raw: raw["text_config"].update(use_embed_norm="false"), r"use_embed_norm must be a bool, got 'false'"),
    (lambda raw: raw["mtp_config"].update(local_layer_ids=[0], chain_hidden_post_norm="no"),
     r"chain_hidden_post_norm"),
], ids=["window-0", "extent-0", "eps-negative", "heads-0", "mup-nan", "embed-norm-string", "chain-norm-string"])
def test_unworkable_config_json_named(broken, edit, message):
    _edit_config(broken, edit)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(broken / 'config.json'))}: .*{message}"):
        InklingMTP.from_pretrained(broken)


def test_directory_that_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"checkpoint directory {re.escape(str(tmp_path / 'nope'))} does not "
                                                r"exist"):
        InklingMTP.from_pretrained(tmp_path / "nope")


def test_file_instead_of_directory(sharded):
    with pytest.raises(NotADirectoryError, match=r"mtp\.safetensors is not a directory \(a checkpoint is a directory"):
        InklingMTP.from_pretrained(sharded / C.MTP_FILE)


@pytest.mark.parametrize("path", [123, None, b"/tmp", ["dir"]])
def test_path_type(path):
    with pytest.raises(TypeError, match=r"^checkpoint path must be a str or os\.PathLike, got "):
        InklingMTP.from_pretrained(path)


# ------------------------------------------------------------------------------------------------ duplicates


def test_same_key_in_two_shards_without_index(broken_flat):
    shared = load_file(broken_flat / C.SHARED_FILE)
    shared[KEY] = torch.ones(64)  # also in mtp.safetensors: which one is meant?
    save_file(shared, str(broken_flat / C.SHARED_FILE))
    with pytest.raises(CheckpointError, match=r"tensors held by several files \(and no model\.safetensors\.index\.json "
                                              rf"to choose\): {KEY} \(in model\.safetensors, mtp\.safetensors\)$"):
        InklingMTP.from_pretrained(broken_flat)


def test_index_maps_a_key_to_a_file_holding_another(broken):
    data = json.loads((broken / C.INDEX_FILE).read_text())
    shards = sorted({v for v in data["weight_map"].values() if v != C.MTP_FILE})
    key = "model.llm.unembed.weight"
    other = next(s for s in shards if s != data["weight_map"][key])
    data["weight_map"][key] = other
    (broken / C.INDEX_FILE).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=rf"(?s)missing 1 tensor\(s\): \['{key}'\].*model\.safetensors\.index"
                                              rf"\.json names files that do not hold the tensor: {key} -> {other}$"):
        InklingMTP.from_pretrained(broken)


# ------------------------------------------------------------------------------------------------ arguments


def test_an_empty_path_is_refused_not_taken_for_the_working_directory(sharded, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mtp = InklingMTP.from_pretrained(sharded)
    for call in (lambda: InklingMTP.from_pretrained(""), lambda: mtp.save_pretrained("")):
        with pytest.raises(ArgumentError, match=r"^checkpoint path must name a path, got ''$"):
            call()
    assert list(tmp_path.iterdir()) == []


def test_quantize_head_is_checked_without_quantize(sharded):
    with pytest.raises(ArgumentError, match="^quantize_head must be a bool, got 'x'$"):
        InklingMTP.from_pretrained(sharded, quantize_head="x")


@pytest.mark.parametrize("num_depths, message", [(True, "True"), (1.5, "1.5"), ("2", "'2'"),
                                                  (torch.tensor([1.5]), r"tensor\(\[1\.5000\]\)")])
def test_num_depths_type(sharded, num_depths, message):
    every = r" \(or None: every depth\)$"
    with pytest.raises(ArgumentError, match=rf"^num_depths must be an int >= 1, got {message}" + every):
        InklingMTP.from_pretrained(sharded, num_depths=num_depths)


@pytest.mark.parametrize("device, message", [
    ("cuda:x", r"Invalid device string"),
    ("gpu", r"Expected one of cpu, cuda"),
    ([0], r""),
    ("cpu:1", r"torch has one CPU device, 'cpu'"),  # (loading took it, then the target on 'cpu' did not match)
])
def test_invalid_device(sharded, device, message):
    with pytest.raises(ValueError, match=rf"^device={re.escape(repr(device))} is not usable: {message}"):
        InklingMTP.from_pretrained(sharded, device=device)


def test_unavailable_device(sharded):
    """No machine has a 100th CUDA device (and a CPU build has none): refused before anything is read."""
    with pytest.raises(ValueError, match=r"^device='cuda:99' is not usable: "):
        InklingMTP.from_pretrained(sharded, device="cuda:99")


@pytest.mark.parametrize("name, value", [("progress", "yes"), ("progress", 1), ("mtp_log_scaling", "yes"),
                                         ("mtp_log_scaling", None)])
def test_flags_must_be_bools(sharded, name, value):
    with pytest.raises(TypeError, match=rf"^{name} must be a bool"):
        InklingMTP.from_pretrained(sharded, **{name: value})


# ------------------------------------------------------------------------------------------------ the target


def test_frozen_target_stays_frozen(sharded):
    """load_state_dict(assign=True) copies the module's requires_grad onto a Parameter it is given: loading must not
    switch autograd back on for a target that the user froze."""
    target = S.load_hf_target(sharded).requires_grad_(False)
    mtp = InklingMTP.from_pretrained(sharded, target=target)
    _assert_shares(mtp, target)
    assert not any(p.requires_grad for p in target.parameters())


def test_target_with_embed_norm_but_checkpoint_without(broken, target):
    _edit_config(broken, lambda raw: raw["text_config"].update(use_embed_norm=False))
    with pytest.raises(CheckpointError, match=r"embed_norm: the target's embedding has embed_norm, the checkpoint "
                                              r"config has use_embed_norm=False"):
        InklingMTP.from_pretrained(broken, target=target)


def test_target_without_embed_norm(sharded):
    target = S.load_hf_target(sharded)
    del target.get_input_embeddings().embed_norm
    with pytest.raises(CheckpointError, match=r"embed_norm: the target's embedding has no embed_norm, the checkpoint "
                                              r"config has use_embed_norm=True"):
        InklingMTP.from_pretrained(sharded, target=target)


@pytest.mark.parametrize("to, where", [(torch.bfloat16, r"torch\.bfloat16 on cpu"),
                                       ("meta", r"torch\.float32 on meta")])
def test_target_with_shared_tensors_split_across_dtypes_or_devices(sharded, to, where):
    """A half-converted target, or one whose embedding and head sit on different devices (device_map="auto"): the
    MTP cannot share tensors that do not run together."""
    target = S.load_hf_target(sharded)
    target.get_input_embeddings().to(to)
    with pytest.raises(CheckpointError, match=r"the target's shared tensors must be of one floating dtype on one "
                                              rf"device.*embed_weight: {where}"):
        InklingMTP.from_pretrained(sharded, target=target)


# ------------------------------------------------------------------------------------------------ saving: fixtures


@pytest.fixture(scope="module")
def other(ckpt_root) -> InklingMTP:
    """A model whose every tensor (embedding and head included) differs from ``sharded``'s."""
    return InklingMTP.from_pretrained(S.cached_checkpoint("tiny", root=ckpt_root, seed=1))


@pytest.fixture(scope="module")
def other_depths(sharded, other) -> InklingMTP:
    """``sharded``'s shared tensors (the target's), ``other``'s depths: what a save over the target may write."""
    mixed = InklingMTP.from_pretrained(sharded)
    mixed.load_state_dict({n: p for n, p in other.state_dict().items() if n not in C.SHARED_KEYS}, strict=False)
    return mixed


@pytest.fixture(scope="module")
def saved(ckpt_root, sharded) -> Path:
    """A directory written by save_pretrained itself."""
    InklingMTP.from_pretrained(sharded).save_pretrained(ckpt_root / "saved")
    return ckpt_root / "saved"


def _snapshot(path: Path) -> dict[str, bytes]:
    """Every entry of the directory (hidden temporaries included) with its bytes (None for a directory)."""
    return {p.name: p.read_bytes() if p.is_file() else None for p in sorted(path.iterdir())}


def _assert_cannot_save(model: InklingMTP, tmp_path: Path, match: str, error: type[Exception] = CheckpointError,
                        **kwargs) -> None:
    """Saving ``model`` into a new directory raises ``error`` (matching ``match``) and creates nothing."""
    with pytest.raises(error, match=match):
        model.save_pretrained(tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def _assert_save_refused(model: InklingMTP, path: Path, error: type[Exception], match: str) -> None:
    """Saving ``model`` into ``path`` raises ``error`` (matching ``match``) and leaves the directory as it was."""
    before = _snapshot(path)
    with pytest.raises(error, match=match):
        model.save_pretrained(path)
    assert _snapshot(path) == before


# ------------------------------------------------------------------------------------------------ atomicity

DISK_FULL = OSError(28, "No space left on device")


def _fail_at(monkeypatch, n: int, how: str) -> list[str]:
    """Make the writer of the ``n``-th file of the next save fail: before writing (``before``), after writing half of
    its bytes (``partial``), or by an interrupt (``interrupt``). Returns the file names the save writes, in order."""
    real, names = writer.write_files_atomically, []

    def write_files_atomically(directory, files):
        names.extend(files)
        victim = list(files)[n]

        def fail(file: Path) -> None:
            if how == "interrupt":
                raise KeyboardInterrupt
            if how == "partial":
                files[victim](file)
                file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
            raise DISK_FULL

        return real(directory, {**files, victim: fail})

    monkeypatch.setattr(writer, "write_files_atomically", write_files_atomically)
    return names


EXPECTED_FILES = {
    "sharded": [C.MTP_FILE, C.INDEX_FILE, "config.json"],  # the shared tensors are the target's shards' already
    "saved": [C.MTP_FILE, C.SHARED_FILE, "config.json"],
    "new": [C.MTP_FILE, C.SHARED_FILE, "config.json"],
}


@pytest.mark.parametrize("how", ["before", "partial", "interrupt"])
@pytest.mark.parametrize("which", ["sharded", "saved", "new"])
def test_failed_save_leaves_the_directory_as_it_was(which, how, request, other, other_depths, tmp_path, monkeypatch):
    """Fault injection at every file of a save: after each failure the directory holds exactly the bytes it held
    before (no stray temporaries) and loads as before; a new directory is not left behind at all."""
    other = other_depths if which == "sharded" else other  # over a sharded target: its own shared tensors
    path = tmp_path / "new" / "deeper" if which == "new" else _copy(request.getfixturevalue(which), tmp_path / which)
    before = _snapshot(path) if which != "new" else None
    loaded_before = InklingMTP.from_pretrained(path) if which != "new" else None
    expected = EXPECTED_FILES[which]
    for n in range(len(expected)):
        with monkeypatch.context() as m:
            names = _fail_at(m, n, how)
            with pytest.raises(KeyboardInterrupt if how == "interrupt" else OSError):
                other.save_pretrained(path)
        assert names == expected  # config.json renamed last
        if which == "new":
            assert not (tmp_path / "new").exists(), n
        else:
            assert _snapshot(path) == before, n
            _assert_bit_exact(InklingMTP.from_pretrained(path), loaded_before)
    other.save_pretrained(path)  # and without a fault, the save goes through
    _assert_bit_exact(InklingMTP.from_pretrained(path), other)
    assert not [p.name for p in path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("n", [0, 1])
def test_safetensors_writer_failing_leaves_the_directory_as_it_was(saved, other, tmp_path, monkeypatch, n):
    """The same fault one level down: safetensors' own writer raises on the n-th file it writes (its error, which
    names no file, as an OSError that does)."""
    path = _copy(saved, tmp_path / "saved")
    before, real, calls = _snapshot(path), writer.save_file, []

    def save_file_failing(*args, **kwargs):
        calls.append(args)
        if len(calls) == n + 1:
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "save_file", save_file_failing)
    with pytest.raises(OSError, match=rf"could not write {[C.MTP_FILE, C.SHARED_FILE][n]} into .*saved: .*StorageFull"):
        other.save_pretrained(path)
    assert _snapshot(path) == before


def test_first_rename_failing_leaves_the_directory_as_it_was(saved, other, tmp_path, monkeypatch):
    path = _copy(saved, tmp_path / "saved")
    before = _snapshot(path)

    def replace_failing(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(os, "replace", replace_failing)
    with pytest.raises(PermissionError):
        other.save_pretrained(path)
    assert _snapshot(path) == before


# ------------------------------------------------------------------------------------------------ over a checkpoint


@pytest.mark.parametrize("same_checkpoint", [True, False])
def test_save_over_a_sharded_checkpoint_keeps_the_target(sharded, model, other_depths, same_checkpoint, tmp_path):
    """Saved back over its source, or with other depths: the index names the files just written for the keys they
    hold, and the shared tensors stay in the target's shards (a model.safetensors beside the index would be what
    transformers loads in place of every shard): both loaders read what was saved, transformers the whole target."""
    path = _copy(sharded, tmp_path / "sharded")
    index_before = json.loads((path / C.INDEX_FILE).read_text())["weight_map"]
    target_before = S.load_hf_target(path).state_dict()
    saving = model if same_checkpoint else other_depths
    saving.save_pretrained(path)
    _assert_bit_exact(InklingMTP.from_pretrained(path), saving)
    assert not (path / C.SHARED_FILE).exists()
    weight_map = json.loads((path / C.INDEX_FILE).read_text())["weight_map"]
    assert set(weight_map) == set(index_before)
    assert {k for k, v in weight_map.items() if v == C.MTP_FILE} == set(load_file(path / C.MTP_FILE))
    assert {k: v for k, v in weight_map.items() if v != C.MTP_FILE} == {
        k: v for k, v in index_before.items() if v != C.MTP_FILE}  # the target's tensors found where they were
    target = S.load_hf_target(path).state_dict()
    assert set(target) == set(target_before)
    assert all(torch.equal(target[k], t) for k, t in target_before.items() if ".mtp." not in k)


def test_save_over_a_sharded_checkpoint_with_other_shared_tensors_is_refused(sharded, other, tmp_path):
    """The shared tensors are the target's: a model whose embedding or head differs from the stored ones would
    have to rewrite the target's shards."""
    _assert_save_refused(other, _copy(sharded, tmp_path / "sharded"), CheckpointError,
                         r"the target's shards \(by model\.safetensors\.index\.json\) do not hold this model's "
                         r"\['model\.llm\.embed\.weight', .* pass include_shared=False to write only the MTP")


def test_save_over_another_models_config_is_refused(sharded, model, ckpt_root, tmp_path):
    """Its config.json is the target's too: replaced by this model's, it would describe the target's shards with
    another model's sizes."""
    deeper = _copy(S.cached_checkpoint("tiny", root=ckpt_root, num_hidden_layers=3), tmp_path / "deeper")
    with pytest.raises(CheckpointError, match=r"its config\.json describes another model \(\['text_config\.layer_types'"
                       r", .*'text_config\.num_hidden_layers'\] differ from this model's\): save to a new directory"):
        model.save_pretrained(deeper, include_shared=False)


def test_save_over_a_sharded_checkpoint_drops_index_entries_of_mtp_keys_it_does_not_hold(model, sharded, tmp_path):
    path = _copy(sharded, tmp_path / "sharded")
    index = json.loads((path / C.INDEX_FILE).read_text())
    shard = next(v for v in index["weight_map"].values() if v not in (C.MTP_FILE, C.SHARED_FILE))  # not rewritten
    index["weight_map"]["model.mtp.layers.0.stale.weight"] = shard  # an MTP entry no file holds
    (path / C.INDEX_FILE).write_text(json.dumps(index))
    model.save_pretrained(path)
    weight_map = json.loads((path / C.INDEX_FILE).read_text())["weight_map"]
    assert "model.mtp.layers.0.stale.weight" not in weight_map
    _assert_bit_exact(InklingMTP.from_pretrained(path), model)


def test_save_without_shared_over_a_sharded_checkpoint(sharded, other, tmp_path):
    path = _copy(sharded, tmp_path / "sharded")
    index_before = json.loads((path / C.INDEX_FILE).read_text())["weight_map"]
    original = InklingMTP.from_pretrained(path)
    other.save_pretrained(path, include_shared=False)
    assert not (path / C.SHARED_FILE).exists()
    weight_map = json.loads((path / C.INDEX_FILE).read_text())["weight_map"]
    assert {k: weight_map[k] for k in SHARED} == {k: index_before[k] for k in SHARED}  # still the target's shards
    back = InklingMTP.from_pretrained(path)
    for name, p in back.named_parameters():
        assert torch.equal(p, (original if name in C.SHARED_KEYS else other).get_parameter(name)), name


def test_save_over_a_whole_target_in_model_safetensors_is_refused(flat, other, tmp_path):
    """``model.safetensors`` of an unsharded target holds the whole trunk: writing the three shared tensors over it
    would destroy the target. Refused before anything is written; the MTP alone may still be saved there."""
    path = _copy(flat, tmp_path / "flat")
    trunk = len(load_file(path / C.SHARED_FILE))
    _assert_save_refused(other, path, CheckpointError, rf"refusing to save here: replacing model\.safetensors would "
                         rf"destroy {trunk - 3} tensor\(s\) this save does not own .* pass include_shared=False to "
                         r"write only the MTP")
    original = InklingMTP.from_pretrained(path)
    other.save_pretrained(path, include_shared=False)
    assert len(load_file(path / C.SHARED_FILE)) == trunk
    back = InklingMTP.from_pretrained(path)
    for name, p in back.named_parameters():
        assert torch.equal(p, (original if name in C.SHARED_KEYS else other).get_parameter(name)), name


def test_save_that_would_leave_two_copies_without_index_is_refused(flat, other, tmp_path):
    path = _copy(flat, tmp_path / "flat")
    (path / C.SHARED_FILE).rename(path / "target.safetensors")
    _assert_save_refused(other, path, CheckpointError, r"target\.safetensors also holds 3 of the tensors saved .* "
                         r"there is no model\.safetensors\.index\.json to choose between the copies")


def test_save_over_a_corrupt_index_is_refused_before_writing(saved, other, tmp_path):
    path = _copy(saved, tmp_path / "saved")
    (path / C.INDEX_FILE).write_text('{"weight_map": ')
    _assert_save_refused(other, path, CheckpointError, r"model\.safetensors\.index\.json: invalid JSON")


def test_save_into_the_directory_it_was_loaded_from(saved, tmp_path):
    path = _copy(saved, tmp_path / "saved")
    mtp = InklingMTP.from_pretrained(path)
    with torch.no_grad():
        mtp.layers[0].input_proj.weight.mul_(2)
    mtp.save_pretrained(path)
    _assert_bit_exact(InklingMTP.from_pretrained(path), mtp)


def test_save_over_a_symlinked_snapshot_leaves_the_blobs_alone(saved, tmp_path):
    """A Hugging Face cache snapshot holds symlinks into shared blobs: writing through them would corrupt every
    snapshot (and the hash) of those blobs. The new files replace the links."""
    one = InklingMTP.from_pretrained(saved, dtype=torch.bfloat16)  # another config.json too (its dtype)
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    for file in saved.iterdir():
        shutil.copy(file, blobs / file.name)
        (snapshot / file.name).symlink_to(blobs / file.name)
    before = _snapshot(blobs)
    one.save_pretrained(snapshot)
    assert _snapshot(blobs) == before
    assert not any((snapshot / name).is_symlink() for name in (C.MTP_FILE, C.SHARED_FILE, "config.json"))
    _assert_bit_exact(InklingMTP.from_pretrained(snapshot), one)


def test_save_where_a_file_name_is_a_directory(saved, other, tmp_path):
    path = _copy(saved, tmp_path / "saved")
    (path / C.SHARED_FILE).unlink()
    (path / C.SHARED_FILE).mkdir()
    _assert_save_refused(other, path, IsADirectoryError, r"\['model\.safetensors'\] must be replaced by files, "
                         r"but are not files")


def test_save_onto_an_existing_file(saved, other, tmp_path):
    file = tmp_path / "model.bin"
    file.write_bytes(b"keep me")
    with pytest.raises(NotADirectoryError, match=r"model\.bin is a file: save_pretrained writes a checkpoint "
                                                 r"directory"):
        other.save_pretrained(file)
    assert file.read_bytes() == b"keep me"


# ------------------------------------------------------------------------------------------------ what is saved


def test_config_edited_after_loading_cannot_be_saved(sharded, tmp_path):
    """config.json is written from the file the model was loaded with: a config changed since would be saved as the
    old one, and the reload would silently be another model."""
    mtp = InklingMTP.from_pretrained(sharded)
    mtp.config = dataclasses.replace(mtp.config, mup=12.0)
    _assert_cannot_save(mtp, tmp_path, r"cannot save: the config\.json the model was loaded with no longer "
                        r"describes it \(fields \['mup'\] differ\)")


def test_config_without_a_config_json_cannot_be_saved(sharded, tmp_path):
    mtp = InklingMTP.from_pretrained(sharded)
    mtp.config = dataclasses.replace(mtp.config, raw={})
    _assert_cannot_save(mtp, tmp_path, r"cannot save: the model's config was not read from a usable "
                        r"config\.json \(its config\.json: model_type None is not an Inkling")


def test_tied_embedding_and_head_round_trip(sharded, tmp_path):
    """A head tied to the embedding is one Parameter under two names: both are written (safetensors refuses tensors
    sharing memory, and named_parameters() would list it once)."""
    mtp = InklingMTP.from_pretrained(sharded)
    mtp.lm_head_weight = mtp.embed_weight
    mtp.save_pretrained(tmp_path / "tied")
    back = InklingMTP.from_pretrained(tmp_path / "tied")
    assert torch.equal(back.lm_head_weight, mtp.embed_weight) and torch.equal(back.embed_weight, mtp.embed_weight)


def test_non_contiguous_and_misaligned_tensors_round_trip(sharded, tmp_path):
    mtp = InklingMTP.from_pretrained(sharded)
    w = mtp.layers[0].input_proj.weight
    w.data = w.data.t().contiguous().t()  # same values, transposed strides
    n = mtp.embed_norm_weight
    n.data = torch.cat([torch.zeros(1), n.data])[1:]  # same values, 4 bytes past an aligned address
    assert not w.is_contiguous() and n.data_ptr() % C.ALIGNMENT
    mtp.save_pretrained(tmp_path / "out")
    _assert_bit_exact(InklingMTP.from_pretrained(tmp_path / "out"), mtp)


def test_save_does_not_touch_the_target(sharded, tmp_path):
    target = S.load_hf_target(sharded)
    mtp = InklingMTP.from_pretrained(sharded, target=target)
    before = {n: (p.detach().clone(), p.data_ptr(), p.requires_grad, p.dtype) for n, p in target.named_parameters()}
    mtp.save_pretrained(tmp_path / "out")
    after = {n: (p.detach(), p.data_ptr(), p.requires_grad, p.dtype) for n, p in target.named_parameters()}
    assert before.keys() == after.keys()
    for name, (value, ptr, grad, dtype) in before.items():
        assert torch.equal(after[name][0], value) and after[name][1:] == (ptr, grad, dtype), name
    _assert_bit_exact(InklingMTP.from_pretrained(tmp_path / "out"), mtp)


def test_meta_model_cannot_be_saved(sharded, tmp_path):
    mtp = InklingMTP.from_pretrained(sharded, device="meta")
    _assert_cannot_save(mtp, tmp_path, r"cannot save: tensors on the meta device hold no values: "
                        r"\['embed_norm_weight', 'embed_weight'")


def test_mixed_dtypes_cannot_be_saved(sharded, tmp_path):
    mtp = InklingMTP.from_pretrained(sharded)
    mtp.layers[1].to(torch.bfloat16)
    _assert_cannot_save(mtp, tmp_path, r"cannot save: the tensors must share one dtype of .*, got "
                        r"\['torch\.bfloat16', 'torch\.float32'\]")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_cannot_be_saved(sharded, tmp_path, value):
    mtp = InklingMTP.from_pretrained(sharded)
    with torch.no_grad():
        mtp.layers[1].transformer_block.mlp.w13_dn.weight[5, 7] = value
    _assert_cannot_save(mtp, tmp_path, r"cannot save: tensors hold NaN or inf values \(the checkpoint would "
                        r"not load\): \['layers\.1\.transformer_block\.mlp\.w13_dn\.weight'\]")


@pytest.mark.parametrize("include_shared", ["no", 0, None])
def test_include_shared_must_be_a_bool(other, tmp_path, include_shared):
    _assert_cannot_save(other, tmp_path, rf"^include_shared must be a bool, got {include_shared!r}$", TypeError,
                        include_shared=include_shared)


@pytest.mark.parametrize("path", [123, None])
def test_save_path_type(other, path):
    with pytest.raises(TypeError, match=r"^checkpoint path must be a str or os\.PathLike, got "):
        other.save_pretrained(path)

