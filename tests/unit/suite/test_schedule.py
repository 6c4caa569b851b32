"""The schedule of a suite run on several ranks (tl_steering/suite/schedule.py): which rank runs which stage, the
fields each stage hands on, and a stage reading another rank's result. The runs on two processes are in
tests/unit/probing/test_scan.py (test_suite_on_two_processes_equals_one_process*)."""

import dataclasses
import math

import pytest

from tl_steering.suite import STAGES, SuiteResult, default_settings
from tl_steering.suite.schedule import READS, SMOLLM2_DIMS, STAGE_FIELDS, WINDOW_STAGES, Exchange, StageView, \
    _finish_times, assign_stages, jacobian_per_forward, stage_costs
from tl_steering.data.sharding import World

_META = {"provenance", "settings", "seed", "model", "environment", "started", "timings", "total_wall_s", "arguments",
         "distributed"}


def test_stage_fields_are_the_fields_the_stages_fill(suite):
    """Every field a stage filled in a one-process run (every stage) is listed under exactly one stage, and every
    listed name is a field: what a rank sends after a stage is all that stage wrote."""
    fields = {f.name for f in dataclasses.fields(SuiteResult)}
    listed = [f for names in STAGE_FIELDS.values() for f in names]
    assert len(listed) == len(set(listed)) and set(listed) <= fields and set(STAGE_FIELDS) == set(STAGES)
    filled = {f for f in fields - _META if getattr(suite, f) is not None}
    assert filled <= set(listed) and fields - _META == set(listed)
    # defect_gold and planner only with their settings; critical_fixed_point only in older files (its finder left)
    assert filled == set(listed) - {"defect_gold", "planner", "critical_fixed_point"}
    for name, (first, last) in READS.items():  # a stage reads only stages before it: no rank waits in a circle
        assert all(STAGES.index(d) < STAGES.index(name) for d in first + last), name


def _ratio(s, n_windows, length, size):
    """The schedule's predicted time on ``size`` ranks over the one-process time (the same cost model)."""
    plan = assign_stages(list(STAGES), s, n_windows, length, size)
    n_b = math.ceil(n_windows / s.batch_size)
    cost = {}
    for name, (win, plans, fixed) in stage_costs(s, n_windows, length).items():
        cost[f"{name}@1"] = win + plans + fixed
        cost[f"{name}@{size}"] = win * math.ceil(n_b / size) / n_b + plans / size + fixed
    return plan, max(_finish_times(plan, cost, size).values()) / sum(cost[f"{n}@1"] for n in STAGES)


def test_the_quick_report_splits_over_two_ranks():
    """SmolLM2's quick report (30 layers, 4 x 64, one batch): plan_choice and the executor (which reads its plan)
    on one rank, both ranks busy; predicted at most 0.6 of one process, the same placement on every call (every
    rank)."""
    s = default_settings(30, quick=True)
    plan, ratio = _ratio(s, 4, 64, 2)
    assert plan["plan_choice"] == plan["parallel"] and {plan[n] for n in STAGES} == {(0,), (1,)}
    assert 0.5 <= ratio <= 0.6
    assert assign_stages(list(STAGES), s, 4, 64, 1) == {n: (0,) for n in STAGES}
    assert assign_stages(list(STAGES), s, 4, 64, 2) == plan


def test_window_stages_split_when_there_are_batches_for_every_rank():
    """64 windows in batches of 8: the window stages run on all 4 ranks; one batch: never (a rank would idle).
    The full report's gold standard splits its plans over the ranks whatever the batches."""
    s = default_settings(30, quick=False)
    plan, ratio = _ratio(s, 64, 128, 4)
    assert all(plan[n] == (0, 1, 2, 3) for n in ("checks", "deficit", "ablation", "diversity")), plan
    assert ratio < 0.55
    plan, _ = _ratio(dataclasses.replace(s, defect_evaluate=False), 8, 128, 2)
    assert all(len(plan[n]) == 1 for n in WINDOW_STAGES), plan
    assert stage_costs(s, 8, 128)["defect"][1] > 0 and stage_costs(default_settings(30, True), 4, 64)["defect"][1] == 0


def test_critical_points_weigh_by_the_model_width():
    """The critical stage costs float64 FFN Jacobians, not forwards of the run's tokens: per token it falls with
    the tokens and grows with the width faster than a forward does. On the tiny model (d_model 64, 6 x 16
    tokens) it outweighs any two other stages together, so its rank runs only light stages beside it."""
    s = dataclasses.replace(default_settings(2, quick=True, windows=6, length=16), batch_size=2, critical_n_starts=2)
    tiny = (2, 64, 256, 257)
    cost = {n: sum(c) for n, c in stage_costs(s, 6, 16, tiny).items()}
    assert cost["critical"] > sum(sorted(v for n, v in cost.items() if n != "critical")[-2:]), cost
    plan = assign_stages(list(STAGES), s, 6, 16, 2, tiny)
    beside = [n for n in STAGES if plan[n] == plan["critical"] and n != "critical"]
    assert sum(cost[n] for n in beside) < cost["critical"] / 4, plan
    crit = {k: stage_costs(s, n, length, SMOLLM2_DIMS)["critical"][1] for k, (n, length) in
            {"small": (4, 64), "large": (8, 128)}.items()}
    assert crit["large"] == pytest.approx(crit["small"] / 4, rel=1e-12)
    wider = (30, 2 * 576, 2 * 1536, 49152)  # a Jacobian costs 8x, a forward between 2x and 4x
    assert 2.0 < jacobian_per_forward(wider) / jacobian_per_forward(SMOLLM2_DIMS) < 4.0


class _Recorder(Exchange):
    """An exchange whose other rank is a dict: what :meth:`receive` would get from it."""

    def __init__(self, plan, remote):
        super().__init__(World(rank=0, size=2, backend="gloo"), plan)
        self.remote, self.calls = remote, []

    def receive(self, name, res):
        if name in self.got or name not in self.plan or self.runs_here(name):
            return
        self.calls.append(name)
        for f, v in self.remote[name].items():
            setattr(res, f, v)
        self.got.add(name)


def test_a_stage_reads_another_ranks_result_when_it_needs_it(monkeypatch):
    """Reading a field that a stage on the other rank fills receives that stage (once); a field of a stage run
    here, or of no stage, is read as it is; writes land on the result."""
    monkeypatch.setattr("tl_steering.suite.schedule.p2p_group", lambda w: None)
    res = SuiteResult()
    ex = _Recorder({"checks": (1,), "defect": (1,), "plan_choice": (0,)}, {"defect": {"plan": "P", "defect": "D"}})
    view = StageView(res, ex)
    assert view.plan_choice is None and view.seed == res.seed and ex.calls == []
    assert view.plan == "P" and view.defect == "D" and ex.calls == ["defect"]
    view.plan_choice = "C"
    assert res.plan_choice == "C" and view.plan_choice == "C" and ex.calls == ["defect"]
    with pytest.raises(AttributeError):
        view.no_such_field


def test_a_stage_that_fails_on_one_rank_fails_on_the_others(monkeypatch):
    """Rank 1's defect raises: rank 0, reading the defect plan, raises the same error instead of waiting."""
    from tl_steering.errors import InputError

    mailbox = {}
    monkeypatch.setattr("tl_steering.suite.schedule.p2p_group", lambda w: None)
    monkeypatch.setattr("tl_steering.suite.schedule.send_object",
                        lambda obj, dst, tag, w: mailbox.setdefault((w.rank, dst, tag), obj) and (lambda: None))
    monkeypatch.setattr("tl_steering.suite.schedule.recv_object",
                        lambda src, tag, w: mailbox.pop((src, w.rank, tag)))
    plan = {"defect": (1,), "plan_choice": (0,)}
    one = Exchange(World(rank=1, size=2, backend="gloo"), plan)
    one.publish("defect", SuiteResult(), error=InputError("no sequential layer"))
    zero = Exchange(World(rank=0, size=2, backend="gloo"), plan)
    with pytest.raises(InputError, match="no sequential layer"):
        StageView(SuiteResult(), zero).plan
    assert not mailbox


def test_rank_0_shows_the_stages_other_ranks_run_in_their_place(capsys):
    """Under ranks, rank 0 draws the bars of its own stages and one line for each stage another rank runs, so that
    the numbering has no gap (run_suite calls ``elsewhere`` where it skips a stage); a silent progress prints none."""
    from tl_steering.suite.progress import TqdmProgress

    TqdmProgress(True).elsewhere("defect", (1,))
    TqdmProgress(False).elsewhere("ablation", (0, 1))
    assert capsys.readouterr().err == f"[5/{len(STAGES)}] defect   : on rank 1\n"


def test_the_critical_stage_splits_its_layers_where_that_shortens_the_run():
    """The critical stage runs on every rank, a layer each in turn, when that ends the run sooner by the schedule's
    weights: not on the report's defaults (3 layers; the chain plan_choice -> parallel is longer), but with 15
    layers on 4 ranks; never with fewer layers than ranks. Its weight on N ranks is ceil(layers / N) layers."""
    s = default_settings(30)
    for size in (2, 4):
        assert len(assign_stages(list(STAGES), s, 8, 128, size)["critical"]) == 1
    many = dataclasses.replace(s, critical_layers=list(range(0, 30, 2)))
    plan = assign_stages(list(STAGES), many, 8, 128, 4)
    assert plan["critical"] == (0, 1, 2, 3), plan
    one = dataclasses.replace(s, critical_layers=[15])
    assert len(assign_stages(["critical"], one, 8, 128, 2)["critical"]) == 1  # one layer: nothing to split
    three = assign_stages(["critical"], dataclasses.replace(s, critical_layers=[0, 1, 2]), 8, 128, 2)
    assert three["critical"] == (0, 1)  # alone, 2 of 3 layers a rank beat 3 on one
    cost = sum(stage_costs(many, 8, 128)["critical"])
    assert stage_costs(many, 8, 128)["critical"] == (0.0, pytest.approx(cost), 0.0)
