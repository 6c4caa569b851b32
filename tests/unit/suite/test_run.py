"""The suite runner and its saved result (tl_steering/suite/): every stage fills its fields, the chosen plan is
re-measurable, save / load round trips exactly, the one map of published and pinned numbers, stage subsets."""

import json
import math
import re

import pytest
import torch

import tl_steering as ts
from tl_steering.reference import published_numbers
from tests.helpers import assert_no_hooks
from tl_steering.suite import PINNED, PUBLISHED, STAGES, SuiteResult, SuiteSettings, run_suite


def test_every_stage_fills_its_fields(suite):
    assert set(suite.timings) == set(STAGES)
    # forward passes per stage: checks = the clean pass over 4 windows (one batch); the identity check's window 0 is
    # cut from it. That clean pass is shared (docs/suite.md, "Stages"): the deficit and the critical points run no
    # forward, the ablation only its 4 variants, diversity its 2 ablations and gain 2 (gain 1 is the clean forward)
    assert (suite.timings["checks"].forwards, suite.timings["checks"].tokens) == (1, 4 * 16)
    fw = {name: t.forwards for name, t in suite.timings.items()}
    assert (fw["deficit"], fw["critical"], fw["ablation"], fw["diversity"]) == (0, 0, 4, 3), fw
    for name in (
        "checks",
        "deficit",
        "ablation",
        "diversity",
        "defect",
        "plan",
        "speedup",
        "executor",
        "plan_choice",
        "executor_choice",
        "gates",
        "critical",
        "prefix",
    ):
        assert getattr(suite, name) is not None, name
    assert suite.defect_gold is None  # only when settings.defect_gold_layers is set
    assert suite.critical_fixed_point is None  # one finder fills the critical section
    assert suite.deficit.provenance.corpus == "file:corpus.txt:4x16:seed0"
    assert suite.provenance.corpus == "file:corpus.txt:4x16:seed0"
    # every stage's results carry the corpus label, the critical points' per-layer results too
    assert suite.critical.provenance.corpus == "file:corpus.txt:4x16:seed0"
    assert all(r.provenance.corpus == "file:corpus.txt:4x16:seed0" for r in suite.critical.results)
    assert suite.plan.k == 1 and len(suite.plan.layers) == 1
    assert suite.plan.source.startswith("measured by the suite")  # quick settings: no gold-standard curves
    assert suite.executor.status == "ok"
    # the executor and the surrogate hooks agree on the plan's loss
    assert suite.executor.delta_ce == pytest.approx(suite.plan.delta_ce_lowest, abs=1e-4)
    assert suite.checks.clean_loss == pytest.approx(suite.ablation.clean_loss, abs=1e-5)


def test_plan_choice_is_re_measurable(suite, suite_inputs):
    """The chosen plan (plan_choice stage): the cheap strategies and the peers' scores compared with the linear
    refit, chosen by cross-fitted calibration dCE on windows 0-1; its held-out dCE on windows 2-3 is exactly
    ParallelPlan.hooks(model) on them, every compared plan is also measured uncorrected there, the lowest-C
    comparison is the uncorrected lowest-C plan there, and the executor runs the corrected plan (maps folded)."""
    from tl_steering.data.batching import mean_loss
    from tl_steering.data.windows import token_source
    from tl_steering.hooks import parallel_blocks
    from tl_steering.suite import PLAN_CHOICE_STRATEGIES

    model, tokens, s = suite_inputs
    tokens = token_source(tokens, None)[0]
    cal, held = tokens[:2], tokens[2:]
    pc = suite.plan_choice
    p = pc.plan
    assert p.strategies == list(PLAN_CHOICE_STRATEGIES) == s.plan_choice_strategies
    assert p.requested == "best" and p.strategy in p.strategies and p.refit == "linear"
    assert p.options["refit_crossfit"] and p.linears.shape[0] == p.k
    assert p.k == suite.plan.k == 1 and (p.n_calibration, p.n_held_out) == (2, 2) and p.k_values == [0, 1]
    assert p.options["fisher_samples"] == pc.fisher_samples == s.plan_choice_fisher_samples > 0
    # chosen by calibration dCE among the compared strategies: C (the paper's) unless beaten beyond noise
    from tl_steering.parallel.strategies import choose

    cal_at_k = p.at_k("calibration")
    assert p.reference == "C" and p.calibration_fit == "out-of-fold"
    assert p.strategy == choose(cal_at_k, p.strategies, "C", p.margins) and p.calibration_delta_ce == cal_at_k[p.strategy]
    # the held-out dCE re-measured by running the plan's hooks (with its fitted gates and biases) on held-out windows
    clean_held = mean_loss(model, held, [], s.batch_size)
    direct = mean_loss(model, held, p.hooks(model), s.batch_size) - clean_held
    assert math.isfinite(p.held_out_delta_ce)
    assert direct == pytest.approx(p.held_out_delta_ce, abs=1e-9, rel=0)
    # every compared plan uncorrected on the held-out windows (the report's plan table)
    assert set(p.held_out_curves_uncorrected) == set(p.strategies)
    for strat in p.strategies:
        layers = p.plan_of(strat)
        plain = mean_loss(model, held, parallel_blocks(model, layers), s.batch_size) - clean_held
        assert float(p.held_out_curves_uncorrected[strat][-1]) == pytest.approx(plain, abs=1e-9, rel=0), strat
    assert p.held_out_delta_ce_uncorrected == float(p.held_out_curves_uncorrected[p.strategy][-1])
    # the lowest-C plan, uncorrected, on the same held-out windows, and the ratio
    assert pc.lowest_c_layers == suite.plan.layers
    low = mean_loss(model, held, parallel_blocks(model, suite.plan.layers), s.batch_size) - clean_held
    assert pc.lowest_c_held_out_delta_ce == pytest.approx(low, abs=1e-9, rel=0)
    assert pc.ratio_to_lowest_c == pytest.approx(p.held_out_delta_ce / low, rel=1e-12)
    # the executor ran the chosen plan with its corrections folded in: its loss over all windows is the hooks'
    ex = suite.executor_choice
    assert ex.status == "ok" and ex.layers == p.layers and ex.strategy == p.strategy and ex.correction == "linear"
    assert math.isfinite(ex.measured_speedup) and ex.t_forward_sequential_s == suite.executor.t_forward_sequential_s
    assert ex.delta_ce == pytest.approx(mean_loss(model, tokens, p.hooks(model), s.batch_size)
                                        - suite.checks.clean_loss, abs=1e-4)
    assert_no_hooks(model)


def test_plan_choice_off_and_bad_settings():
    """An empty strategy list turns the stage off (no plan_choice, no executor_choice); unknown names raise."""
    model = ts.tiny_model("gpt2", backend="bridge", seed=0, n_layers=2)
    tokens = torch.randint(0, 100, (2, 8))
    s = SuiteSettings(stages=["checks", "defect", "plan_choice", "parallel"], plan_k=1, defect_evaluate=False,
                      defect_brackets=False, defect_timing=False, defect_n_random=0, parallel_repeats=1,
                      plan_choice_strategies=[])
    res = run_suite(model, tokens, s, progress=False)
    assert res.plan_choice is None and res.executor_choice is None and res.executor.status == "ok"
    s.plan_choice_strategies, s.plan_choice_fisher_samples = ["C", "attribution_2nd"], 0  # 2nd order dropped
    res = run_suite(model, tokens, s, progress=False)
    assert res.plan_choice.plan.strategies == ["C"] and res.executor_choice is not None
    for bad in (dict(plan_choice_strategies=["nope"]), dict(plan_choice_refit="quadratic"),
                dict(plan_choice_fisher_samples=-1)):
        with pytest.raises(ts.errors.InputError, match="plan_choice"):
            run_suite(model, tokens, SuiteSettings(stages=["plan_choice"], **bad), progress=False)


def test_executor_loss_reads_the_timing_passes():
    """The parallel stage times each model on the timing batches in turn and takes a copy's loss over all the windows
    from its first pass over them; with fewer timed calls than batches the rest run untimed: the same loss either
    way, equal to the plan's surrogate hooks (the fused copy rounds differently: float32 tolerance)."""
    from tl_steering.data.batching import mean_loss
    from tl_steering.hooks import parallel_blocks

    model = ts.tiny_model("gpt2", backend="bridge", seed=0, n_layers=2)
    tokens = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(0))
    s = SuiteSettings(stages=["checks", "defect", "parallel"], plan_k=1, defect_evaluate=False, defect_brackets=False,
                      defect_timing=False, defect_n_random=0, parallel_timing_windows=1, parallel_repeats=1)
    few = run_suite(model, tokens, s, progress=False).executor  # warm-up + 1 round: 2 of the 4 batches timed
    s.parallel_repeats = 5
    many = run_suite(model, tokens, s, progress=False).executor  # 6 calls cover the 4 batches
    assert few.status == many.status == "ok" and few.layers == many.layers and len(many.timing_parallel_s) == 5
    assert few.loss == pytest.approx(many.loss, rel=1e-12)
    assert few.loss == pytest.approx(mean_loss(model, tokens, parallel_blocks(model, few.layers)), abs=1e-5)
    # 5 windows in timing batches of 2: only the two full batches are timed (one shape), the last window untimed
    five = torch.randint(0, 100, (5, 8), generator=torch.Generator().manual_seed(1))
    s.parallel_timing_windows = 2
    ex = run_suite(model, five, s, progress=False).executor
    assert ex.status == "ok" and ex.timing_shape == [2, 8]
    assert ex.loss == pytest.approx(mean_loss(model, five, parallel_blocks(model, ex.layers)), abs=1e-5)


@pytest.mark.parametrize("suffix", [".json", ".safetensors"])
def test_suite_result_round_trips_exactly(suite, tmp_path, suffix):
    path = suite.save(tmp_path / f"suite{suffix}")
    loaded = SuiteResult.load(path)
    assert isinstance(loaded, SuiteResult)
    # every tensor (the chosen plan's corrections among them) in suite.safetensors, not in the JSON
    assert json.loads((tmp_path / "suite.json").read_text())["plan_choice"]["plan"]["linears"]["__tensor_ref__"]
    assert loaded.to_dict() == suite.to_dict()  # every field, tensors with dtype, shape and values
    assert torch.equal(loaded.defect.score, suite.defect.score)
    assert loaded.defect.score.dtype == suite.defect.score.dtype
    assert loaded.settings == suite.settings and loaded.plan == suite.plan
    assert loaded.critical.results[0].n_points == suite.critical.results[0].n_points


def test_compare_results_script_diffs_two_saved_results(suite, tmp_path):
    """scripts/compare_results.py on two saved results: no difference between a result and itself (exit 0), and
    a changed number is reported with its field (exit 1)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[3] / "scripts" / "compare_results.py"
    a = suite.save(tmp_path / "a" / "results.json")
    run = [sys.executable, str(script), str(a)]
    same = subprocess.run(run + [str(a)], capture_output=True, text=True)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "0 compared numbers differ" in same.stdout
    doc = json.loads(Path(a).read_text())
    doc["checks"]["clean_loss"] += 0.5
    b = tmp_path / "b" / "results.json"
    b.parent.mkdir()
    b.write_text(json.dumps(doc))
    for f in Path(a).parent.iterdir():  # the tensors the JSON refers to
        if f.suffix != ".json":
            (b.parent / f.name).write_bytes(f.read_bytes())
    diff = subprocess.run(run + [str(b)], capture_output=True, text=True)
    assert diff.returncode == 1 and "checks.clean_loss" in diff.stdout, diff.stdout + diff.stderr


def test_one_map_covers_published_and_pinned_names():
    from tl_steering.reference import pinned_values

    assert sorted(PUBLISHED) == sorted(r["id"] for r in published_numbers())
    assert sorted(PINNED) == sorted(pinned_values()["values"])
    assert all(PINNED[k].tol == v["tol"] for k, v in pinned_values()["values"].items())


def test_stages_subset_and_bad_settings():
    model = ts.tiny_model("gpt2", backend="bridge", seed=0, n_layers=2)
    tokens = torch.randint(0, 100, (2, 8))
    res = run_suite(model, tokens, SuiteSettings(stages=["deficit"], n_bootstrap=0), progress=False)
    assert res.deficit is not None and res.ablation is None and set(res.timings) == {"deficit"}
    assert res.deficit.provenance.corpus.startswith("caller's tokens")
    with pytest.raises(ts.errors.InputError, match="defect"):
        run_suite(model, tokens, SuiteSettings(stages=["gates"]), progress=False)
    with pytest.raises(ts.errors.InputError, match="unknown stages"):
        run_suite(model, tokens, SuiteSettings(stages=["nope"]), progress=False)
