"""``atomic_files``: a directory built atomically appears complete or not at all, a concurrent builder's complete copy
wins, and a failed multi-file write leaves the directory as it was (the checkpoint saves' fault injection is in
``tests/test_checkpoint.py``)."""

from pathlib import Path

import pytest

from inkling_compiled.atomic_files import build_directory_atomically, write_files_atomically


def _write(name: str, text: str):
    def build(directory: Path) -> None:
        (directory / name).write_text(text)
    return build


def test_a_built_directory_is_complete(tmp_path):
    final = build_directory_atomically(tmp_path / "a" / "b", _write("done", "ours"), complete="done")
    assert final == tmp_path / "a" / "b" and (final / "done").read_text() == "ours"
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b"]  # no temporary left beside it


def test_a_failed_build_leaves_nothing(tmp_path):
    def build(directory: Path) -> None:
        (directory / "half").write_text("x")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        build_directory_atomically(tmp_path / "pkg", build, complete="done")
    assert list(tmp_path.iterdir()) == []


def test_a_concurrent_builders_complete_copy_wins(tmp_path):
    final = tmp_path / "pkg"

    def build(directory: Path) -> None:  # another process finishes first, while we build
        build_directory_atomically(final, _write("done", "theirs"), complete="done")
        (directory / "done").write_text("ours")

    assert build_directory_atomically(final, build, complete="done") == final
    assert (final / "done").read_text() == "theirs" and [p.name for p in tmp_path.iterdir()] == ["pkg"]


def test_a_concurrent_builders_copy_is_an_error_where_the_first_does_not_win(tmp_path):
    """A directory the caller named (a package): another writer's copy there is not ours to return."""
    final = tmp_path / "pkg"

    def build(directory: Path) -> None:
        build_directory_atomically(final, _write("done", "theirs"), complete="done")
        (directory / "done").write_text("ours")

    with pytest.raises(FileExistsError, match="another writer created it first"):
        build_directory_atomically(final, build, complete="done", first_wins=False)
    assert (final / "done").read_text() == "theirs" and [p.name for p in tmp_path.iterdir()] == ["pkg"]


def test_an_incomplete_directory_in_the_way_is_an_error(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "junk").write_text("x")
    with pytest.raises(OSError):
        build_directory_atomically(tmp_path / "pkg", _write("done", "ours"), complete="done")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]


def test_a_failed_write_of_several_files_changes_nothing(tmp_path):
    (tmp_path / "a").write_text("old a")

    def fail(path: Path) -> None:
        path.write_text("partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_files_atomically(tmp_path, {"a": lambda p: p.write_text("new a"), "b": fail})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"] and (tmp_path / "a").read_text() == "old a"
    write_files_atomically(tmp_path, {"a": lambda p: p.write_text("new a"), "b": lambda p: p.write_text("b")})
    assert (tmp_path / "a").read_text() == "new a" and (tmp_path / "b").read_text() == "b"
