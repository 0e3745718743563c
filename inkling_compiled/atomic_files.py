"""Atomic writes of files into a directory, and of a whole new directory: what a reader finds is the old state or
the new one, never a half-written file. Used by checkpoint saves (``checkpoint/writer.py``), packaged steps
(``runtime/packaged.py``) and the cached checkpoints of ``testing/`` and ``training/``."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path


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


def build_directory_atomically(final, build: Callable[[Path], None], *, complete: str, first_wins: bool = True
                               ) -> Path:
    """Create ``final`` by ``build``-ing it under a temporary sibling name and renaming it into place, so that a
    directory that exists is complete. If a concurrent builder got there first (``final/complete`` exists), its
    copy wins and ours is discarded (a cache, where either copy serves), or with ``first_wins=False`` (a directory
    the caller named) FileExistsError; on any failure nothing is left behind."""
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
            if not first_wins:
                raise FileExistsError(errno.EEXIST, "another writer created it first", str(final)) from None
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)
    return final
