"""Saving the MTP head as a raw Inkling checkpoint directory (docs/model.md §3.7): ``config.json`` describing the
model, ``mtp.safetensors`` with the w13 rows re-interleaved, by default the three shared tensors, and an existing
index kept true. A save that would lose data is refused before anything is written, and the write is atomic
(:func:`~inkling_compiled.atomic_files.write_files_atomically`): on any failure the directory is left as it was.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .. import arguments
from ..atomic_files import write_files_atomically
from ..config import CONFIG_FILE, ConfigError, MTPConfig, parse_config_dict
from .layout import (
    INDEX_FILE,
    MTP_FILE,
    MTP_PREFIX,
    SAFETENSORS_NAMES,
    SHARED_FILE,
    SHARED_KEYS,
    W13_SUFFIX,
    CheckpointError,
    interleave_rows,
    is_draft_key,
    raw_key,
)
from .reader import non_finite, read_header, read_index


def save_checkpoint(path, config: MTPConfig, tensors: Mapping[str, torch.Tensor], *,
                    include_shared: bool = True) -> None:
    """Write ``config.json`` + ``mtp.safetensors`` (raw keys, w13 re-interleaved), and by default the three shared
    tensors as ``model.safetensors`` so the directory loads on its own. Loading it back is bit-exact.

    ``tensors`` are the model's parameters by name (one floating dtype, finite). Over an existing checkpoint: an index
    there is updated to name exactly the files just written for the keys they hold (the target's other entries
    kept), and a save that would destroy tensors it does not own (a ``model.safetensors`` holding the whole target)
    or leave two copies of a key with no index to choose is refused before anything is written. Beside an index (a
    sharded target) the shared tensors are the target's own, in its shards: they are not written again, since
    transformers loads a ``model.safetensors`` in place of the index, and a save whose shared tensors differ from
    the stored ones is refused. The write itself is :func:`write_files_atomically`.
    """
    path = arguments.path("checkpoint path", path)
    arguments.check_bool("include_shared", include_shared)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is a file: save_pretrained writes a checkpoint directory")
    files, dtype = _files_to_write(tensors, include_shared)
    config_json = _config_json(config, dtype)
    index = None
    if path.is_dir():
        _refuse_other_model(path, config_json)
        if SHARED_FILE in files and read_index(path) is not None:
            _check_stored_beside_index(path, files.pop(SHARED_FILE))
        index = _updated_index(path, files)
        _refuse_data_loss(path, files, has_index=index is not None)
    writers: dict[str, Callable[[Path], None]] = {
        name: (lambda file, t=t, name=name: _save_tensors(t, file, name)) for name, t in files.items()}
    if index is not None:
        writers[INDEX_FILE] = lambda file: _write_json(file, index)
    writers[CONFIG_FILE] = lambda file: _write_json(file, config_json)  # renamed last
    write_files_atomically(path, writers)


def _save_tensors(tensors: Mapping[str, torch.Tensor], file: Path, name: str) -> None:
    try:
        save_file(tensors, str(file), metadata={"format": "pt"})
    except SafetensorError as e:  # a full disk, say: safetensors' message names no file
        raise OSError(f"could not write {name} into {file.parent}: {e}") from e


def _files_to_write(tensors: Mapping[str, torch.Tensor], include_shared: bool):
    """(file -> raw key -> CPU contiguous tensor, dtype), checked: one floating dtype, values present and finite."""
    dtypes = {n: t.dtype for n, t in tensors.items()}
    if len(set(dtypes.values())) != 1 or next(iter(dtypes.values())) not in SAFETENSORS_NAMES:
        raise CheckpointError(f"cannot save: the tensors must share one dtype of {sorted(map(str, SAFETENSORS_NAMES))}"
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
    for the target's other tensors are kept, stale ones for the files rewritten or MTP keys it no longer holds."""
    index = read_index(path)
    if index is None:
        return None
    written = {k: name for name, keys in files.items() for k in keys}
    kept = {k: v for k, v in index["weight_map"].items()
            if k not in written and v not in files and not k.startswith(MTP_PREFIX)}
    return {**index, "weight_map": dict(sorted({**kept, **written}.items()))}


def _refuse_other_model(path: Path, config_json: dict) -> None:
    """Refuse a save over a config.json that describes another model: it is the target's too, and replacing it
    would leave the target's shards described by this model's sizes. What a save of the same model may change (the
    MTP's own settings, its depth count, its dtype) is not compared; a config.json that is not a JSON object holds
    nothing to keep."""
    try:
        there = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    if not isinstance(there, dict):
        return
    differ = set(_flat_settings(there).items()) ^ set(_flat_settings(config_json).items())
    if differ:
        names = sorted({name for name, _ in differ})
        raise CheckpointError(f"{path}: refusing to save here: its {CONFIG_FILE} describes another model ({names[:5]}"
                              f"{' ...' if len(names) > 5 else ''} differ from this model's): save to a new directory")


# the settings a save of the same model may change: the MTP's own, its depth count, the dtype
_MTP_SETTINGS = {"dtype", "torch_dtype", "num_mtp_layers", "mtp_local_layer_ids", "mtp_config"}


def _flat_settings(config: dict, prefix: str = "") -> dict[str, str]:
    """``section.key -> JSON text`` of a config.json's settings, the ones a save of the same model may change left
    out."""
    flat = {}
    for key, value in config.items():
        if key in _MTP_SETTINGS:
            continue
        if isinstance(value, dict):
            flat.update(_flat_settings(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value, sort_keys=True)
    return flat


def _check_stored_beside_index(path: Path, shared: Mapping[str, torch.Tensor]) -> None:
    """Refuse a save beside an index whose shared tensors the target's shards do not hold as they are."""
    weight_map, differ = read_index(path)["weight_map"], []
    for key, t in shared.items():
        try:
            with safe_open(str(path / weight_map[key]), framework="pt") as f:
                stored = f.get_tensor(key) if key in f.keys() else None
            same = stored is not None and stored.dtype == t.dtype and torch.equal(stored, t)
        except (KeyError, OSError, SafetensorError):  # not indexed, or not readable
            same = False
        differ += [] if same else [key]
    if differ:
        raise CheckpointError(f"{path}: refusing to save here: the target's shards (by {INDEX_FILE}) do not hold "
                              f"this model's {differ} as they are, and a {SHARED_FILE} beside the index would be "
                              "loaded by transformers in place of every shard (save to a new directory, or pass "
                              "include_shared=False to write only the MTP)")


_DEPTH_KEY = re.compile(re.escape(f"{MTP_PREFIX}layers.") + r"(\d+)\.")


def _refuse_data_loss(path: Path, files: Mapping[str, Mapping[str, torch.Tensor]], *, has_index: bool) -> None:
    """Refuse a save that would destroy tensors it does not own or depths it did not load, or leave a key in two
    files with no index."""
    ours = {k for keys in files.values() for k in keys}
    held = {file.name: _readable_keys(file) for file in sorted(path.glob("*.safetensors")) if file.is_file()}
    problems = []
    for name in files:
        foreign = sorted(k for k in held.get(name) or () if not is_draft_key(k))
        if foreign:
            problems.append(f"replacing {name} would destroy {len(foreign)} tensor(s) this save does not own "
                            f"(e.g. {foreign[:3]})")
    dropped = sorted(_depths(k for keys in held.values() for k in keys or ()) - _depths(ours))
    if dropped:  # a model loaded with num_depths=... saved back over its source, say
        raise CheckpointError(f"{path}: refusing to save here: the checkpoint holds MTP depth(s) {dropped}, which "
                              "this model lacks and the save would drop (save to a new directory)")
    if not has_index:
        for name, keys in held.items():
            if name not in files:
                both = sorted(ours & set(read_header(path / name) if keys is None else keys))  # unreadable: named
                if both:
                    problems.append(f"{name} also holds {len(both)} of the tensors saved (e.g. {both[:3]}) and "
                                    f"there is no {INDEX_FILE} to choose between the copies")
    if problems:
        raise CheckpointError(f"{path}: refusing to save here: " + "; ".join(problems)
                              + " (save to a new directory, or pass include_shared=False to write only the MTP)")


def _readable_keys(file: Path) -> list[str] | None:
    """The raw keys ``file`` holds, read once for every check; None for an unreadable file (it holds nothing to
    lose)."""
    try:
        return list(read_header(file))
    except CheckpointError:
        return None


def _depths(keys: Iterable[str]) -> set[int]:
    """The MTP depth indices raw ``keys`` hold tensors of."""
    return {int(m[1]) for k in keys if (m := _DEPTH_KEY.match(k))}


def _write_json(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, indent=2) + "\n")


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
