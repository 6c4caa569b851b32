"""Every entry point plans with the one planner default, ``tl_steering.parallel.strategies.PLANNER``: the default
call of ``plan_parallel``, the suite's ``plan`` stage (the planner's reference, measured uncorrected) and its
``plan_choice`` stage (the planner's comparison and correction) through ``SuiteSettings`` and ``default_settings``,
and the report / CLI path (``run_report`` builds its settings with ``default_settings``). Each check runs the entry
point, so a default that drifts from ``PLANNER`` fails here."""

import inspect

import pytest
import torch

import tl_steering as ts
from tl_steering import cli
from tl_steering.parallel.strategies import FISHER_SAMPLES, PLANNER, STRATEGIES
from tl_steering.suite import SuiteSettings, default_settings, run_suite


def test_the_default_is_one_small_registry():
    assert len(STRATEGIES) <= 12 and set(PLANNER.strategies) <= set(STRATEGIES)
    assert PLANNER.reference in PLANNER.strategies
    params = inspect.signature(ts.plan_parallel).parameters
    assert len(params) <= 12
    assert params["strategy"].default == "best" and params["refit"].default == PLANNER.refit
    assert params["fisher_samples"].default == FISHER_SAMPLES


def test_plan_parallel_default_call(planner_model, planner_tokens):
    p = ts.plan_parallel(planner_model, planner_tokens, 2, batch_size=4)
    assert p.strategies == list(PLANNER.strategies) and p.requested == "best"
    assert p.reference == PLANNER.reference and p.refit == PLANNER.refit
    assert p.options["fisher_samples"] == FISHER_SAMPLES


@pytest.mark.parametrize("quick", [True, False])
def test_settings_use_the_planner_default(quick):
    for s in (SuiteSettings(), default_settings(30, quick=quick)):
        assert s.plan_strategy == PLANNER.reference
        assert s.plan_choice_strategies == list(PLANNER.strategies)
        assert s.plan_choice_refit == PLANNER.refit and s.plan_choice_fisher_samples == FISHER_SAMPLES


def test_run_suite_stages_use_the_planner_default(planner_model):
    tokens = torch.randint(1, 257, (4, 12), generator=torch.Generator().manual_seed(7))
    s = SuiteSettings(stages=["defect", "plan_choice"], plan_k=2, defect_timing=False, defect_brackets=False,
                      defect_n_random=0, batch_size=4)
    res = run_suite(planner_model, tokens, s, progress=False)
    assert res.plan.strategy == PLANNER.reference and res.planner is None
    assert res.plan.layers == res.defect.plan(2)  # the reference plan: the k lowest-C layers
    pc = res.plan_choice.plan
    assert pc.strategies == list(PLANNER.strategies) and pc.reference == PLANNER.reference
    assert pc.refit == PLANNER.refit and pc.options["fisher_samples"] == FISHER_SAMPLES


def test_report_path_uses_the_planner_default(planner_model, monkeypatch, tmp_path):
    seen = {}

    class Stop(Exception):
        pass

    def fake_run_suite(model, tokens, settings, **kw):
        seen["settings"] = settings
        raise Stop

    monkeypatch.setattr("tl_steering.suite.run_suite", fake_run_suite)
    with pytest.raises(Stop):
        cli.run_report(planner_model, out=str(tmp_path / "r"), quick=True, progress=False, windows=2, length=16)
    s = seen["settings"]
    assert s.plan_strategy == PLANNER.reference and s.plan_choice_strategies == list(PLANNER.strategies)
    assert s.plan_choice_refit == PLANNER.refit and s.plan_choice_fisher_samples == FISHER_SAMPLES
