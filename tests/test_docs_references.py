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


# ``ts.NAME`` (the README's ``import tl_steering as ts``) and dotted ``tl_steering.a.b`` names in prose and code
TS_NAME = re.compile(r"(?<![\w.])ts\.([A-Za-z_]\w*)")
DOTTED = re.compile(r"(?<![\w./-])(tl_steering(?:\.[A-Za-z_]\w*)+)")
USER_DOCS = ["docs", "README.md", "CONTRIBUTING.md", "tutorials"]


def _resolve_dotted(name: str) -> bool:
    """Whether ``tl_steering.a.b...`` names a module or an attribute (an import of each prefix, then getattr)."""
    import importlib

    parts = name.split(".")
    obj = None
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        rest = parts[i:]
        break
    else:
        return False
    for attr in rest:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def test_every_name_the_docs_use_exists():
    """A reader copies ``ts.wrap_hf`` from a page and gets AttributeError: every ``ts.NAME`` in the user docs is an
    attribute of ``tl_steering``, and every dotted ``tl_steering.a.b`` a module or attribute."""
    import tl_steering as ts

    files = [p for name in USER_DOCS for p in ([ROOT / name] if (ROOT / name).is_file() else
                                                sorted((ROOT / name).rglob("*")))
             if p.is_file() and p.suffix in (".md", ".ipynb")]
    assert len(files) > 10
    missing = set()
    for p in files:
        text = p.read_text(encoding="utf-8")
        missing |= {f"{p.relative_to(ROOT)}: ts.{n}" for n in TS_NAME.findall(text) if not hasattr(ts, n)}
        missing |= {f"{p.relative_to(ROOT)}: {n}" for n in DOTTED.findall(text.replace("\\n", "\n"))
                    if not _resolve_dotted(n.rstrip("."))}
    assert sorted(missing) == []
