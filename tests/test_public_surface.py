"""tl_steering's public surface: one list (``tl_steering.PUBLIC``), named in docs/index.md, every name resolving."""

import ast
import re
from pathlib import Path

import tl_steering as ts

ROOT = Path(__file__).resolve().parents[1]


def documented() -> set[str]:
    text = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    section = text.split("## The public surface", 1)[1].split("\n## ", 1)[0]
    section = re.sub(r"\([^)]*\.md\)", "", section)  # links are not names
    return set(re.findall(r"`([A-Za-z_]\w*)`", section)) - {"tl_steering"}


def test_all_is_the_one_list():
    assert ts.__all__ == list(ts.PUBLIC) and len(set(ts.__all__)) == len(ts.__all__)


def test_docs_index_lists_the_public_surface():
    assert documented() == set(ts.__all__)


def test_every_public_name_resolves_and_results_are_classes():
    for name in ts.__all__:
        value = getattr(ts, name)
        assert value is not None, name
        if name.endswith("Result") or name in ("ParallelPlan", "SuiteSettings", "TokenWindows"):
            assert isinstance(value, type), name
    for name in ("run_suite", "SuiteSettings", "Result", "render_report"):
        assert name in ts.__all__


def test_the_surface_is_small():
    """At most 30 names: what a user calls, passes back in, and Result; result classes live in their rooms."""
    assert len(ts.__all__) <= 30, len(ts.__all__)
    assert not [n for n in ts.__all__ if n.endswith("Result") and n != "Result"]


def test_result_classes_stay_importable_from_their_rooms():
    from tl_steering.critical.results import CriticalPointsResult
    from tl_steering.parallel.defect_result import DefectResult
    from tl_steering.probing.result import ProbeResult
    from tl_steering.protocols.deficit import DeficitResult
    from tl_steering.suite import SuiteResult, default_settings

    for cls in (CriticalPointsResult, DefectResult, ProbeResult, DeficitResult, SuiteResult):
        assert issubclass(cls, ts.Result), cls
    assert callable(default_settings)


def test_static_imports_name_the_same_surface():
    """The TYPE_CHECKING imports (for static tools) import exactly the public names."""
    tree = ast.parse((ROOT / "tl_steering" / "__init__.py").read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    names = {a.asname or a.name for n in block.body for a in n.names}
    assert names == set(ts.PUBLIC)
