"""Raw Inkling checkpoint directory <-> the MTP head's config and named tensors (docs/model.md §3). The file format
lives here alone: this package knows config + safetensors, never the model. ``layout`` holds the names and the key
map, ``reader`` opens, validates and reads a directory, ``target`` lends a live target's shared tensors, ``writer``
saves."""

from ..config import CONFIG_FILE
from .layout import (
    ALIGNMENT,
    INDEX_FILE,
    MTP_FILE,
    MTP_PREFIX,
    SAFETENSORS_DTYPES,
    SHARED_FILE,
    SHARED_KEYS,
    SHARED_RAW_KEYS,
    W13_SUFFIX,
    CheckpointError,
    deinterleave_rows,
    interleave_rows,
    raw_key,
)
from .reader import RawCheckpoint, open_checkpoint, read_header, read_index, stored_dtype
from .writer import save_checkpoint

__all__ = [
    "ALIGNMENT", "CONFIG_FILE", "INDEX_FILE", "MTP_FILE", "MTP_PREFIX", "SAFETENSORS_DTYPES", "SHARED_FILE",
    "SHARED_KEYS", "SHARED_RAW_KEYS", "W13_SUFFIX", "CheckpointError", "RawCheckpoint",
    "deinterleave_rows", "interleave_rows", "open_checkpoint", "raw_key", "read_header", "read_index",
    "save_checkpoint", "stored_dtype",
]
