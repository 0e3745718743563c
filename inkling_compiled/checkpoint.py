"""Raw Inkling checkpoint layout <-> ``InklingMTP`` state (spec §3).

The key map is the identity under ``model.mtp.`` (module names follow the checkpoint's), with one transform:
``mlp.w13_dn.weight`` rows are interleaved gate/up on disk and held as [gate; up] in memory. The three shared tensors
come from the target's shards (found through ``model.safetensors.index.json`` when present) or from a live
transformers target, never copied. Only the MTP tensors and those three are ever read.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .config import MTPConfig, read_config_json
from .model.mtp import InklingMTP

MTP_PREFIX = "model.mtp."
MTP_FILE = "mtp.safetensors"
SHARED_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
W13_SUFFIX = "transformer_block.mlp.w13_dn.weight"
# InklingMTP attribute -> raw key of the target tensor it shares
SHARED_KEYS = {
    "embed_weight": "model.llm.embed.weight",
    "embed_norm_weight": "model.llm.embed_norm.weight",
    "lm_head_weight": "model.llm.unembed.weight",
}
PROGRESS_MIN_BYTES = 1 << 30


class CheckpointError(ValueError):
    """The checkpoint does not match the config: missing, unexpected or mis-shaped tensors, or a config mismatch."""


def raw_key(name: str) -> str:
    """Raw checkpoint key of an ``InklingMTP`` parameter name."""
    return SHARED_KEYS.get(name, MTP_PREFIX + name)


def interleave_rows(w: torch.Tensor) -> torch.Tensor:
    """[gate; up] -> gate0, up0, gate1, up1, ... (the on-disk w13_dn layout, spec §3.4)."""
    gate, up = w.chunk(2, dim=0)
    return torch.stack([gate, up], dim=1).reshape(w.shape)


def deinterleave_rows(w: torch.Tensor) -> torch.Tensor:
    """On-disk interleaved gate/up rows -> [gate (rows 0::2); up (rows 1::2)]."""
    return torch.cat([w[0::2], w[1::2]], dim=0)


def locate_tensors(path: str | os.PathLike) -> dict[str, str]:
    """Raw key -> file for every tensor in the checkpoint, from the index if there is one, else the shard headers."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        if (path / MTP_FILE).is_file():  # the MTP shard's own header is authoritative for what it holds (an index
            # written for the target alone lists none of it; a stale one may list too much or too little)
            weight_map = {**{k: v for k, v in weight_map.items() if v != MTP_FILE}, **_keys_of(path / MTP_FILE)}
        return {k: str(path / v) for k, v in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    located: dict[str, str] = {}
    for file in files:
        located.update({k: str(file) for k in _keys_of(file)})
    return located


def _keys_of(file: Path) -> dict[str, str]:
    with safe_open(str(file), framework="pt") as f:
        return dict.fromkeys(f.keys(), file.name)


def load_mtp(path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
             target: nn.Module | None = None, num_depths: int | None = None, mtp_log_scaling: bool = False,
             progress: bool | None = None) -> InklingMTP:
    """Build an ``InklingMTP`` from a raw Inkling checkpoint directory.

    ``dtype`` defaults to the stored MTP dtype (or the target's), ``device`` to CPU (or the target's). ``target`` (a
    transformers ``InklingForCausalLM`` / ``InklingForConditionalGeneration``) lends its embedding table, embed_norm
    and LM head as the very same Parameters (one that sits misaligned in a memory-mapped file is moved, in place, to
    an aligned allocation of its own: the target keeps using it). ``num_depths`` loads only the first depths (vLLM loads
    min(depths, speculative tokens)). Every mismatch between config and files is reported at once.
    """
    hf_config, raw = read_config_json(path)
    config = MTPConfig.from_hf(hf_config, mtp_log_scaling=mtp_log_scaling, raw=raw)
    total_depths = config.num_depths
    if num_depths is not None:
        if not 1 <= num_depths <= total_depths:
            raise CheckpointError(f"num_depths={num_depths} but the checkpoint has {total_depths} MTP depth(s)")
        config = replace(config, depths=config.depths[:num_depths])
    shared = _target_shared(target, config) if target is not None else None
    if shared is not None:
        t_dtype, t_device = shared["lm_head_weight"].dtype, shared["lm_head_weight"].device
        if dtype is not None and dtype != t_dtype:
            raise CheckpointError(f"dtype={dtype} requested, but the target's shared tensors are {t_dtype} "
                                  "(sharing without copies needs the target's dtype)")
        if device is not None and not _same_device(torch.device(device), t_device):
            raise CheckpointError(f"device={device} requested, but the target lives on {t_device}")
        dtype, device = t_dtype, t_device
    device = torch.device(device if device is not None else "cpu")

    with torch.device("meta"):
        model = InklingMTP(config)
    located = locate_tensors(path)
    wanted = {raw_key(n): (n, p.shape) for n, p in model.named_parameters(remove_duplicate=False)
              if shared is None or n not in SHARED_KEYS}
    _validate_keys(located, wanted, config, total_depths)
    dtype = dtype or _stored_dtype(located, next(k for k in wanted if k.startswith(MTP_PREFIX)))

    state = _read_tensors(located, wanted, dtype, device, progress)
    if shared is not None:
        state.update(shared)
    model.load_state_dict(state, strict=True, assign=True)
    for name, p in model.named_parameters():
        if shared is None or name not in shared:  # the target's own Parameters keep their requires_grad
            p.requires_grad_(False)
    return model.eval()


def _same_device(requested: torch.device, actual: torch.device) -> bool:
    """``"cuda"`` (no index) matches any CUDA device; an explicit index must match."""
    return requested.type == actual.type and (requested.index is None or requested.index == actual.index)


def _validate_keys(located: dict[str, str], wanted: dict[str, tuple[str, torch.Size]], config: MTPConfig,
                   total_depths: int) -> None:
    problems = []
    chain_key = MTP_PREFIX + "chain_norm.weight"
    if chain_key in located and not config.chain_hidden_post_norm:
        problems.append(f"{chain_key} is present but chain_hidden_post_norm is false in the config "
                        "(set mtp_config.chain_hidden_post_norm=true to use it, or remove the tensor)")
    skipped = tuple(f"{MTP_PREFIX}layers.{i}." for i in range(config.num_depths, total_depths))
    # keys the index names in a file that is absent or does not hold them count as missing
    groups = _group_by_file(located, [k for k in wanted if k in located])
    absent_files = sorted(os.path.basename(f) for f in groups if not os.path.isfile(f))
    file_keys = {f: set(_keys_of(Path(f))) for f in groups if os.path.isfile(f)}
    present = {k for f, keys in file_keys.items() for k in groups[f] if k in keys}
    missing = sorted(k for k in wanted if k not in present)
    unexpected = sorted(k for k in located if k.startswith(MTP_PREFIX) and k not in wanted
                        and k != chain_key and not k.startswith(skipped))
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {missing}")
    if absent_files:
        problems.append(f"files named in {INDEX_FILE} do not exist: {absent_files}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s) under {MTP_PREFIX}: {unexpected}")
    mis_shaped = []
    for file, keys in _group_by_file(located, sorted(present)).items():
        with safe_open(file, framework="pt") as f:
            for k in keys:
                got = tuple(f.get_slice(k).get_shape())
                if got != tuple(wanted[k][1]):
                    mis_shaped.append(f"{k}: checkpoint {list(got)}, config expects {list(wanted[k][1])}")
    if mis_shaped:
        problems.append(f"mis-shaped {len(mis_shaped)} tensor(s): " + "; ".join(mis_shaped))
    if problems:
        raise CheckpointError("checkpoint does not match its config:\n  " + "\n  ".join(problems))


def _group_by_file(located: dict[str, str], keys) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for k in keys:
        groups.setdefault(located[k], []).append(k)
    return groups


SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def _stored_dtype(located: dict[str, str], key: str) -> torch.dtype:
    with safe_open(located[key], framework="pt") as f:
        stored = f.get_slice(key).get_dtype()
    if stored not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{key} is stored as {stored}; MTP weights must be floating point")
    return SAFETENSORS_DTYPES[stored]


def _read_tensors(located, wanted, dtype, device, progress) -> dict[str, torch.Tensor]:
    from tqdm.auto import tqdm

    groups = _group_by_file(located, wanted)
    sizes = {k: torch.Size(wanted[k][1]).numel() * torch.empty((), dtype=dtype).element_size() for k in wanted}
    total = sum(sizes.values())
    show = progress if progress is not None else total >= PROGRESS_MIN_BYTES
    state = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading MTP", disable=not show) as bar:
        for file, keys in groups.items():
            with safe_open(file, framework="pt") as f:
                for k in keys:
                    t = f.get_tensor(k)
                    if k.endswith(W13_SUFFIX):
                        t = deinterleave_rows(t)
                    state[wanted[k][0]] = nn.Parameter(_aligned(t.to(device=device, dtype=dtype)), requires_grad=False)
                    bar.update(sizes[k])
    return state


ALIGNMENT = 64  # bytes: what PyTorch's CPU allocator guarantees, and what vectorised GEMM kernels expect


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its own aligned allocation. safetensors hands out tensors at arbitrary offsets of one buffer; a GEMV
    over a misaligned weight measured ~20 % slower (the small head: 8.9 vs 7.5 ms)."""
    return t if t.data_ptr() % ALIGNMENT == 0 else t.clone()


def _target_shared(target: nn.Module, config: MTPConfig) -> dict[str, nn.Parameter]:
    """The target's embedding table, backbone embed_norm gain and LM head, as its own Parameters."""
    get_text_config = getattr(getattr(target, "config", None), "get_text_config", None)
    text = get_text_config() if get_text_config else None
    if text is None or getattr(text, "model_type", None) != "inkling_text":
        raise CheckpointError(f"target must be a transformers Inkling model (InklingForCausalLM or "
                              f"InklingForConditionalGeneration), got {type(target).__name__}")
    mismatched = [f"{name}: target {getattr(text, name)}, checkpoint {value}"
                  for name, value in (("hidden_size", config.hidden_size), ("vocab_size", config.vocab_size))
                  if getattr(text, name) != value]
    if mismatched:
        raise CheckpointError("target config does not match the MTP checkpoint config: " + "; ".join(mismatched))
    embedding = target.get_input_embeddings()
    shared = {"embed_weight": embedding.weight, "lm_head_weight": target.get_output_embeddings().weight}
    if config.use_embed_norm:
        shared["embed_norm_weight"] = embedding.embed_norm.weight
    for param in shared.values():  # transformers' mmap loading leaves these misaligned too: realign in place, so
        with torch.no_grad():  # that the target (whose Parameter it stays) gets the faster layout as well
            param.data = _aligned(param.data)
    return shared


def save_mtp(model: InklingMTP, path: str | os.PathLike, *, include_shared: bool = True) -> None:
    """Write ``config.json`` + ``mtp.safetensors`` (raw keys, w13 re-interleaved), and by default the three shared
    tensors as ``model.safetensors`` so the directory loads on its own. Loading it back is bit-exact."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mtp, shared = {}, {}
    for name, p in model.named_parameters():
        t = p.detach().contiguous().cpu()
        if name in SHARED_KEYS:
            shared[raw_key(name)] = t
        else:
            mtp[raw_key(name)] = interleave_rows(t) if name.endswith(W13_SUFFIX) else t
    save_file(mtp, str(path / MTP_FILE), metadata={"format": "pt"})
    if include_shared:
        save_file(shared, str(path / SHARED_FILE), metadata={"format": "pt"})
    with open(path / "config.json", "w") as f:
        json.dump(_config_with_depths(model.config, model.dtype), f, indent=2)


def _config_with_depths(config: MTPConfig, dtype: torch.dtype) -> dict:
    """The config.json the model was loaded from, with its depth count and dtype set to what is actually saved."""
    raw = copy.deepcopy(config.raw)
    n = config.num_depths
    text = raw.get("text_config", raw)
    for section in {id(raw): raw, id(text): text}.values():
        if "dtype" in section:
            section["dtype"] = str(dtype).removeprefix("torch.")
    if text.get("num_mtp_layers") is not None:
        text["num_mtp_layers"] = n
    if text.get("mtp_local_layer_ids") is not None:
        text["mtp_local_layer_ids"] = [i for i in text["mtp_local_layer_ids"] if i < n]
    mtp_config = raw.get("mtp_config")
    if mtp_config:
        mtp_config["num_nextn_predict_layers"] = n
        if mtp_config.get("local_layer_ids") is not None:
            mtp_config["local_layer_ids"] = [i for i in mtp_config["local_layer_ids"] if i < n]
    return raw
