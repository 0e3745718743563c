"""Synthetic Inkling checkpoints in the real raw on-disk layout (docs/model.md §3), generated locally and seeded.

One directory serves both sides: transformers loads it (``InklingForConditionalGeneration.from_pretrained`` maps the
raw ``model.llm.*`` / ``model.visual.*`` / ``model.audio.*`` names through its ``inkling_mm_model`` conversion rules,
``MtpModel.from_pretrained`` picks ``model.mtp.*`` out of ``mtp.safetensors`` through the index), and so does our own
loader. Raw names are the inverse of those conversion rules; every tensor, norm gains and scalars included, is random
so that a swapped or mis-mapped tensor shows up as a numeric difference.

Presets: ``tiny`` (tests), ``tiny8`` (tiny with Inkling's 8 MTP depths), ``small`` (CPU benchmark), ``full`` (real
text dims, 2 trunk layers; big machine only).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..arguments import integer
from ..atomic_files import build_directory_atomically
from ..checkpoint.layout import INDEX_FILE, MTP_FILE, MTP_PREFIX, SHARED_FILE, SHARED_RAW_KEYS
from ..config import CONFIG_FILE, ConfigError
from ..model.torchao_schemes import quiet_import

FORMAT_VERSION = 1  # bump when the written bytes change for the same (config, seed, dtype)
_MAX_SHARD_BYTES = 4 << 30
# Stored in float32 whatever the checkpoint dtype, as in the real checkpoint (router bias / scale).
_FP32_SUFFIXES = ("mlp.gate.bias", "mlp.gate.global_scale")

# Tiny multimodal towers for every preset: the MTP never reads them, they only have to load.
_VISION = {"patch_size": 2, "temporal_patch_size": 2, "num_channels": 3, "num_hidden_layers": 3, "hidden_size": 32,
           "num_attention_heads": 2}
_AUDIO = {"n_mel_bins": 4, "mel_vocab_size": 8}
_TOKENS = {"image_token_id": 4, "audio_token_id": 7, "image_bos_token_id": 5, "audio_bos_token_id": 6}
INKLING_SLIDING_DEPTHS = (0, 2, 4, 5, 6, 7)  # the real checkpoint's sliding MTP depths (1 and 3 are full attention)
# Text fields every preset shares (real Inkling values); each preset adds its dims.
_TEXT_COMMON = {"d_rel": 16, "n_shared_experts": 1, "route_scale": 8.0, "sconv_kernel_size": 4, "hidden_act": "silu",
                "logits_mup_width_multiplier": 24.0, "rms_norm_eps": 1e-6, "bos_token_id": 1}


# --------------------------------------------------------------------------------------------------------- presets

def _config(text: dict, *, num_mtp_layers: int, local_layer_ids, num_hidden_layers: int | None, moe: bool,
            unpadded_vocab_size: int | None, text_overrides: dict) -> dict:
    """Assemble an ``inkling_mm_model`` config.json dict (checkpoint field names, e.g. ``dense_intermediate_size``)."""
    local = sorted(set(int(i) for i in (local_layer_ids or ())))
    if any(not 0 <= i < num_mtp_layers for i in local):
        raise ValueError(f"local_layer_ids {local} out of range for {num_mtp_layers} MTP depths")
    # transformers' MtpModel maps checkpoint layer N to MTP layer N - num_hidden_layers: fewer trunk layers than
    # depths would make depths collide, so the default trunk is never shallower than the MTP.
    n = num_hidden_layers if num_hidden_layers is not None else max(2, num_mtp_layers)
    text = dict(text)
    text.update(
        num_hidden_layers=n,
        layer_types=["hybrid_sliding" if i % 2 == 0 else "hybrid" for i in range(n)],
        local_layer_ids=[i for i in range(n) if i % 2 == 0],
        mlp_layer_types=["dense" if (i == 0 or not moe) else "sparse" for i in range(n)],
        unpadded_vocab_size=unpadded_vocab_size,
    )
    text.update(text_overrides)
    return {
        "model_type": "inkling_mm_model",
        "architectures": ["InklingForConditionalGeneration"],
        "text_config": {"model_type": "inkling_text", **text},
        "vision_config": {"model_type": "inkling_vision", **_VISION},
        "audio_config": {"model_type": "inkling_audio", **_AUDIO},
        "mtp_config": {"num_nextn_predict_layers": num_mtp_layers, "chain_hidden_post_norm": False,
                       "local_layer_ids": local},
        **_TOKENS,
    }


def tiny_config(*, num_mtp_layers: int = 2, local_layer_ids=(0,), num_hidden_layers: int | None = None,
                moe: bool = True, use_unpadded: bool = True, **text_overrides) -> dict:
    """H 64, 2x32 heads, V 512 (500 unpadded), W 8, E 16; trunk = max(2, depths) layers, layer 0 dense, rest MoE."""
    text = {
        **_TEXT_COMMON, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32,
        "swa_num_attention_heads": 2, "swa_num_key_value_heads": 2, "swa_head_dim": 32, "dense_intermediate_size": 128,
        "intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "vocab_size": 512,
        "sliding_window_size": 8, "rel_extent": 16, "log_scaling_n_floor": None, "model_max_length": 4096,
        "eos_token_id": 2,
    }
    return _config(text, num_mtp_layers=num_mtp_layers, local_layer_ids=local_layer_ids,
                   num_hidden_layers=num_hidden_layers, moe=moe, unpadded_vocab_size=500 if use_unpadded else None,
                   text_overrides=text_overrides)


def tiny8_config(**overrides) -> dict:
    """``tiny`` with Inkling's eight MTP depths in its sliding / full pattern (depths 0, 2, 4, 5, 6, 7 sliding; 1 and 3
    full) and so an 8-layer trunk: the K = 1..8 drafting tests and benchmark."""
    return tiny_config(**{"num_mtp_layers": 8, "local_layer_ids": INKLING_SLIDING_DEPTHS, **overrides})


def small_config(*, num_mtp_layers: int = 1, local_layer_ids=(0,), num_hidden_layers: int | None = None,
                 moe: bool = False, use_unpadded: bool = False, **text_overrides) -> dict:
    """H 1024, 16x64 heads (kv 4 full / 8 swa), dense MLP 2816, V 32000, W 128, E 256; 2 dense trunk layers."""
    text = {
        **_TEXT_COMMON, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
        "swa_num_attention_heads": 16, "swa_num_key_value_heads": 8, "swa_head_dim": 64,
        "dense_intermediate_size": 2816, "intermediate_size": 256, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "vocab_size": 32000, "sliding_window_size": 128, "rel_extent": 256, "log_scaling_n_floor": None,
        "model_max_length": 32768, "eos_token_id": 2,
    }
    return _config(text, num_mtp_layers=num_mtp_layers, local_layer_ids=local_layer_ids,
                   num_hidden_layers=num_hidden_layers, moe=moe,
                   unpadded_vocab_size=31872 if use_unpadded else None, text_overrides=text_overrides)


def full_config(*, num_mtp_layers: int = 8, local_layer_ids=INKLING_SLIDING_DEPTHS, num_hidden_layers: int = 2,
                moe: bool = False, use_unpadded: bool = True, **text_overrides) -> dict:
    """Real Inkling text dims (docs/model.md §2.2) with a 2-layer trunk so it can be generated at all.

    Our loader reads it fine; transformers' ``MtpModel.from_pretrained`` needs ``num_hidden_layers >= 8`` (its layer
    renumbering), so pass ``num_hidden_layers=8`` when transformers must load the MTP too.
    """
    text = {
        **_TEXT_COMMON, "hidden_size": 6144, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "swa_num_attention_heads": 64, "swa_num_key_value_heads": 16, "swa_head_dim": 128,
        "dense_intermediate_size": 24576, "intermediate_size": 3072, "n_routed_experts": 2, "num_experts_per_tok": 1,
        "vocab_size": 201024, "sliding_window_size": 512, "rel_extent": 1024, "log_scaling_n_floor": 128000,
        "log_scaling_alpha": 0.1, "model_max_length": 1048576, "eos_token_id": 200006,
    }
    return _config(text, num_mtp_layers=num_mtp_layers, local_layer_ids=local_layer_ids,
                   num_hidden_layers=num_hidden_layers, moe=moe,
                   unpadded_vocab_size=200058 if use_unpadded else None, text_overrides=text_overrides)


PRESETS = {"tiny": tiny_config, "tiny8": tiny8_config, "small": small_config, "full": full_config}


def preset_config(name: str, **overrides) -> dict:
    """``PRESETS[name](**overrides)`` with a readable error for unknown names."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name](**overrides)


# ------------------------------------------------------------------------------------ raw names (inverse mapping)

# Decoder-layer sub-names, transformers-native -> raw, shared by trunk layers and MTP blocks. Inverts the
# `inkling_mm_model` rules of transformers' conversion_mapping.py.
_LAYER_RENAMES = {
    "self_attn.q_proj.weight": "attn.wq_du.weight",
    "self_attn.k_proj.weight": "attn.wk_dv.weight",
    "self_attn.v_proj.weight": "attn.wv_dv.weight",
    "self_attn.r_proj.weight": "attn.wr_du.weight",
    "self_attn.o_proj.weight": "attn.wo_ud.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "self_attn.k_sconv.conv1d.weight": "attn.k_sconv.weight",
    "self_attn.v_sconv.conv1d.weight": "attn.v_sconv.weight",
    "self_attn.rel_logits_proj.proj": "attn.rel_logits_proj.proj",
    "attn_sconv.conv1d.weight": "attn_sconv.weight",
    "mlp_sconv.conv1d.weight": "mlp_sconv.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    # dense MLP
    "mlp.down_proj.weight": "mlp.w2_md.weight",
    "mlp.global_scale": "mlp.global_scale",
    # MoE
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.gate.global_scale": "mlp.gate.global_scale",
    "mlp.gate.e_score_correction_bias": "mlp.gate.bias",
    "mlp.experts.gate_up_proj": "mlp.experts.w13_weight",  # [E, 2I, H], gate|up halves -> interleaved on dim 1
    "mlp.experts.down_proj": "mlp.experts.w2_weight",
    "mlp.shared_experts.down_proj": "mlp.shared_experts.shared_w2_weight",
}
# Separate gate / up tensors fused into one raw row-interleaved tensor: native prefix -> (raw name, dim).
_FUSED = {
    "mlp.gate_proj.weight": ("mlp.w13_dn.weight", 0),
    "mlp.up_proj.weight": ("mlp.w13_dn.weight", 0),
    "mlp.shared_experts.gate_proj": ("mlp.shared_experts.shared_w13_weight", 1),
    "mlp.shared_experts.up_proj": ("mlp.shared_experts.shared_w13_weight", 1),
}
_TOP_RENAMES = {
    "model.language_model.embed_tokens.weight": "model.llm.embed.weight",
    "model.language_model.embed_tokens.embed_norm.weight": "model.llm.embed_norm.weight",
    "model.language_model.norm.weight": "model.llm.norm.weight",
    "lm_head.weight": "model.llm.unembed.weight",
    "model.audio_tower.embed_audio_tokens.embed_audio_tokens.weight": "model.audio.encoder.weight",
    "model.audio_tower.norm.weight": "model.audio.final_norm.weight",
    "model.vision_tower.final_norm.weight": "model.visual.final_norm.weight",
}


def _raw_layer_entry(sub: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """Raw sub-name and raw shape of one decoder-layer tensor (fused gate/up halves double along their dim)."""
    if sub in _FUSED:
        raw, dim = _FUSED[sub]
        shape = list(shape)
        shape[dim] *= 2
        return raw, tuple(shape)
    if sub in _LAYER_RENAMES:
        return _LAYER_RENAMES[sub], shape
    raise KeyError(f"no raw Inkling name known for decoder-layer tensor {sub!r}")


def _raw_main_entry(name: str, shape) -> tuple[str, tuple[int, ...]]:
    if name in _TOP_RENAMES:
        return _TOP_RENAMES[name], tuple(shape)
    if m := re.fullmatch(r"model\.language_model\.layers\.(\d+)\.(.+)", name):
        raw, shape = _raw_layer_entry(m.group(2), tuple(shape))
        return f"model.llm.layers.{m.group(1)}.{raw}", shape
    if m := re.fullmatch(r"model\.vision_tower\.encoder_layers\.(\d+)\.projection\.weight", name):
        return f"model.visual.layers.linear_{m.group(1)}.weight", tuple(shape)
    if m := re.fullmatch(r"model\.vision_tower\.encoder_layers\.(\d+)\.layer_norm\.weight", name):
        return f"model.visual.layers.norm_{m.group(1)}.weight", tuple(shape)
    raise KeyError(f"no raw Inkling name known for {name!r}")


def _raw_mtp_entry(name: str, shape) -> tuple[str, tuple[int, ...]] | None:
    if name.startswith(("embed_tokens.", "shared_head.")):  # shared with the target, not stored under model.mtp
        return None
    if name == "shared_post_norm.weight":
        return f"{MTP_PREFIX}chain_norm.weight", tuple(shape)
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None:
        raise KeyError(f"no raw Inkling name known for MTP tensor {name!r}")
    k, sub = m.groups()
    top = {"hnorm.weight": "hidden_norm.weight", "enorm.weight": "embed_norm.weight",
           "eh_proj.weight": "input_proj.weight"}
    if sub in top:
        return f"{MTP_PREFIX}layers.{k}.{top[sub]}", tuple(shape)
    if sub.startswith("mtp_block."):
        raw, shape = _raw_layer_entry(sub[len("mtp_block."):], tuple(shape))
        return f"{MTP_PREFIX}layers.{k}.transformer_block.{raw}", shape
    raise KeyError(f"no raw Inkling name known for MTP tensor {name!r}")


def raw_tensor_shapes(config: dict) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(main, mtp) raw name -> shape, read off transformers' modules built on the meta device (no memory)."""
    with quiet_import():
        from transformers import InklingConfig, InklingForConditionalGeneration
        from transformers.modeling_layers import MtpModel
        from transformers.utils.generic import ContextManagers

    hf_config = InklingConfig.from_dict(copy.deepcopy(config))
    contexts = InklingForConditionalGeneration.get_init_context(torch.float32, False, False, None)
    with ContextManagers(contexts):
        target = InklingForConditionalGeneration(hf_config)
        mtp = MtpModel(target, hf_config.text_config.num_mtp_layers) if hf_config.text_config.num_mtp_layers else None

    def collect(state, entry) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for name, tensor in state.items():
            got = entry(name, tuple(tensor.shape))
            if got is None:
                continue
            raw, shape = got
            if raw in out and out[raw] != shape:
                raise AssertionError(f"{raw}: fused halves disagree ({out[raw]} vs {shape})")
            out[raw] = shape
        return out

    main = collect(target.state_dict(), _raw_main_entry)
    mtp_shapes = collect(mtp.state_dict(), _raw_mtp_entry) if mtp is not None else {}
    return main, mtp_shapes


# ----------------------------------------------------------------------------------------------------- values

_EMBEDDINGS = ("model.llm.embed.weight", "model.audio.encoder.weight", "embed_weight", "embed_tokens.weight")
_LM_HEADS = ("model.llm.unembed.weight", "lm_head_weight", "lm_head.weight")
_GATE_BIASES = ("mlp.gate.bias", "e_score_correction_bias")
_ROUTED_DOWN = ("experts.w2_weight", "shared_w2_weight", "experts.down_proj", "shared_experts.down_proj.weight")


def init_stats(name: str, shape: tuple[int, ...], *, mup: float = 24.0,
               route_scale: float = 1.0) -> tuple[float, float]:
    """(mean, std) of a tensor named as on disk (raw), in ``InklingMTP`` or in transformers: unit-gain-ish norms and
    scalars, fan-in scaled matrices, a sharp LM head. The one rule set for every random weight the tests and the
    benchmark use."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if "norm" in leaf:  # every RMSNorm gain (q/k, layer, embed, hidden/embed MTP norms, tower norms)
        return 1.0, 0.1
    if name.endswith("global_scale"):
        return 1.0, 0.1
    if name.endswith(_GATE_BIASES):
        return 0.0, 0.02
    if name.endswith("rel_logits_proj.proj"):
        return 0.0, 1.0 / math.sqrt(shape[0])
    if "sconv" in name:
        return 0.0, 0.2
    if name.endswith(_EMBEDDINGS):
        return 0.0, 1.0
    if name.endswith(_LM_HEADS):
        # logits = unembed @ (normed hidden / mup): std ~2.5 so greedy choices are not near-ties
        return 0.0, 2.5 * mup / math.sqrt(shape[-1])
    if len(shape) in (2, 3):
        std = 1.0 / math.sqrt(shape[-1])
        if name.endswith(_ROUTED_DOWN):
            std /= route_scale  # routed weights are multiplied by route_scale
        return 0.0, std
    raise KeyError(f"no init rule for {name} {shape}")


def randomize_(module: torch.nn.Module, seed: int = 0, *, mup: float = 24.0, route_scale: float = 1.0):
    """Seeded random weights for every parameter of ``module`` at :func:`init_stats`' scales, in place, drawn on the
    module's device (no host copy: the ``full`` preset's tables alone are gigabytes). Returns ``module``."""
    params = list(module.named_parameters())
    gen = torch.Generator(device=params[0][1].device if params else "cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in params:
            mean, std = init_stats(name, tuple(p.shape), mup=mup, route_scale=route_scale)
            p.normal_(mean, std, generator=gen)
    return module


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, text: dict, dtype: torch.dtype) -> torch.Tensor:
    """Seeded per name, so values do not depend on shard layout or generation order."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    mean, std = init_stats(name, shape, mup=float(text.get("logits_mup_width_multiplier", 24.0)),
                           route_scale=float(text.get("route_scale", 1.0)))
    t = torch.randn(shape, generator=gen, dtype=torch.float32).mul_(std).add_(mean)
    store = torch.float32 if name.endswith(_FP32_SUFFIXES) else dtype
    return t.to(store).contiguous()


# ----------------------------------------------------------------------------------------------------- writing

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _split_shards(sizes: dict[str, int]) -> list[list[str]]:
    """Contiguous groups of about equal bytes; at least two (a checkpoint with an index is multi-file)."""
    names = list(sizes)
    total = sum(sizes.values())
    n = min(len(names), max(2, math.ceil(total / _MAX_SHARD_BYTES)))
    groups: list[list[str]] = [[] for _ in range(n)]
    acc = 0
    for name in names:
        groups[min(n - 1, int((acc + sizes[name] / 2) * n // max(total, 1)))].append(name)
        acc += sizes[name]
    groups = [g for g in groups if g]
    if len(groups) < 2:  # one tensor dominates: give the last one a file of its own
        groups = [groups[0][:-1], groups[0][-1:]]
    return groups


def write_checkpoint(path, config: dict, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                     sharded: bool = True, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``config`` as a raw-layout Inkling checkpoint with seeded random weights; returns ``path``.

    Sharded: ``model-0000k-of-0000n.safetensors`` (n >= 2) + ``mtp.safetensors`` + an index over all keys (what
    transformers needs). Unsharded: ``model.safetensors`` + ``mtp.safetensors``, no index (our loader only).
    ``tensors`` (raw name -> tensor, e.g. :func:`raw_text_tensors` of a trained model) are written instead of the
    random values of those names; each must be a raw name of this config with its raw shape (checked before any
    file is written).
    """
    path = Path(path)
    config = copy.deepcopy(config)
    config["dtype"] = _dtype_name(dtype)
    config["text_config"]["dtype"] = _dtype_name(dtype)
    text = config["text_config"]
    main_shapes, mtp_shapes = raw_tensor_shapes(config)
    all_shapes = {**main_shapes, **mtp_shapes}
    given = dict(tensors or {})
    unknown = sorted(set(given) - set(all_shapes))
    if unknown:
        raise KeyError(f"tensors not in this config's raw layout: {unknown[:5]}")
    wrong = {n: (tuple(t.shape), all_shapes[n]) for n, t in given.items() if tuple(t.shape) != all_shapes[n]}
    if wrong:
        raise ValueError(f"tensors with the wrong shape (given, raw): {dict(list(wrong.items())[:5])}")
    path.mkdir(parents=True, exist_ok=True)

    def nbytes(name, shape):
        return math.prod(shape) * (4 if name.endswith(_FP32_SUFFIXES) else dtype.itemsize)

    def value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in given:
            return _random_tensor(name, shape, seed, text, dtype)
        store = torch.float32 if name.endswith(_FP32_SUFFIXES) else dtype
        return given[name].detach().to("cpu", store).contiguous()

    def write(file: str, names: list[str], shapes: dict) -> None:
        save_file({n: value(n, shapes[n]) for n in names}, str(path / file), metadata={"format": "pt"})

    weight_map: dict[str, str] = {}
    if sharded:
        shards = _split_shards({n: nbytes(n, s) for n, s in main_shapes.items()})
        for k, names in enumerate(shards):
            file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            write(file, names, main_shapes)
            weight_map.update(dict.fromkeys(names, file))
    else:
        write(SHARED_FILE, list(main_shapes), main_shapes)
    if mtp_shapes:
        write(MTP_FILE, list(mtp_shapes), mtp_shapes)
        weight_map.update(dict.fromkeys(mtp_shapes, MTP_FILE))
    if sharded:
        total = sum(nbytes(n, s) for n, s in all_shapes.items())
        index = {"metadata": {"total_size": total, "total_parameters": sum(math.prod(s) for s in all_shapes.values())},
                 "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return path


def raw_text_tensors(causal_lm) -> dict[str, torch.Tensor]:
    """Raw ``model.llm.*`` tensors of a transformers ``InklingForCausalLM`` (the inverse of transformers' loading
    conversions: native names renamed, separate gate / up tensors interleaved back into one), detached, for
    :func:`write_checkpoint`'s ``tensors``."""
    out: dict[str, torch.Tensor] = {}
    halves: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in causal_lm.state_dict().items():
        native = name if name == "lm_head.weight" else "model.language_model." + name.removeprefix("model.")
        raw, _ = _raw_main_entry(native, tuple(tensor.shape))
        sub = native.split(".", 4)[-1]
        if sub in _FUSED:
            halves.setdefault(raw, (_FUSED[sub][1], {}))[1]["gate" if "gate_proj" in sub else "up"] = tensor.detach()
        else:
            out[raw] = tensor.detach()
    for raw, (dim, parts) in halves.items():  # raw rows alternate gate, up (transformers de-interleaves them)
        out[raw] = torch.stack([parts["gate"], parts["up"]], dim=dim + 1).flatten(dim, dim + 1)
    return out


def default_cache_root() -> Path:
    return Path(os.environ.get("INKLING_COMPILED_CACHE") or Path.home() / ".cache" / "inkling_compiled" /
                "checkpoints").expanduser()  # a quoted ~ in the variable


def cached_checkpoint(preset: str, *, root=None, seed: int = 0, dtype: torch.dtype = torch.float32,
                      **overrides) -> Path:
    """Directory of ``preset`` (with ``overrides``) written once per (config, seed, dtype, format) and then reused.

    Written into a temporary sibling and renamed into place, so a directory that exists is complete; concurrent
    writers race harmlessly (the loser's copy is discarded).
    """
    config = preset_config(preset, **overrides)
    key = json.dumps({"config": config, "seed": seed, "dtype": _dtype_name(dtype), "format": FORMAT_VERSION},
                     sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(root) if root is not None else default_cache_root()
    final = root / f"{preset}-{digest}"
    if (final / CONFIG_FILE).is_file():
        return final
    return build_directory_atomically(final, lambda tmp: write_checkpoint(tmp, config, seed=seed, dtype=dtype),
                                      complete=CONFIG_FILE)


# ----------------------------------------------------------------------------------------------------- loading

def load_hf_target(path, dtype: torch.dtype = torch.float32):
    """transformers' multimodal Inkling target from a raw-layout directory, eval mode.

    The library checks only the MTP's part of ``config.json``; what transformers refuses in the rest (the towers,
    the target's own layers, experts, ids) as it builds or loads the target is a ConfigError naming the file with
    transformers' message, not an AssertionError or RuntimeError from deep inside it."""
    with quiet_import():
        from huggingface_hub.errors import StrictDataclassError
        from transformers import InklingForConditionalGeneration

    try:
        _pad_id_in_vocabulary(InklingForConditionalGeneration.config_class.get_config_dict(str(path))[0])
        config = InklingForConditionalGeneration.config_class.from_pretrained(str(path))
        _sizes_transformers_trusts(config)
        return InklingForConditionalGeneration.from_pretrained(str(path), config=config, dtype=dtype).eval()
    except torch.OutOfMemoryError:  # a RuntimeError, but no fault of the file
        raise
    except (ValueError, TypeError, AssertionError, RuntimeError, KeyError, IndexError, StrictDataclassError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__  # the validator's cause is on a line of its own
        raise ConfigError(f"{Path(path) / CONFIG_FILE}: transformers cannot build the target from it: {reason}") from e


def _sizes_transformers_trusts(config) -> None:
    """ArgumentError for the sizes transformers takes unchecked and fails on late: a patch size of 0 loops forever
    in its prime factorisation, and a top-k above the experts fails only in the first forward."""
    vision, text = getattr(config, "vision_config", None), config.get_text_config()
    if vision is not None:
        for name in ("patch_size", "temporal_patch_size"):
            integer(f"vision_config.{name}", getattr(vision, name), minimum=1)
    integer("text_config.num_experts_per_tok", text.num_experts_per_tok, minimum=1, maximum=text.n_routed_experts)


def _pad_id_in_vocabulary(config: dict) -> None:
    """ArgumentError for a pad id outside the vocabulary, read before transformers builds the config: it warns of
    one on the terminal first, then fails building the embedding."""
    text = config.get("text_config")
    if not isinstance(text, dict):  # absent or malformed: transformers' own config checks name it
        return
    vocab = text.get("vocab_size")
    if text.get("pad_token_id") is not None and isinstance(vocab, int) and vocab > 0:
        integer("text_config.pad_token_id", text["pad_token_id"], minimum=0, maximum=vocab - 1)


def greedy_generation_config(target, max_new_tokens: int, *, eos_token_id=None):
    """A copy of ``target``'s generation config for greedy ``generate()`` of exactly ``max_new_tokens`` tokens, or
    fewer when ``eos_token_id`` is given and met: the reference that speculative generation is compared with."""
    config = copy.deepcopy(target.generation_config)
    config.do_sample = False
    config.max_new_tokens, config.max_length, config.min_new_tokens = max_new_tokens, None, None
    # generate() fills a None from the model's own generation config (its EOS ids), so "no EOS" is the empty list
    config.eos_token_id = [] if eos_token_id is None else eos_token_id
    if config.pad_token_id is None:  # finished rows are padded: with the EOS id when there is one
        config.pad_token_id = eos_token_id[0] if isinstance(eos_token_id, list) else (eos_token_id or 0)
    return config


def load_hf_mtp(target):
    """transformers' own MTP (``MtpModel``) for ``target``, read from the directory the target came from."""
    from transformers.modeling_layers import MtpModel

    return MtpModel.from_pretrained(target).eval()


def hf_causal_lm_from(target):
    """A text-only ``InklingForCausalLM`` sharing ``target``'s text weights (storage shared, parameters distinct).

    ``InklingForCausalLM.from_pretrained(raw_dir)`` does not understand raw ``model.llm.*`` names and would keep
    random weights with only a warning, so the text model is rebuilt from the loaded target instead.
    """
    with quiet_import():
        from transformers import InklingForCausalLM
        from transformers.utils.generic import ContextManagers

    text_config = copy.deepcopy(target.config.text_config)
    dtype = target.lm_head.weight.dtype
    with ContextManagers(InklingForCausalLM.get_init_context(dtype, False, False, None)):
        lm = InklingForCausalLM(text_config)
    state = {f"model.{k}": v.detach() for k, v in target.model.language_model.state_dict().items()}
    state["lm_head.weight"] = target.lm_head.weight.detach()
    result = lm.load_state_dict(state, strict=True, assign=True)
    if result.missing_keys or result.unexpected_keys:  # strict=True raises first; kept for clarity
        raise RuntimeError(f"text weights do not match: {result}")
    left = [n for n, t in (*lm.named_parameters(), *lm.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"InklingForCausalLM tensors not filled from the target: {left}")
    lm.generation_config = copy.deepcopy(target.generation_config)
    return lm.eval()


def _index_or_files(path: Path) -> dict[str, str]:
    """raw key -> file name, from the index when there is one, else by opening every safetensors file."""
    index = path / INDEX_FILE
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file.name))
    return out


def mtp_reference_tensors(path) -> dict[str, torch.Tensor]:
    """Raw ``model.mtp.*`` tensors plus the three shared target tensors, straight from the files."""
    path = Path(path)
    weight_map = _index_or_files(path)
    wanted: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        if key.startswith(MTP_PREFIX) or key in SHARED_RAW_KEYS:
            wanted.setdefault(file, []).append(key)
    out = {}
    for file, keys in wanted.items():
        with safe_open(str(path / file), framework="pt") as f:
            for key in keys:
                out[key] = f.get_tensor(key)
    missing = [k for k in SHARED_RAW_KEYS if k not in out]
    if missing:
        raise KeyError(f"{path}: shared tensors not found: {missing}")
    return out


__all__ = [
    "FORMAT_VERSION", "INKLING_SLIDING_DEPTHS", "PRESETS", "cached_checkpoint", "default_cache_root", "full_config",
    "greedy_generation_config", "hf_causal_lm_from", "init_stats", "load_hf_mtp", "load_hf_target",
    "mtp_reference_tensors", "preset_config", "randomize_", "raw_tensor_shapes", "raw_text_tensors", "small_config",
    "tiny8_config", "tiny_config", "write_checkpoint",
]
