"""A ParallelPlan's tensors in the safetensors file beside its JSON (tl_steering.results): exact round trip of a
linear-corrected plan, and plan files written before still load."""

import json

import pytest
import torch

import tl_steering as ts
from tl_steering.errors import ResultFileError


@pytest.fixture(scope="module")
def linear_plan(planner_model):
    toks = torch.randint(1, 257, (4, 12), generator=torch.Generator().manual_seed(5))
    return ts.plan_parallel(planner_model, toks[:2], 2, held_out=toks[2:], strategy=["C", "attribution_abs"],
                            k_values=[2], batch_size=2, fisher_samples=0, refit="linear")


def _same(a, b) -> None:
    for name in ("gates", "biases", "linears"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == torch.float64 and x.shape == y.shape, name
        assert torch.equal(x.view(torch.int64), y.view(torch.int64)), name  # bit for bit
    assert a.layers == b.layers and a.held_out_delta_ce == b.held_out_delta_ce and a.plans == b.plans


def test_linear_plan_round_trip_is_exact(linear_plan, tmp_path):
    p = linear_plan
    assert p.refit == "linear" and p.linears.shape == (2, 32, 32) and float(p.linears.abs().max()) > 0
    path = p.save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    assert data["__sidecar__"]["file"] == "plan.safetensors" and (tmp_path / "plan.safetensors").exists()
    assert all("__tensor_ref__" in data[name] for name in ("gates", "biases", "linears"))  # not in the JSON
    back = ts.ParallelPlan.load(path)
    _same(p, back)
    # the loaded plan runs: its maps are the plan's, ready for parallelize(..., linears=)
    assert back.linear_maps().keys() == p.linear_maps().keys()


def test_tensors_file_missing_is_a_clear_error(linear_plan, tmp_path):
    path = linear_plan.save(tmp_path / "plan.json")
    (tmp_path / "plan.safetensors").unlink()
    with pytest.raises(ResultFileError, match="tensors file 'plan.safetensors' is not beside it"):
        ts.ParallelPlan.load(path)


ISSUE_36 = ("refit_requested", "calibration_fit", "calibration_note", "reference", "choice_rule", "margins",
            "margins_uncorrected", "calibration_intervals", "held_out_intervals", "held_out_intervals_uncorrected",
            "calibration_delta_ce_interval", "held_out_delta_ce_interval",
            "calibration_delta_ce_uncorrected_interval", "held_out_delta_ce_uncorrected_interval", "interval")


def test_old_plan_files_still_load(linear_plan, tmp_path):
    """A plan file of before issue 30 (tensors inline in the JSON, no held_out_curves_uncorrected) and one of
    before issue 36 (no intervals, no reference rule, no record of the calibration fit) load, with the defaults."""
    for dropped in (("held_out_curves_uncorrected",) + ISSUE_36, ISSUE_36):
        data = linear_plan.to_dict()
        for name in dropped:
            del data[name]
        old = tmp_path / "old.json"
        old.write_text(json.dumps(data))
        back = ts.ParallelPlan.load(old)
        _same(linear_plan, back)
        assert back.held_out_intervals == {} and back.calibration_fit == "" and back.reference == ""
        assert all(v != v for v in back.held_out_delta_ce_interval)  # NaN: not known
        s = back.summary()  # the summary of an old plan: its figures, intervals unknown
        assert s["held_out_delta_ce"] == linear_plan.held_out_delta_ce and "held_out_delta_ce_C_interval" not in s
    assert back.held_out_curves_uncorrected == linear_plan.held_out_curves_uncorrected
    # and the new fields round-trip
    again = ts.ParallelPlan.load(linear_plan.save(tmp_path / "new.json"))
    assert again.margins == linear_plan.margins and again.interval == linear_plan.interval
    for s in linear_plan.strategies:
        assert torch.equal(again.held_out_intervals[s], linear_plan.held_out_intervals[s])


def test_tensors_of_another_save_are_refused(linear_plan, tmp_path):
    """A tensors file of another save (the JSON records its SHA-256) is refused."""
    other = tmp_path / "other.json"
    linear_plan.save(other)
    data = json.loads(other.read_text())
    data["__sidecar__"]["sha256"] = "0" * 64
    other.write_text(json.dumps(data))
    with pytest.raises(ResultFileError, match="SHA-256"):
        ts.ParallelPlan.load(other)
