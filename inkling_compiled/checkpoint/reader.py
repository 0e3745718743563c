"""Reading a raw Inkling checkpoint directory (docs/model.md §3): safetensors headers and the index, where each tensor
lives (:func:`open_checkpoint` -> an immutable :class:`RawCheckpoint`), strict validation of the files against the
config, and aligned reads of exactly the tensors the draft head needs (the MTP tensors and the three shared ones,
from the target's shards or, with ``target=``, from a live transformers target, never copied).

Every argument and every byte of a directory is treated as hostile: a problem is a ``CheckpointError`` /
``ConfigError`` naming the file, key or value (all mismatches between config and files at once), never a raw
library error or a silent cast.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .. import arguments
from ..arguments import ArgumentError
from ..config import CONFIG_FILE, MTPConfig, read_config_file, read_json_object
from .layout import (
    INDEX_FILE,
    MTP_FILE,
    MTP_PREFIX,
    SAFETENSORS_DTYPES,
    SAFETENSORS_NAMES,
    W13_SUFFIX,
    CheckpointError,
    Shard,
    aligned,
    deinterleave_rows,
    is_draft_key,
    raw_key,
)
from .target import same_device, target_shared_parameters

PROGRESS_MIN_BYTES = 1 << 30

Header = dict[str, tuple[str, tuple[int, ...]]]  # one safetensors file: key -> (dtype name, shape)


# ------------------------------------------------------------------------------------------------ arguments


def _check_num_depths(num_depths, stored: int) -> int | None:
    """``num_depths`` as an int (None: every depth); more than the checkpoint stores is a CheckpointError."""
    if num_depths is None:
        return None
    try:
        num_depths = arguments.integer("num_depths", num_depths, minimum=1)
    except arguments.ArgumentError as e:
        raise arguments.ArgumentError(f"{e} (or None: every depth)") from None
    if num_depths > stored:
        raise CheckpointError(f"num_depths={num_depths} but the checkpoint has {stored} MTP depth(s)")
    return num_depths


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


@dataclass(frozen=True)
class RawCheckpoint:
    """A raw checkpoint directory, opened (:func:`open_checkpoint`): its config (cut to the depths asked for), where
    each tensor the draft head may read lives, and the headers read to find them. Immutable: reading a state from it
    (:meth:`read_state`) changes nothing.

    ``InklingMTP.from_pretrained`` is the public entry: the config gives the model to build, and :meth:`read_state`
    the tensors for the parameter names and shapes that model has.
    """

    path: Path
    config: MTPConfig
    stored_depths: int  # depths the checkpoint has (config.num_depths may be fewer)
    located: Mapping[str, Path]  # raw key -> file holding it (MTP and shared keys)
    duplicates: Mapping[str, tuple[Path, ...]]  # keys several files hold, and no index to choose
    headers: Mapping[Path, Header] = field(repr=False)  # read while locating: every shard, or the MTP one

    def read_state(self, shapes: Mapping[str, torch.Size], *, dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None, target: nn.Module | None = None,
                   progress: bool | None = None, shards: Mapping[str, Shard] | None = None,
                   ) -> tuple[dict[str, torch.Tensor], dict[str, nn.Parameter]]:
        """``(own, lent)``: the model's own tensors by parameter name (w13 de-interleaved, ``dtype`` on ``device``,
        aligned, no autograd) and, with ``target``, the target's own Parameters for the shared names.

        ``shapes`` are the model's parameter names and full shapes; ``shards`` names the tensors of which only a part
        is read (a tensor-parallel rank's, read as slices of the file, never the whole tensor). ``dtype`` defaults
        to the stored MTP dtype (or the target's), ``device`` to CPU (or the target's). Every stored tensor must be
        floating point and finite.
        """
        arguments.dtype("dtype", dtype, SAFETENSORS_NAMES)
        device = arguments.device(device)
        arguments.check_bool("progress", progress, optional=True)
        lent = target_shared_parameters(target, self.config, shapes) if target is not None else {}
        if lent:
            t_dtype, t_device = lent["lm_head_weight"].dtype, lent["lm_head_weight"].device
            if dtype is not None and dtype != t_dtype:
                raise CheckpointError(f"dtype={dtype} requested, but the target's shared tensors are {t_dtype} "
                                      "(sharing without copies needs the target's dtype)")
            if device is not None and not same_device(device, t_device):
                raise CheckpointError(f"device={device} requested, but the target lives on {t_device}")
            dtype, device = t_dtype, t_device
        wanted = {raw_key(n): (n, tuple(s)) for n, s in shapes.items() if n not in lent}
        stored_dtypes = self._validate(wanted)
        if dtype is None:
            dtype = stored_dtype({k: d for k, d in stored_dtypes.items() if k.startswith(MTP_PREFIX)}, self.path)
        parts = {k: shards[n] for k, (n, _) in wanted.items() if n in (shards or {})}
        own = self._read(wanted, parts, dtype, device if device is not None else torch.device("cpu"), progress)
        return own, lent

    def _validate(self, wanted: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, str]:
        """Every problem between config and files at once; the stored dtype of each wanted key."""
        config, problems = self.config, []
        chain_key = MTP_PREFIX + "chain_norm.weight"
        if chain_key in self.located and not config.chain_hidden_post_norm:
            problems.append(f"{chain_key} is present but chain_hidden_post_norm is false in the config "
                            "(set mtp_config.chain_hidden_post_norm=true to use it, or remove the tensor)")
        skipped = _skipped_prefixes(config, self.stored_depths)
        found = {k: self.located[k] for k in wanted if k in self.located}
        absent_files = sorted({f.name for f in found.values() if not f.is_file()})
        headers = {f: self.headers[f] if f in self.headers else read_header(f)
                   for f in sorted(set(found.values())) if f.is_file()}
        stored = {k: headers[f][k] for k, f in found.items() if k in headers.get(f, ())}
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

    def _read(self, wanted, parts: Mapping[str, Shard], dtype: torch.dtype, device: torch.device,
              progress: bool | None) -> dict[str, torch.Tensor]:
        from tqdm.auto import tqdm

        itemsize = dtype.itemsize
        total = sum(torch.Size(shape).numel() * itemsize // (parts[k].count if k in parts else 1)
                    for k, (_, shape) in wanted.items())
        show = progress if progress is not None else total >= PROGRESS_MIN_BYTES
        own = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc="loading MTP", disable=not show) as bar:
            for file, keys in _group_by_file({k: self.located[k] for k in wanted}).items():
                try:
                    with safe_open(str(file), framework="pt") as f:
                        for k in keys:
                            t = _read_part(f, k, parts[k]) if k in parts else f.get_tensor(k)
                            if k.endswith(W13_SUFFIX):
                                t = deinterleave_rows(t)
                            own[wanted[k][0]] = aligned(t.to(device=device, dtype=dtype))
                            bar.update(t.numel() * itemsize)
                except (SafetensorError, OSError) as e:
                    raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e
        bad = non_finite(own)
        if bad:
            raise CheckpointError(f"{self.path}: tensors hold NaN or inf values (as {dtype}): "
                                  f"{sorted(raw_key(n) for n in bad)}")
        return own


def _read_part(f, key: str, shard: Shard) -> torch.Tensor:
    """The part ``shard`` of ``key`` read as slices of the open file (still in the file's layout: w13 interleaved)."""
    stored = f.get_slice(key)
    size = stored.get_shape()[shard.dim]
    if key.endswith(W13_SUFFIX):  # [gate; up] rows [a, b) of each half are the interleaved rows [2a, 2b) on disk
        if (shard.dim, shard.blocks) != (0, 2):
            raise ValueError(f"{key}: a w13 shard splits each of its [gate; up] halves by rows, got {shard}")
        (start, stop), _ = shard.ranges(size)
        return stored[2 * start : 2 * stop]
    lead = (slice(None),) * shard.dim
    spans = [stored[(*lead, slice(start, stop))] for start, stop in shard.ranges(size)]
    return spans[0] if len(spans) == 1 else torch.cat(spans, dim=shard.dim)


def checkpoint_directory(name: str, value) -> Path:
    """``value`` (the argument ``name``) as the Path of an existing directory holding a config.json: a command-line
    option's check before anything is read (:func:`open_checkpoint` then checks what the files hold)."""
    directory = arguments.existing_directory(name, value)
    if not (directory / CONFIG_FILE).is_file():
        raise ArgumentError(f"{name} {str(directory)!r} holds no {CONFIG_FILE}: not a raw Inkling checkpoint directory")
    return directory


def open_checkpoint(path, *, num_depths: int | None = None, mtp_log_scaling: bool = False) -> RawCheckpoint:
    """Open the checkpoint directory ``path``: its config.json read and checked (cut to the first ``num_depths``
    depths) and every tensor of the draft head located."""
    path = arguments.path("checkpoint path", path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory (a checkpoint is a directory holding {CONFIG_FILE} "
                                 "and *.safetensors files)")
    # parsed without importing transformers where it can be (config.py)
    config = MTPConfig.from_config_dict(read_config_file(path), path / CONFIG_FILE, mtp_log_scaling=mtp_log_scaling)
    stored = config.num_depths
    num_depths = _check_num_depths(num_depths, stored)
    if num_depths is not None:
        config = replace(config, depths=config.depths[:num_depths])
    located, duplicates, headers = _locate(path)
    return RawCheckpoint(path, config, stored, MappingProxyType(located), MappingProxyType(duplicates),
                         MappingProxyType(headers))


def _skipped_prefixes(config: MTPConfig, stored_depths: int) -> tuple[str, ...]:
    """Key prefixes of the stored depths beyond the ones loaded."""
    return tuple(f"{MTP_PREFIX}layers.{i}." for i in range(config.num_depths, stored_depths))


def _locate(path: Path) -> tuple[dict[str, Path], dict[str, tuple[Path, ...]], dict[Path, Header]]:
    """(raw key -> file, keys in several files, the headers read on the way), for the draft head's keys: from the
    index if there is one (the MTP shard's own header is authoritative for what it holds: an index written for the
    target alone lists none of it), else from every shard's header."""
    index = read_index(path)
    mtp_file = path / MTP_FILE
    if index is not None:
        located = {k: path / v for k, v in index["weight_map"].items() if is_draft_key(k)}
        if not mtp_file.is_file():
            return located, {}, {}
        header = read_header(mtp_file)  # replaces whatever the index says about the MTP shard
        located = {k: f for k, f in located.items() if f != mtp_file}
        located.update(dict.fromkeys(header, mtp_file))
        return located, {}, {mtp_file: header}
    files = sorted(f for f in path.glob("*.safetensors") if f.is_file())
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    headers = {file: read_header(file) for file in files}
    holders: dict[str, list[Path]] = {}
    for file, header in headers.items():
        for k in header:
            holders.setdefault(k, []).append(file)
    located = {k: holding[-1] for k, holding in holders.items()}
    duplicates = {k: tuple(holding) for k, holding in holders.items() if len(holding) > 1 and is_draft_key(k)}
    return located, duplicates, headers


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
