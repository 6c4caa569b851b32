"""The report end to end on a tiny random GPT-2 (every stage, every file), escaping, and loud failures."""

import json
import re

import pytest

import tl_steering as ts
from tl_steering.backends import ModelInfo
from tl_steering.cli import build_parser
from tl_steering.reference import published_numbers
from tl_steering.report import STAGES, default_settings, run_report
from tl_steering.results import Result

EVIL = "<script>alert('x')</script>&\""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    model = ts.tiny_model("gpt2", backend="bridge", seed=0, n_layers=2)
    model._tl_steering_info = ModelInfo(name=f"tiny {EVIL}", revision="random-init seed=0", processing="raw")
    text = out / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    s = default_settings(2, quick=True, windows=4, length=16)
    s.n_bootstrap = 20
    s.critical_n_starts = 2
    s.parallel_repeats = 1
    s.timing_repeats = 1
    path = run_report(model, text=str(text), out=out / "rep", settings=s, progress=False)
    return path, json.loads((out / "rep" / "results.json").read_text())


def test_writes_page_results_and_figures(report):
    path, doc = report
    assert path.name == "index.html" and path.exists()
    assert set(doc["timings"]) == set(STAGES)
    for name, files in doc["figures"].items():
        for f in files.values():
            assert (path.parent / f).exists(), f
    assert (path.parent / "figures" / "plotly.min.js").exists()
    # every result rebuilds from its dict
    for name, d in doc["results"].items():
        assert isinstance(Result.from_dict(d), Result), name


def test_page_is_self_contained_and_escaped(report):
    path, doc = report
    page = path.read_text()
    assert EVIL not in page and "<script>alert" not in page
    assert "&lt;script&gt;alert" in page
    assert page.count('class="plotly-graph-div"') == len([n for n in doc["figures"]])
    assert not re.search(r'<script[^>]+src="https?://', page), "no external script: the page opens offline"
    from plotly.offline import get_plotlyjs

    assert page.count(get_plotlyjs()[:500]) == 1, "plotly.js inlined exactly once"


def test_comparison_lists_every_published_number(report):
    _, doc = report
    ids = [r["id"] for r in doc["comparison"]]
    assert ids == [r["id"] for r in published_numbers()]
    rel = {r["id"]: r["relation"] for r in doc["comparison"]}
    assert rel["deficit_gpt2"] == "same protocol, other model"
    assert rel["low_trust_auto_summaries"] == "not compared (low trust)"
    assert doc["provenance"]["corpus"].startswith("file:corpus.txt")
    assert doc["plan"]["k"] == 1 and len(doc["plan"]["layers"]) == 1
    assert doc["parallel_executor"]["status"] == "ok"
    # the executor and the surrogate hooks agree on the plan's loss
    assert doc["parallel_executor"]["delta_ce"] == pytest.approx(doc["plan"]["delta_ce_lowest"], abs=1e-4)


def test_missing_protocol_fails_loudly(monkeypatch, tmp_path):
    import tl_steering.report as rep

    monkeypatch.setitem(rep._PROTOCOL_MODULES, "prefix", ("tl_steering.no_such_module", "prefix_sensitivity"))
    with pytest.raises(ts.errors.InputError, match="no_such_module"):
        run_report("smollm2-135m", out=tmp_path, progress=False)


def test_cli_parses_the_readme_command():
    args = build_parser().parse_args(
        ["report", "--model", "smollm2-135m", "--text", "pydoc", "--out", "r", "--quick"]
    )
    assert args.quick and args.model == "smollm2-135m" and args.windows is None
