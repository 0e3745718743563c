"""Raw Inkling checkpoint directory <-> the MTP head's config and named tensors (docs/model.md §3). The file format
lives here alone: this module knows config + safetensors, never the model.

The key map is the identity under ``model.mtp.`` (module names follow the checkpoint's), with one transform:
``mlp.w13_dn.weight`` rows are interleaved gate/up on disk and held as [gate; up] in memory. The three shared tensors
come from the target's shards (found through ``model.safetensors.index.json`` when present) or from a live
transformers target, never copied. Only the MTP tensors and those three are ever read.

Every argument and every byte of a directory is treated as hostile: a problem is a ``CheckpointError`` /
``ConfigError`` naming the file, key or value (all mismatches between config and files at once), never a raw
library error, a silent cast or a half-written directory. Saves are atomic per file and leave the directory as it
was on any failure (:func:`write_files_atomically`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .config import CONFIG_FILE, ConfigError, MTPConfig, parse_config_dict, read_config_file, read_json_object

MTP_PREFIX = "model.mtp."
MTP_FILE = "mtp.safetensors"
SHARED_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
W13_SUFFIX = "transformer_block.mlp.w13_dn.weight"
# InklingMTP parameter -> raw key of the target tensor it shares
SHARED_KEYS = {
    "embed_weight": "model.llm.embed.weight",
    "embed_norm_weight": "model.llm.embed_norm.weight",
    "lm_head_weight": "model.llm.unembed.weight",
}
SHARED_RAW_KEYS = tuple(SHARED_KEYS.values())
# The dtypes an MTP weight may be stored in and run in (safetensors header name -> torch dtype).
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
_SAFETENSORS_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
PROGRESS_MIN_BYTES = 1 << 30
ALIGNMENT = 64  # bytes: what PyTorch's CPU allocator guarantees, and what vectorised GEMM kernels expect

Header = dict[str, tuple[str, tuple[int, ...]]]  # one safetensors file: key -> (dtype name, shape)


class CheckpointError(ValueError):
    """The checkpoint directory cannot give (or take) this MTP head: unreadable files, missing / unexpected /
    mis-shaped / non-floating / non-finite tensors, a config mismatch, or a save that would lose data."""


def raw_key(name: str) -> str:
    """Raw checkpoint key of an ``InklingMTP`` parameter name."""
    return SHARED_KEYS.get(name, MTP_PREFIX + name)


def interleave_rows(w: torch.Tensor) -> torch.Tensor:
    """[gate; up] -> gate0, up0, gate1, up1, ... (the on-disk w13_dn layout, docs/model.md §3.4)."""
    gate, up = w.chunk(2, dim=0)
    return torch.stack([gate, up], dim=1).reshape(w.shape)


def deinterleave_rows(w: torch.Tensor) -> torch.Tensor:
    """On-disk interleaved gate/up rows -> [gate (rows 0::2); up (rows 1::2)]."""
    return torch.cat([w[0::2], w[1::2]], dim=0)


# ------------------------------------------------------------------------------------------------ arguments


def checkpoint_path(path) -> Path:
    """``path`` as a Path; TypeError for anything that is not a str or os.PathLike."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"checkpoint path must be a str or os.PathLike, got {type(path).__name__} {path!r}")
    return Path(path)


def _check_flag(name: str, value, *, optional: bool = False) -> None:
    if not (isinstance(value, bool) or optional and value is None):
        raise TypeError(f"{name} must be a bool{' or None' if optional else ''}, got {value!r}")


def _check_dtype(dtype) -> None:
    if dtype is None:
        return
    supported = f"None or one of {sorted(map(str, _SAFETENSORS_NAMES))}"
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be {supported}, got {type(dtype).__name__} {dtype!r}")
    if dtype not in _SAFETENSORS_NAMES:
        raise ValueError(f"dtype must be {supported} (the MTP runs in floating point), got {dtype}")


def _check_device(device) -> torch.device | None:
    """The torch.device named by ``device``; ValueError if it is not a valid device string or is not usable here."""
    if device is None:
        return None
    try:
        resolved = torch.device(device)
        torch.empty(1, device=resolved)  # an absent backend or device index fails here, not mid-load
    except (RuntimeError, AssertionError, TypeError, NotImplementedError) as e:
        raise ValueError(f"device={device!r} is not usable: {e}") from e
    return resolved


def _check_num_depths(num_depths, stored: int) -> None:
    if num_depths is None:
        return
    if not isinstance(num_depths, int) or isinstance(num_depths, bool):
        raise TypeError(f"num_depths must be an int or None, got {num_depths!r}")
    if not 1 <= num_depths <= stored:
        raise CheckpointError(f"num_depths={num_depths} but the checkpoint has {stored} MTP depth(s)")


# ------------------------------------------------------------------------------------------------ reading files


def read_header(file: Path) -> Header:
    """Key -> (dtype name, shape) of every tensor in one safetensors file; CheckpointError naming the file if it is
    not a readable safetensors file (truncated, corrupt header, overlapping data, unreadable)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e


def read_index(directory: Path) -> dict | None:
    """``model.safetensors.index.json`` of ``directory`` (None if absent), its ``weight_map`` checked: an object
    mapping keys to plain file names in the directory."""
    file = directory / INDEX_FILE
    if not file.is_file():
        return None
    index = read_json_object(file, CheckpointError)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{file}: 'weight_map' must be an object mapping tensor keys to files, got "
                              f"{type(weight_map).__name__}")
    bad = [(k, v) for k, v in weight_map.items()
           if not isinstance(v, str) or v in ("", ".", "..") or os.path.basename(v) != v or "\\" in v]
    if bad:
        raise CheckpointError(f"{file}: weight_map entries must name a file in the checkpoint directory; not: "
                              + ", ".join(f"{k!r}: {v!r}" for k, v in bad[:5]))
    return index


def _relevant(key: str) -> bool:
    return key.startswith(MTP_PREFIX) or key in SHARED_RAW_KEYS


@dataclass
class RawCheckpoint:
    """A raw checkpoint directory, opened: its config (cut to the depths asked for) and where each tensor lives.

    ``InklingMTP.from_pretrained`` is the public entry: ``open`` gives the config to build the model from, and
    ``read_state`` the tensors for the parameter names and shapes that model has.
    """

    path: Path
    config: MTPConfig
    stored_depths: int  # depths the checkpoint has (config.num_depths may be fewer)
    located: dict[str, Path] = field(default_factory=dict)  # raw key -> file holding it (MTP and shared keys)
    duplicates: dict[str, list[Path]] = field(default_factory=dict)  # keys several files hold, and no index
    headers: dict[Path, Header] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path, *, num_depths: int | None = None, mtp_log_scaling: bool = False) -> RawCheckpoint:
        path = checkpoint_path(path)
        if not path.exists():
            raise FileNotFoundError(f"checkpoint directory {path} does not exist")
        if not path.is_dir():
            raise NotADirectoryError(f"{path} is not a directory (a checkpoint is a directory holding {CONFIG_FILE} "
                                     "and *.safetensors files)")
        # parsed without importing transformers where it can be (config.py)
        config = MTPConfig.from_config_dict(read_config_file(path), path / CONFIG_FILE, mtp_log_scaling=mtp_log_scaling)
        stored = config.num_depths
        _check_num_depths(num_depths, stored)
        if num_depths is not None:
            config = replace(config, depths=config.depths[:num_depths])
        checkpoint = cls(path, config, stored)
        checkpoint._locate()
        return checkpoint

    def header(self, file: Path) -> Header:
        if file not in self.headers:
            self.headers[file] = read_header(file)
        return self.headers[file]

    def _locate(self) -> None:
        """Fill ``located`` from the index if there is one (the MTP shard's own header is authoritative for what it
        holds: an index written for the target alone lists none of it), else from every shard's header."""
        index = read_index(self.path)
        mtp_file = self.path / MTP_FILE
        if index is not None:
            located = {k: self.path / v for k, v in index["weight_map"].items() if _relevant(k)}
            if mtp_file.is_file():  # its header replaces whatever the index says about it
                located = {k: f for k, f in located.items() if f != mtp_file}
                located.update(dict.fromkeys(self.header(mtp_file), mtp_file))
            self.located = located
            return
        files = sorted(f for f in self.path.glob("*.safetensors") if f.is_file())
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.path}")
        holders: dict[str, list[Path]] = {}
        for file in files:
            for k in self.header(file):
                holders.setdefault(k, []).append(file)
        self.located = {k: holding[-1] for k, holding in holders.items()}
        self.duplicates = {k: holding for k, holding in holders.items() if len(holding) > 1 and _relevant(k)}

    def read_state(self, shapes: Mapping[str, torch.Size], *, dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None, target: nn.Module | None = None,
                   progress: bool | None = None) -> tuple[dict[str, torch.Tensor], dict[str, nn.Parameter]]:
        """``(own, lent)``: the model's own tensors by parameter name (w13 de-interleaved, ``dtype`` on ``device``,
        aligned, no autograd) and, with ``target``, the target's own Parameters for the shared names.

        ``shapes`` are the model's parameter names and shapes. ``dtype`` defaults to the stored MTP dtype (or the
        target's), ``device`` to CPU (or the target's). Every stored tensor must be floating point and finite.
        """
        _check_dtype(dtype)
        device = _check_device(device)
        _check_flag("progress", progress, optional=True)
        lent = _target_shared(target, self.config, shapes) if target is not None else {}
        if lent:
            t_dtype, t_device = lent["lm_head_weight"].dtype, lent["lm_head_weight"].device
            if dtype is not None and dtype != t_dtype:
                raise CheckpointError(f"dtype={dtype} requested, but the target's shared tensors are {t_dtype} "
                                      "(sharing without copies needs the target's dtype)")
            if device is not None and not _same_device(device, t_device):
                raise CheckpointError(f"device={device} requested, but the target lives on {t_device}")
            dtype, device = t_dtype, t_device
        wanted = {raw_key(n): (n, tuple(s)) for n, s in shapes.items() if n not in lent}
        stored_dtypes = self._validate(wanted)
        if dtype is None:
            dtype = stored_dtype({k: d for k, d in stored_dtypes.items() if k.startswith(MTP_PREFIX)}, self.path)
        own = self._read(wanted, dtype, device if device is not None else torch.device("cpu"), progress)
        return own, lent

    def _validate(self, wanted: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, str]:
        """Every problem between config and files at once; the stored dtype of each wanted key."""
        config, problems = self.config, []
        chain_key = MTP_PREFIX + "chain_norm.weight"
        if chain_key in self.located and not config.chain_hidden_post_norm:
            problems.append(f"{chain_key} is present but chain_hidden_post_norm is false in the config "
                            "(set mtp_config.chain_hidden_post_norm=true to use it, or remove the tensor)")
        skipped = tuple(f"{MTP_PREFIX}layers.{i}." for i in range(config.num_depths, self.stored_depths))
        found = {k: self.located[k] for k in wanted if k in self.located}
        absent_files = sorted({f.name for f in found.values() if not f.is_file()})
        stored = {k: self.header(f)[k] for k, f in found.items() if f.is_file() and k in self.header(f)}
        not_held = sorted(f"{k} -> {f.name}" for k, f in found.items() if f.is_file() and k not in stored)
        missing = sorted(k for k in wanted if k not in stored)
        unexpected = sorted(k for k in self.located if k.startswith(MTP_PREFIX) and k not in wanted
                            and k != chain_key and not k.startswith(skipped))
        duplicated = [f"{k} (in {', '.join(f.name for f in files)})" for k, files in sorted(self.duplicates.items())]
        mis_shaped = [f"{k}: checkpoint {list(stored[k][1])}, config expects {list(wanted[k][1])}"
                      for k in sorted(stored) if stored[k][1] != wanted[k][1]]
        not_float = _not_floating({k: d for k, (d, _) in stored.items()})
        if missing:
            problems.append(f"missing {len(missing)} tensor(s): {missing}")
        if absent_files:
            problems.append(f"files named in {INDEX_FILE} do not exist: {absent_files}")
        if not_held:
            problems.append(f"{INDEX_FILE} names files that do not hold the tensor: " + "; ".join(not_held))
        if duplicated:
            problems.append(f"tensors held by several files (and no {INDEX_FILE} to choose): " + "; ".join(duplicated))
        if unexpected:
            problems.append(f"unexpected {len(unexpected)} tensor(s) under {MTP_PREFIX}: {unexpected}")
        if mis_shaped:
            problems.append(f"mis-shaped {len(mis_shaped)} tensor(s): " + "; ".join(mis_shaped))
        if not_float:
            problems.append(not_float)
        if problems:
            raise CheckpointError(f"{self.path}: checkpoint does not match its config:\n  " + "\n  ".join(problems))
        return {k: d for k, (d, _) in stored.items()}

    def _read(self, wanted, dtype: torch.dtype, device: torch.device, progress: bool | None) -> dict[str, torch.Tensor]:
        from tqdm.auto import tqdm

        itemsize = dtype.itemsize
        total = sum(torch.Size(shape).numel() * itemsize for _, shape in wanted.values())
        show = progress if progress is not None else total >= PROGRESS_MIN_BYTES
        own = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc="loading MTP", disable=not show) as bar:
            for file, keys in _group_by_file({k: self.located[k] for k in wanted}).items():
                try:
                    with safe_open(str(file), framework="pt") as f:
                        for k in keys:
                            t = f.get_tensor(k)
                            if k.endswith(W13_SUFFIX):
                                t = deinterleave_rows(t)
                            own[wanted[k][0]] = _aligned(t.to(device=device, dtype=dtype))
                            bar.update(t.numel() * itemsize)
                except (SafetensorError, OSError) as e:
                    raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e
        bad = non_finite(own)
        if bad:
            raise CheckpointError(f"{self.path}: tensors hold NaN or inf values (as {dtype}): "
                                  f"{sorted(raw_key(n) for n in bad)}")
        return own


def _not_floating(dtypes: Mapping[str, str]) -> str | None:
    bad = [f"{k}: {d}" for k, d in sorted(dtypes.items()) if d not in SAFETENSORS_DTYPES]
    if not bad:
        return None
    return f"{len(bad)} tensor(s) stored in a dtype that is not {'/'.join(SAFETENSORS_DTYPES)}: " + ", ".join(bad)


def stored_dtype(dtypes: Mapping[str, str], where: str | os.PathLike) -> torch.dtype:
    """The one dtype that tensors (key -> safetensors dtype name) are stored in; CheckpointError naming ``where`` if
    one is not floating point, or they are not all the same (then ``dtype=`` must choose)."""
    problem = _not_floating(dtypes)
    if problem:
        raise CheckpointError(f"{where}: {problem}")
    counts = {d: sum(v == d for v in dtypes.values()) for d in sorted(set(dtypes.values()))}
    if len(counts) != 1:
        raise CheckpointError(f"{where}: the MTP tensors are stored in several dtypes {counts}; pass dtype= to load "
                              "them all in one")
    return SAFETENSORS_DTYPES[next(iter(counts))]


def non_finite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the tensors (all on one device) holding a NaN or inf, in one host sync; meta tensors are skipped."""
    names = [n for n, t in tensors.items() if not t.is_meta]
    if not names:
        return []
    finite = torch.stack([torch.isfinite(tensors[n]).all() for n in names]).tolist()
    return [n for n, ok in zip(names, finite, strict=True) if not ok]


def _group_by_file(located: Mapping[str, Path]) -> dict[Path, list[str]]:
    groups: dict[Path, list[str]] = {}
    for k, file in located.items():
        groups.setdefault(file, []).append(k)
    return groups


def _same_device(requested: torch.device, actual: torch.device) -> bool:
    """``"cuda"`` (no index) matches any CUDA device; an explicit index must match."""
    return requested.type == actual.type and (requested.index is None or requested.index == actual.index)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its own aligned allocation. safetensors hands out tensors at arbitrary offsets of one buffer; a GEMV
    over a misaligned weight measured ~20 % slower (the small head: 8.9 vs 7.5 ms)."""
    return t if t.is_meta or t.data_ptr() % ALIGNMENT == 0 else t.clone()


def _target_shared(target: nn.Module, config: MTPConfig, shapes: Mapping[str, torch.Size]) -> dict[str, nn.Parameter]:
    """The target's embedding table, backbone embed_norm gain and LM head, as its own Parameters (one that sits
    misaligned in a memory-mapped file is moved, in place, to an aligned allocation: the target keeps using it)."""
    get_text_config = getattr(getattr(target, "config", None), "get_text_config", None)
    text = get_text_config() if callable(get_text_config) else None
    if text is None or getattr(text, "model_type", None) != "inkling_text":
        raise CheckpointError(f"target must be a transformers Inkling model (InklingForCausalLM or "
                              f"InklingForConditionalGeneration), got {type(target).__name__}")
    mismatched = [f"{name}: target {getattr(text, name)}, checkpoint {value}"
                  for name, value in (("hidden_size", config.hidden_size), ("vocab_size", config.vocab_size))
                  if getattr(text, name) != value]
    embedding = target.get_input_embeddings()
    embed_norm = getattr(embedding, "embed_norm", None)
    if (embed_norm is not None) != config.use_embed_norm:
        mismatched.append(f"embed_norm: the target's embedding {'has' if embed_norm is not None else 'has no'} "
                          f"embed_norm, the checkpoint config has use_embed_norm={config.use_embed_norm}")
    if mismatched:
        raise CheckpointError("target config does not match the MTP checkpoint config: " + "; ".join(mismatched))
    shared = {"embed_weight": embedding.weight, "lm_head_weight": target.get_output_embeddings().weight}
    if config.use_embed_norm:
        shared["embed_norm_weight"] = embed_norm.weight
    head = shared["lm_head_weight"]
    odd = [f"{n}: {p.dtype} on {p.device}, shape {list(p.shape)} (config: {list(shapes[n])})"
           for n, p in shared.items()
           if p.dtype not in _SAFETENSORS_NAMES or (p.dtype, p.device) != (head.dtype, head.device)
           or p.shape != shapes[n]]
    if odd:
        raise CheckpointError("the target's shared tensors must be of one floating dtype on one device, with the "
                              "shapes the checkpoint config gives: " + "; ".join(odd))
    for param in shared.values():  # transformers' mmap loading leaves these misaligned too: realign in place, so
        with torch.no_grad():  # that the target (whose Parameter it stays) gets the faster layout as well
            param.data = _aligned(param.data)
    return shared


# ------------------------------------------------------------------------------------------------ saving


def save_checkpoint(path, config: MTPConfig, tensors: Mapping[str, torch.Tensor], *,
                    include_shared: bool = True) -> None:
    """Write ``config.json`` + ``mtp.safetensors`` (raw keys, w13 re-interleaved), and by default the three shared
    tensors as ``model.safetensors`` so the directory loads on its own. Loading it back is bit-exact.

    ``tensors`` are the model's parameters by name (one floating dtype, finite). Over an existing checkpoint: an index
    there is updated to name exactly the files just written for the keys they hold (the target's other entries
    kept), and a save that would destroy tensors it does not own (a ``model.safetensors`` holding the whole target)
    or leave two copies of a key with no index to choose is refused before anything is written. The write itself is
    :func:`write_files_atomically`.
    """
    path = checkpoint_path(path)
    _check_flag("include_shared", include_shared)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is a file: save_pretrained writes a checkpoint directory")
    files, dtype = _files_to_write(tensors, include_shared)
    config_json = _config_json(config, dtype)
    index = None
    if path.is_dir():
        index = _updated_index(path, files)
        _refuse_data_loss(path, files, has_index=index is not None)
    writers: dict[str, Callable[[Path], None]] = {
        name: (lambda file, t=t: save_file(t, str(file), metadata={"format": "pt"})) for name, t in files.items()}
    if index is not None:
        writers[INDEX_FILE] = lambda file: _write_json(file, index)
    writers[CONFIG_FILE] = lambda file: _write_json(file, config_json)  # renamed last
    write_files_atomically(path, writers)


def _files_to_write(tensors: Mapping[str, torch.Tensor], include_shared: bool):
    """(file -> raw key -> CPU contiguous tensor, dtype), checked: one floating dtype, values present and finite."""
    dtypes = {n: t.dtype for n, t in tensors.items()}
    if len(set(dtypes.values())) != 1 or next(iter(dtypes.values())) not in _SAFETENSORS_NAMES:
        raise CheckpointError(f"cannot save: the tensors must share one dtype of {sorted(map(str, _SAFETENSORS_NAMES))}"
                              f", got {sorted(set(map(str, dtypes.values())))} (convert the model to one first)")
    meta = sorted(n for n, t in tensors.items() if t.is_meta)
    if meta:
        raise CheckpointError(f"cannot save: tensors on the meta device hold no values: {meta}")
    saved, storages = {}, set()
    for name, t in tensors.items():
        if name in SHARED_KEYS and not include_shared:
            continue
        t = t.detach().cpu().contiguous()
        if t.untyped_storage().data_ptr() in storages:  # safetensors refuses tensors sharing memory (tied or
            t = t.clone()  # overlapping views): the copy gets its own
        storages.add(t.untyped_storage().data_ptr())
        saved[name] = interleave_rows(t) if name.endswith(W13_SUFFIX) else t
    bad = non_finite(saved)
    if bad:
        raise CheckpointError(f"cannot save: tensors hold NaN or inf values (the checkpoint would not load): {bad}")
    files: dict[str, dict[str, torch.Tensor]] = {MTP_FILE: {}, **({SHARED_FILE: {}} if include_shared else {})}
    for name, t in saved.items():
        files[SHARED_FILE if name in SHARED_KEYS else MTP_FILE][raw_key(name)] = t
    return files, next(iter(dtypes.values()))


def _updated_index(path: Path, files: Mapping[str, Iterable[str]]) -> dict | None:
    """The directory's index (None if it has none) naming ``files`` for exactly the keys they will hold; entries
    for the target's other tensors are kept, stale ones for the files rewritten or for MTP depths dropped."""
    index = read_index(path)
    if index is None:
        return None
    written = {k: name for name, keys in files.items() for k in keys}
    kept = {k: v for k, v in index["weight_map"].items()
            if k not in written and v not in files and not k.startswith(MTP_PREFIX)}
    return {**index, "weight_map": dict(sorted({**kept, **written}.items()))}


def _refuse_data_loss(path: Path, files: Mapping[str, Mapping[str, torch.Tensor]], *, has_index: bool) -> None:
    """Refuse a save that would destroy tensors it does not own, or leave a key in two files with no index."""
    ours = {k for keys in files.values() for k in keys}
    problems = []
    for name in files:
        if (path / name).is_file():
            try:
                held = read_header(path / name)
            except CheckpointError:
                continue  # an unreadable file holds nothing to lose
            foreign = sorted(k for k in held if not _relevant(k))
            if foreign:
                problems.append(f"replacing {name} would destroy {len(foreign)} tensor(s) this save does not own "
                                f"(e.g. {foreign[:3]})")
    if not has_index:
        for file in sorted(path.glob("*.safetensors")):
            if file.name not in files and file.is_file():
                both = sorted(ours & set(read_header(file)))
                if both:
                    problems.append(f"{file.name} also holds {len(both)} of the tensors saved (e.g. {both[:3]}) and "
                                    f"there is no {INDEX_FILE} to choose between the copies")
    if problems:
        raise CheckpointError(f"{path}: refusing to save here: " + "; ".join(problems)
                              + " (save to a new directory, or pass include_shared=False to write only the MTP)")


def _write_json(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, indent=2) + "\n")


def write_files_atomically(directory, files: Mapping[str, Callable[[Path], None]]) -> None:
    """Write each of ``files`` (name -> writer of that file's bytes to a given path) into ``directory``, created if
    needed, so that a failure anywhere leaves the directory exactly as it was.

    Every file is first written to a hidden temporary in ``directory`` and flushed to disk (fsync); only when all of
    them are, they are renamed into place (``os.replace``, atomic per file), in the order given (callers put
    ``config.json`` last), then the directory itself is synced. On any error or interrupt before the renames the
    temporaries are removed (and a directory this call created, with its parents). What is not atomic: the renames
    as a sequence. A crash between two of them leaves some new files beside some old ones (config.json still the
    old, since it goes last); a process killed outright (SIGKILL, power loss) before the renames leaves only
    ``.*.tmp`` files beside the intact old checkpoint. Concurrent saves into one directory are not supported. A name
    that is a symlink (a Hugging Face cache snapshot) is replaced as a link: the blob it points at is never written.
    """
    directory = Path(directory)
    blocked = [name for name in files if (directory / name).exists() and not (directory / name).is_file()]
    if blocked:  # found now, not at the second rename
        raise IsADirectoryError(f"{directory}: {blocked} must be replaced by files, but are not files")
    created = [p for p in (directory, *directory.parents) if not p.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    temporaries: dict[Path, Path] = {}
    try:
        for name, write in files.items():
            temporary = directory / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
            temporaries[temporary] = directory / name
            write(temporary)
            _fsync(temporary)
        for temporary, final in temporaries.items():
            os.replace(temporary, final)
    except BaseException:
        for temporary in temporaries:
            temporary.unlink(missing_ok=True)
        for created_dir in created:  # deepest first, each empty once the temporaries are gone
            with contextlib.suppress(OSError):
                created_dir.rmdir()
        raise
    with contextlib.suppress(OSError):  # best effort: not every file system syncs a directory
        _fsync(directory)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_directory_atomically(final, build: Callable[[Path], None], *, complete: str) -> Path:
    """Create ``final`` by ``build``-ing it under a temporary sibling name and renaming it into place, so that a
    directory that exists is complete. If a concurrent builder got there first (``final/complete`` exists), its
    copy wins and ours is discarded; on any failure nothing is left behind."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    temporary.mkdir()
    try:
        build(temporary)
        try:
            os.rename(temporary, final)
        except OSError:
            if not (final / complete).is_file():
                raise
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)
    return final


def _config_json(config: MTPConfig, dtype: torch.dtype) -> dict:
    """The config.json to write, checked to describe ``config``: a config edited after loading
    (``dataclasses.replace``) or built without a config.json would otherwise be saved as another model."""
    raw = _config_with_depths(config, dtype)
    try:
        described = MTPConfig.from_hf(parse_config_dict(raw, "its config.json"), raw=raw,
                                      mtp_log_scaling=any(d.log_scaling for d in config.depths))
    except ConfigError as e:
        raise CheckpointError(f"cannot save: the model's config was not read from a usable config.json ({e})") from e
    differ = [f.name for f in fields(MTPConfig) if f.compare
              and getattr(described, f.name) != getattr(config, f.name)]
    if differ:
        raise CheckpointError(f"cannot save: the config.json the model was loaded with no longer describes it "
                              f"(fields {differ} differ); edit config.raw to match")
    return raw


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
