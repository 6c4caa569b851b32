"""Every documentation reference in the repository resolves inside the repository.

Scans the package, the docs, the README, CONTRIBUTING, the tutorials, the benchmarks, the scripts and the tests for
(1) a cited ``.md`` file or ``docs/`` path that does not exist, and (2) any mention of the founders' design notes
that live outside the repository (MATH_SPEC, PAPER_SUMMARY, TRANSFORMERLENS, OFFLINE_MODELS.md, STYLE.md, or a bare
section mark): a reader of the repository cannot follow those. Pure file reading, well under a second.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["tl_steering", "docs", "README.md", "CONTRIBUTING.md", "tutorials", "benchmarks", "scripts", "tests", ".ci"]
SELF = Path(__file__).resolve()  # this file names the patterns it looks for
SUFFIXES = {".py", ".md", ".ipynb", ".sh", ".txt", ".toml", ".json", ".cfg", ".yml", ".yaml", ".html", ".css"}

OUTSIDE_NOTES = re.compile(r"MATH_SPEC|PAPER_SUMMARY|TRANSFORMERLENS|OFFLINE_MODELS\.md|\bSTYLE\.md|§")
# "§N" alone is a section of those notes too: the repository's own pages are cited by path (docs/<page>.md)
# a path-like token ending in .md, or starting with docs/ (no spaces, no glob or placeholder characters)
MD_PATH = re.compile(r"(?<![\w./:-])((?:\.\.?/)?[\w.-]+(?:/[\w.-]+)*\.md)\b")
DOCS_PATH = re.compile(r"(?<![\w./:-])(docs/[\w./-]*)")


def scanned_files() -> list[Path]:
    out: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            out.append(path)
        elif path.is_dir():
            out += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                          and "__pycache__" not in p.parts and ".ipynb_checkpoints" not in p.parts)
    return [p for p in out if p.resolve() != SELF]


def resolves(ref: str, source: Path) -> bool:
    """A reference resolves relative to the citing file, to the repository root, or to docs/."""
    ref = ref.split("#", 1)[0].rstrip(".")
    if not ref:
        return True
    return any((base / ref).exists() for base in (source.parent, ROOT, ROOT / "docs"))


def bad_references(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    problems = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in OUTSIDE_NOTES.finditer(line):
            problems.append(f"{path.relative_to(ROOT)}:{lineno}: cites {m.group(0)} (not in the repository; "
                            "cite the docs/ page that holds it)")
        seen: set[str] = set()
        for m in [*MD_PATH.finditer(line), *DOCS_PATH.finditer(line)]:
            ref = m.group(1).rstrip(".")
            word_start = max(line.rfind(c, 0, m.start()) for c in " (<[\"'`") + 1
            if ref in seen or "://" in line[word_start:m.start()] or OUTSIDE_NOTES.search(ref):
                continue  # reported once; part of a URL; or already reported as an outside note
            seen.add(ref)
            if not resolves(ref, path):
                problems.append(f"{path.relative_to(ROOT)}:{lineno}: {ref} does not exist in the repository")
    return problems


def test_the_scan_sees_the_package_and_the_docs():
    files = {p.relative_to(ROOT).as_posix() for p in scanned_files()}
    assert "tl_steering/geometry.py" in files and "docs/index.md" in files and "README.md" in files


def test_the_checker_flags_missing_pages_and_outside_notes(tmp_path):
    fake = ROOT / "docs" / "index.md"  # resolve relative to a real docs file
    assert resolves("geometry.md", fake) and resolves("docs/geometry.md", ROOT / "tl_steering" / "x.py")
    assert not resolves("docs/no_such_page.md", fake)
    assert OUTSIDE_NOTES.search("see MATH_SPEC") and OUTSIDE_NOTES.search("(§4)")
    assert not OUTSIDE_NOTES.search("OFFLINE_MODELS = (...)")
    assert [m.group(1) for m in MD_PATH.finditer("(see docs/deficit.md, [x](geometry.md#notation))")] == \
        ["docs/deficit.md", "geometry.md"]


@pytest.mark.parametrize("path", scanned_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_doc_reference_resolves_in_the_repository(path):
    problems = bad_references(path)
    assert not problems, "\n".join(problems)
