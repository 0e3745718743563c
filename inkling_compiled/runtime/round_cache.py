"""K-depth rounds on CPU packaged on first use and cached on disk (docs/compile.md §12.1).

A compiled K-depth round on CPU is K + 1 compiled calls, each paying Dynamo's guards and Python around microseconds
of kernels; the packaged round (``runtime/packaged.py``) runs the same steps with none of that. So a CPU drafter
with K > 1 packages a (batch bucket, greedy/sampled) round the first time it runs it, into a directory under
:func:`cache_root` named by a hash of everything the code depends on (:func:`entry_name`), and every later drafter,
in this process or another, loads it from there: no export, no compile, no Dynamo.

An entry is an ordinary package of one bucket (``Drafter.load_compiled`` reads it too) whose steps are exported with
the window's rows dynamic, from K to the power of two at or above ``max_length`` (:func:`rows_range`): one entry
serves every window width of its batch bucket, the decode windows K and K + 1 and every prompt's, so a generation
builds one entry, not one per width (a build takes about 1.3x one static bucket's; its rounds run as fast,
docs/compile.md §12.1). Before one is used, its manifest is compared with what this drafter needs
(``packaged.mismatch``: config, dtype, quantization, K, device, torch, pass version) and its layout with the
drafter's; an entry that differs in any of them, or that cannot be read, is refused, removed and built again. A
build that fails (no C++ compiler, a read-only cache) warns and the bucket runs the compiled round instead. A build
takes a minute or two on a small CPU, so it is logged (``logging`` INFO on this module's logger, when it starts and
with its seconds, ``build_s``, when it ends).

``INKLING_COMPILED_ROUNDS`` names the cache directory (default ``~/.cache/inkling_compiled/rounds``); ``off`` turns
the cache off, so every drafter compiles its rounds as on CUDA (where a round is already one CUDA graph and nothing
here applies).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
import warnings
from pathlib import Path

import torch

from .. import arguments
from . import packaged

ENV_VAR = "INKLING_COMPILED_ROUNDS"
_log = logging.getLogger(__name__)
_OFF = ("0", "false", "off", "no")


def cache_root() -> Path | None:
    """Where entries live; None when ``INKLING_COMPILED_ROUNDS`` turns the cache off."""
    value = os.environ.get(ENV_VAR, "").strip()
    if value.lower() in _OFF:
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "inkling_compiled" / "rounds"  # a quoted ~


def rows_range(drafter) -> tuple[int, int]:
    """The window widths an entry serves: K (the narrowest window; 2 for K = 1, as export specializes a dim of one)
    to the widest a call of ``max_length`` rows runs as."""
    low = max(drafter.num_speculative_tokens, 2)
    return low, 1 << (max(drafter.max_length, low) - 1).bit_length()


def entry_layout(drafter, key: tuple[int, bool]) -> dict:
    """The layout a drafter's entry for ``key`` (batch bucket, sampled) records (and an entry must have to serve it):
    its one bucket is exported at the narrowest width of :func:`rows_range`, whatever width first needed it, so that
    an entry's code does not depend on which came first."""
    batch, sampled = key
    return {"max_batch_size": drafter.max_batch_size, "max_length": drafter.max_length,
            "buckets": [[batch, rows_range(drafter)[0], sampled]], "rows": list(rows_range(drafter)),
            "depth_steps": packaged.geometry_depths(drafter)}


def entry_name(drafter, key: tuple[int, bool]) -> str:
    """The entry's directory name: the bucket, readable, and a hash of what its code depends on (the package's
    ``built_for``, the layout, the Inductor options and the thread count its CPU kernels keep)."""
    here = packaged.built_for(drafter.model, drafter._inductor_options, drafter.num_speculative_tokens)
    options = {k: v for k, v in drafter._inductor_options.items() if k != "post_grad_custom_post_pass"}
    record = {"built_for": {k: here[k] for k in packaged.BUILT_FOR}, "layout": entry_layout(drafter, key),
              "options": options, "threads": torch.get_num_threads()}
    digest = hashlib.sha256(json.dumps(record, sort_keys=True, default=repr).encode()).hexdigest()[:20]
    (batch, sampled), (low, high) = key, rows_range(drafter)
    return f"k{drafter.num_speculative_tokens}-b{batch}-r{low}-{high}-{'sampled' if sampled else 'greedy'}-{digest}"


def refusal(drafter, key: tuple[int, bool], directory: Path) -> str | None:
    """Why the entry in ``directory`` cannot serve ``key`` (batch bucket, sampled) of ``drafter`` (None: it can)."""
    try:
        manifest = packaged.read_manifest(directory, layout_fields=packaged.LAYOUT_FIELDS)
    except packaged.PackageError as e:
        return str(e)
    here = packaged.built_for(drafter.model, drafter._inductor_options, drafter.num_speculative_tokens)
    problem = packaged.mismatch(directory, manifest, here)
    if problem is not None:
        return str(problem)
    layout = manifest["layout"]
    wanted = entry_layout(drafter, key)
    differ = [name for name in wanted if json.loads(json.dumps(layout.get(name))) != wanted[name]]
    if differ:
        return f"{directory}: layout {differ} differs from this drafter's"
    if manifest.get("threads") != torch.get_num_threads():
        return f"{directory}: built for {manifest.get('threads')} threads, {torch.get_num_threads()} here"
    return None


def missing(drafter, sampled: bool = False) -> list[int]:
    """The batch buckets whose entry (greedy, or ``sampled``) the cache lacks for ``drafter``: those its first call
    at that bucket would build; [] for a drafter that does not use the cache, or when the cache is off."""
    if not all(hasattr(drafter, name) for name in ("cached_rounds", "batch_buckets", "num_speculative_tokens")):
        # (what a Drafter has: drafter.py imports this module, so no isinstance check against it here)
        raise arguments.ArgumentError(f"drafter must be a Drafter, got {type(drafter).__name__}")
    arguments.check_bool("sampled", sampled)
    root = cache_root()
    if root is None or not drafter.cached_rounds:
        return []
    return [b for b in drafter.batch_buckets if not (root / entry_name(drafter, (b, sampled))).is_dir()]


def cached_rounds(drafter, shape) -> dict:
    """The packaged round of ``shape``'s (batch bucket, sampled) (``_BucketBuffers``) from the cache, built first if
    it is missing, refused or damaged, under the key of every width it serves; {} when the cache is off, the width
    is outside :func:`rows_range` or the build failed (warned), and the bucket runs the compiled round."""
    root = cache_root()
    low, high = rows_range(drafter)
    key = (shape.batch, shape.sampled)
    if root is None or not low <= shape.rows <= high or key in drafter._unpackaged:
        return {}
    directory = root / entry_name(drafter, key)
    try:
        found = _usable(drafter, key, directory) if directory.exists() else None
        if found is None:
            if directory.exists():
                _remove(directory)
            try:
                _build(drafter, shape, directory)
            except packaged.PackageError:
                if not directory.exists():
                    raise
                # else another process built the entry since, and its copy is checked and used
            found = _usable(drafter, key, directory)
            if found is None:
                raise packaged.PackageError(refusal(drafter, key, directory) or f"{directory} cannot be loaded")
        return found
    except (OSError, RuntimeError, ValueError) as e:  # PackageError is a ValueError
        drafter._unpackaged.add(key)  # not tried again by this drafter at its other widths
        warnings.warn(f"could not build or load the packaged round of bucket {shape.key} in {directory} "
                      f"({type(e).__name__}: {e}); running the compiled round instead", RuntimeWarning, stacklevel=4)
        return {}


def _build(drafter, shape, directory: Path) -> None:
    batch, sampled, rows = shape.batch, shape.sampled, rows_range(drafter)
    _log.info("packaging the K = %d round of batch bucket %d (%s, %d to %d rows) into %s (once per machine)",
              drafter.num_speculative_tokens, batch, "sampled" if sampled else "greedy", *rows, directory)
    start = time.perf_counter()
    example = type(shape)(drafter, batch, rows[0], sampled)  # at the narrowest width (entry_layout)
    packaged.save_rounds(drafter, directory, [example], rows=rows, cache=True)
    seconds = time.perf_counter() - start
    _log.info("packaged the round of batch bucket %d (%s) in %.1f s", batch, "sampled" if sampled else "greedy",
              seconds, extra={"build_s": seconds, "directory": str(directory)})


def _usable(drafter, key: tuple[int, bool], directory: Path) -> dict | None:
    """The entry's rounds, or None when it is refused or cannot be loaded (a corrupt or missing step file)."""
    if refusal(drafter, key, directory) is not None:
        return None
    try:
        manifest = packaged.read_manifest(directory, layout_fields=packaged.LAYOUT_FIELDS)
        return packaged.load_rounds(drafter, directory, manifest)
    except packaged.PackageError:
        return None


def _remove(directory: Path) -> None:
    """Out of the way first (a rename is atomic), then deleted: a reader never sees half an entry."""
    doomed = directory.with_name(f".stale-{directory.name}-{uuid.uuid4().hex[:8]}")
    with contextlib.suppress(FileNotFoundError):  # another process moved it first
        os.rename(directory, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
