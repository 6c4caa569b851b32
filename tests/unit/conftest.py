"""Fixtures shared by the suite, report and CLI tests: one run of every stage of the suite on a tiny random GPT-2
(2 layers), and that result saved, loaded back with no model and rendered."""

import pytest

import tl_steering as ts
from tl_steering.backends import ModelInfo
from tl_steering.data.windows import text_windows
from tl_steering.report import render_report
from tl_steering.suite import SuiteResult, default_settings, run_suite

EVIL = "<script>alert('x')</script>&\""


@pytest.fixture(scope="session")
def suite(suite_inputs):
    """One run of every stage on a tiny model (a few seconds)."""
    model, tokens, s = suite_inputs
    return run_suite(model, tokens, s, progress=False, seed=0)


@pytest.fixture(scope="session")
def suite_inputs(tmp_path_factory):
    """The tiny model, its 4 token windows and the quick settings of :func:`suite`."""
    out = tmp_path_factory.mktemp("suite")
    model = ts.tiny_model("gpt2", backend="bridge", seed=0, n_layers=2)
    model._tl_steering_info = ModelInfo(name=f"tiny {EVIL}", revision="random-init seed=0", processing="raw")
    text = out / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    s = default_settings(2, quick=True, windows=4, length=16)
    s.n_bootstrap = 20
    s.critical_n_starts = 2
    s.timing_repeats = 1
    tokens = text_windows(model, source=str(text), n_windows=4, length=16, seed=0)
    return model, tokens, s


@pytest.fixture(scope="session")
def rendered(suite, tmp_path_factory):
    """The suite saved as results.json, loaded back (no model anywhere) and rendered."""
    out = tmp_path_factory.mktemp("report")
    path = suite.save(out / "results.json")
    loaded = SuiteResult.load(path)
    page = render_report(loaded, out)
    return page, loaded
