"""Every section citation in the repository resolves to a heading in a file that is in the repository.

A citation is ``<file>.md §<number>`` (``docs/model.md §4.6``, ``protocol.md §6.5``), optionally continued by further
numbers of the same file (``docs/model.md §4.1, §4.9``, ``§4.2-§4.4``). It resolves when the file exists under
``docs/`` (or is ``bench/RESULTS.md``) and has a markdown heading whose text starts with ``§<number>``. The reference
documents the code was first written against are outside the repository, so citing them is an error.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("inkling_compiled", "bench", "tests", "docs", "README.md")
SUFFIXES = (".py", ".md", ".sh", ".toml", ".txt")
ALLOWED_OUTSIDE_DOCS = ("bench/RESULTS.md",)

NUMBER = r"\d+(?:\.\d+)*"
# `file.md §N` (also as a markdown link `[file.md](file.md) §N`), then any run of `, §N` / `; §N` / ` and §N` /
# `-§N` / `-N` continuing the same file
MORE = rf"(?:(?:\s*[,;]\s*|\s+(?:and|or)\s+)§{NUMBER}|[-–]§?{NUMBER})"
CITATION = re.compile(rf"([\w/-]+\.md)`?(?:\]\([^)\s]*\))? §({NUMBER}{MORE}*)")
HEADING = re.compile(rf"^#+\s+§({NUMBER})(?![\d.]*\d)", re.M)
# documents that are not in the repository
FOREIGN = re.compile(r"\b(?:spec|design) §|inkling-mtp\.md|\bdesign\.md")


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        files += [p for p in candidates if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts]
    return [p for p in files if p != Path(__file__).resolve()]


def resolve(name: str) -> Path | None:
    """The cited file: a path from the repository root, or a bare name looked up in docs/ then bench/."""
    name = name.lstrip("/")
    for candidate in (ROOT / name, ROOT / "docs" / name, ROOT / "bench" / name):
        if candidate.is_file():
            rel = candidate.relative_to(ROOT).as_posix()
            return candidate if rel.startswith("docs/") or rel in ALLOWED_OUTSIDE_DOCS else None
    return None


def headings(path: Path) -> set[str]:
    return set(HEADING.findall(path.read_text()))


def citations() -> list[tuple[str, str, list[str]]]:
    """(where, cited file, section numbers) for every citation in the scanned files."""
    found = []
    for path in scanned_files():
        text = path.read_text()
        for match in CITATION.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            where = f"{path.relative_to(ROOT)}:{line}"
            found.append((where, match.group(1), re.findall(NUMBER, match.group(2))))
    return found


def test_docs_exist_with_numbered_headings():
    for name in ("model.md", "protocol.md", "architecture.md", "compile.md"):
        path = ROOT / "docs" / name
        assert path.is_file(), f"docs/{name} is missing"
        numbers = HEADING.findall(path.read_text())
        assert numbers, f"docs/{name} has no '§N' headings"
        repeated = sorted({n for n in numbers if numbers.count(n) > 1})
        assert not repeated, f"docs/{name}: section numbers used by more than one heading: {repeated}"


def test_every_citation_resolves_to_a_heading():
    problems = []
    cache: dict[str, set[str]] = {}
    for where, name, numbers in citations():
        path = resolve(name)
        if path is None:
            problems.append(f"{where}: {name} is not a file under docs/ (or {', '.join(ALLOWED_OUTSIDE_DOCS)})")
            continue
        known = cache.setdefault(name, headings(path))
        problems += [f"{where}: {name} has no heading §{n}" for n in numbers if n not in known]
    assert not problems, "unresolved citations:\n  " + "\n  ".join(problems)


def test_no_citation_of_documents_outside_the_repository():
    found = []
    for path in scanned_files():
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if FOREIGN.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, ("cite docs/<file>.md §N instead (the spec and design documents are not in the repository):\n  "
                       + "\n  ".join(found))


@pytest.mark.parametrize("text, expected", [
    ("see docs/model.md §4.6 step 5", [("docs/model.md", ["4.6"])]),
    ("(docs/model.md §4.1, §4.9; docs/architecture.md §3)", [("docs/model.md", ["4.1", "4.9"]),
                                                            ("docs/architecture.md", ["3"])]),
    ("docs/model.md §4.2-§4.4 and protocol.md §6.1-6.4, §6.7", [("docs/model.md", ["4.2", "4.4"]),
                                                                ("protocol.md", ["6.1", "6.4", "6.7"])]),
    ("docs/model.md §8 items 2 and 10, §9", [("docs/model.md", ["8"])]),
    ("in [protocol.md](protocol.md) §6.6 and `docs/compile.md` §4", [("protocol.md", ["6.6"]),
                                                                    ("docs/compile.md", ["4"])]),
])
def test_citation_pattern(text, expected):
    got = [(m.group(1), re.findall(NUMBER, m.group(2))) for m in CITATION.finditer(text)]
    assert got == expected


def test_heading_pattern_matches_whole_numbers_only():
    text = "## §6 Protocol\n### §6.5 Rounds\n#### §6.50 Other\nnot a heading §7\n"
    assert HEADING.findall(text) == ["6", "6.5", "6.50"]


LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# a backticked path into the repository's own folders: `bench/gpu_check.sh`, `inkling_compiled/model/mtp.py`
REPO_PATH = re.compile(r"`((?:inkling_compiled|bench|tests|docs)/[\w./-]*\.(?:py|md|sh|png|json))`")


def test_every_link_and_cited_path_in_the_docs_exists():
    """A markdown link (relative to the file holding it) or a backticked repository path in the README or docs/ names
    a file that exists: the section check above does not see `[usage](docs/usage.md)` or `bench/gpu_check.sh`."""
    missing = []
    for path in [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        targets = [(path.parent / t, t) for t in LINK.findall(text) if "://" not in t]
        targets += [(ROOT / t, t) for t in REPO_PATH.findall(text) if "NAME" not in t]  # NAME: a placeholder
        missing += [f"{path.relative_to(ROOT)}: {shown}" for target, shown in targets if not target.exists()]
    assert not missing, "links / paths to files that do not exist:\n  " + "\n  ".join(missing)
