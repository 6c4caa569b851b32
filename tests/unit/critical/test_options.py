"""Every critical entry point runs the one finder with the one set of options (docs/critical_points.md, "The one way
in"): find_equilibria, critical_points, critical_census / census, the suite's settings and default_settings, and
the CLI report path (which builds default_settings). No model is loaded except the tiny one."""

import inspect

import pytest
import torch

import tl_steering as ts
from tl_steering.critical import DEFAULT_FINDER, DEFAULT_OPTIONS, METHODS, FinderOptions, critical_census
from tl_steering.critical.census import census
from tl_steering.critical.options import DEFAULT_N_STARTS, finder_options
from tests.planted import planted_field
from tl_steering.errors import InputError
from tl_steering.suite import SuiteSettings, default_settings
from tl_steering.suite.settings import CRITICAL_METHODS

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]


def test_one_finder_and_its_options_are_the_default_of_every_signature():
    assert METHODS == CRITICAL_METHODS == (DEFAULT_FINDER,) == ("landscape",)
    assert finder_options(None) is DEFAULT_OPTIONS
    for fn in (ts.find_equilibria, ts.critical_points, critical_census, census):
        params = inspect.signature(fn).parameters
        assert "method" not in params and params["options"].default is None, fn.__name__
    assert inspect.signature(ts.find_equilibria).parameters["n_starts"].default == DEFAULT_N_STARTS
    assert inspect.signature(ts.critical_points).parameters["n_starts"].default == DEFAULT_N_STARTS
    assert len(inspect.signature(ts.find_equilibria).parameters) <= 12


def test_the_suite_and_the_report_path_name_the_one_finder():
    assert SuiteSettings().critical_methods == [DEFAULT_FINDER]
    for quick in (False, True):  # the CLI report path builds default_settings(n_layers, quick=...)
        assert default_settings(30, quick=quick).critical_methods == [DEFAULT_FINDER]
    import tl_steering.cli as cli

    assert "default_settings(" in inspect.getsource(cli.run_report)
    for bad in (["flow"], [DEFAULT_FINDER, DEFAULT_FINDER], []):  # a second entry would overwrite the first
        s = SuiteSettings(critical_methods=bad)
        with pytest.raises(InputError, match="one finder"):
            s.check()


def test_find_equilibria_census_and_critical_points_record_the_same_finder_and_options(tiny_tokens):
    p = planted_field(12, seed=0)
    eq = ts.find_equilibria(p, 12, n_starts=4, seed=0)
    assert eq.method == DEFAULT_FINDER
    assert {k: eq.options[k] for k in DEFAULT_OPTIONS.as_dict()} == DEFAULT_OPTIONS.as_dict()
    c = census(p, 12, n_starts=4, seed=0, landscape_solves=8)
    assert c.equilibria.method == DEFAULT_FINDER
    want = {**DEFAULT_OPTIONS.as_dict(), "landscape_solves": 8}  # the census's budget, nothing else
    assert {k: c.equilibria.options[k] for k in want} == want
    model = ts.tiny_model("gpt2", backend="bridge", seed=0)
    cp = ts.critical_points(model, 0, n_starts=2, tokens=tiny_tokens, options=FinderOptions(max_iter=20))
    r = cp.result(0)
    assert r.method == DEFAULT_FINDER and r.options["max_iter"] == 20
    assert cp.provenance.extra["method"] == DEFAULT_FINDER
    # every verified point is an equilibrium of the field by its relative residual
    assert r.n_points >= 1 and bool((r.residuals <= r.options["tol"]).all())
    assert eq.n_points >= 1 and bool((eq.residuals <= 1e-10).all())
    assert torch.equal(torch.tensor(eq.index).sort().values[:1], torch.tensor([0]))  # an attractor among 4 starts
