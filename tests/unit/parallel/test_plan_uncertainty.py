"""What a plan knows (issue 36; docs/parallel.md "Uncertainty and the choice"):

* a calibration set too small to cross-fit (one window) is recorded in the plan and warned once, and the linear
  correction is fitted with the ridge the tokens carry (effective degrees of freedom at most half the tokens);
* every dCE a plan reports carries an interval (two-stage bootstrap over windows and token blocks) that contains
  it, recomputed here from per-token losses written independently of PlanLoss;
* ``"best"`` keeps the reference (C) unless a strategy beats it by more than the paired interval.
"""

import warnings

import pytest
import torch

import tl_steering as ts
from tests.helpers import assert_no_hooks
from tl_steering.backends import adapt
from tl_steering.hooks import parallel_blocks
from tl_steering.parallel import strategies as st
from tl_steering.parallel.refit import carried_max_df, carried_refit, fit_corrections
from tl_steering.stats import Moments, ridge_df
from tl_steering.stats import block_length, block_sums, cluster_bootstrap_ci

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TWO = ["C", "attribution_abs"]


def _tokens(n: int, pos: int = 12, seed: int = 7) -> torch.Tensor:
    return torch.randint(1, 257, (n, pos), generator=torch.Generator().manual_seed(seed))


def _planner_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if str(w.message).startswith("plan_parallel:")]


def test_one_calibration_window_is_recorded_and_warned_once(planner_model):
    toks = _tokens(2)  # held_out=None: window 0 calibrates, window 1 is held out
    plan, said = _planner_warnings(lambda: ts.plan_parallel(planner_model, toks, 2, strategy=TWO, fisher_samples=0))
    assert len(said) == 1 and "too small to cross-fit" in said[0] and "in-sample" in said[0]
    assert plan.calibration_fit == "in-sample" and plan.calibration_note == said[0].removeprefix("plan_parallel: ")
    assert plan.refit == plan.refit_requested == "linear" and plan.options["refit_carry"] is True
    assert plan.summary()["calibration_note"] == plan.calibration_note
    assert plan.summary()["calibration_fit"] == "in-sample"
    # compared in-sample: a strategy must beat C beyond noise with AND without its correction
    assert set(plan.margins) == set(plan.margins_uncorrected) == set(TWO) and "also without" in plan.choice_rule
    assert plan.strategy == st.choose(plan.at_k("calibration"), TWO, "C", plan.margins, plan.margins_uncorrected)
    # the stored maps are the carried fit: the ridge raised until df <= 11 / 2 - 1 - 1/32 (11 fitted tokens)
    carried, plain = {}, {}
    fit_corrections(planner_model, toks[:1], plan.layers, "linear", linears=carried, carry=True)
    fit_corrections(planner_model, toks[:1], plan.layers, "linear", linears=plain)
    for i, lay in enumerate(plan.layers):
        # the planner fits inside its measuring forward (shared prefix), fit_corrections by a whole forward: equal
        # to float32 roundoff of the activations (as test_gold's prefix-sharing fits)
        torch.testing.assert_close(plan.linears[i], carried[lay], rtol=1e-4, atol=1e-6)
        assert float((carried[lay] - plain[lay]).abs().max()) > 1e-3 * float(plain[lay].abs().max())
    # two calibration windows: cross-fitted, nothing to say
    plan2, said2 = _planner_warnings(lambda: ts.plan_parallel(planner_model, _tokens(4), 2, strategy=TWO,
                                                              fisher_samples=0))
    assert said2 == [] and plan2.calibration_fit == "out-of-fold" and plan2.calibration_note == ""
    # the affine correction on 2 windows: in-sample by default, recorded, not warned; no correction: "none"
    plan3, said3 = _planner_warnings(lambda: ts.plan_parallel(planner_model, _tokens(4), 2, strategy=TWO,
                                                              fisher_samples=0, refit="affine"))
    assert said3 == [] and plan3.calibration_fit == "in-sample" and plan3.options["refit_carry"] is False
    plan4, said4 = _planner_warnings(lambda: ts.plan_parallel(planner_model, toks, 2, strategy=TWO,
                                                              fisher_samples=0, refit="none"))
    assert said4 == [] and plan4.calibration_fit == "none"
    assert_no_hooks(planner_model)


def test_carried_ridge_and_refit_rule():
    """Moments.solve_linear(max_df=): the ridge whose effective degrees of freedom are max_df, and W the ridge
    regression at that ridge, written here on the data."""
    g = torch.Generator().manual_seed(2)
    n, d = 7, 8
    a = torch.randn(1, n + 1, d, generator=g, dtype=torch.float64)
    p = torch.randn(1, n + 1, d, generator=g, dtype=torch.float64)
    y = 0.8 * p + a @ torch.randn(d, d, generator=g, dtype=torch.float64) + 0.1 * torch.randn(1, n + 1, d, generator=g,
                                                                                             dtype=torch.float64)
    m = Moments(d, linear=True)
    m.add(y, p, (0,), a)  # position 0 excluded: n tokens
    cap = carried_max_df(n, d)
    assert cap == pytest.approx(n / 2 - 1 - 1 / d, abs=0)
    gate, _, w = m.solve_linear(max_df=cap)
    a0, r0 = a[0, 1:], y[0, 1:] - gate * p[0, 1:]
    ac, rc = a0 - a0.mean(0), r0 - r0.mean(0)
    eig = torch.linalg.eigvalsh(ac.T @ ac)
    # the ridge that gives this W: solve for it from df = cap, then compare W with the regression at it
    lo, hi = 1e-12, 1e12
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ridge_df(eig, mid) > cap else (lo, mid)
    want = torch.linalg.solve(ac.T @ ac + hi * torch.eye(d, dtype=torch.float64), ac.T @ rc)
    torch.testing.assert_close(w, want, rtol=1e-7, atol=1e-10)
    assert ridge_df(eig, hi) == pytest.approx(cap, rel=1e-9)
    # the default ridge has more degrees of freedom here (the cap binds), and a loose cap changes nothing
    _, _, w_default = m.solve_linear()
    assert ridge_df(eig, float(torch.trace(ac.T @ ac)) / d) > cap
    assert torch.equal(m.solve_linear(max_df=float(d))[2], w_default)
    # the refit rule: affine and linear need 3 tokens (1 + 1/d parameters per coordinate, at most half a token
    # each), the gate 1; never richer than asked
    assert [carried_refit("linear", t, 576) for t in (1, 2, 3, 31)] == ["gate", "gate", "linear", "linear"]
    assert carried_refit("affine", 31, 576) == "affine" and carried_refit("none", 31, 576) == "none"


@pytest.fixture(scope="module")
def plans(planner_model):
    toks = _tokens(8)
    kw = {"held_out": toks[4:], "strategy": ["C", "attribution_abs", "sleb", "random"],
          "k_values": [0, 1, 2], "batch_size": 4, "fisher_samples": 0, "seed": 3}
    return (toks, ts.plan_parallel(planner_model, toks[:4], 2, refit="none", **kw),
            ts.plan_parallel(planner_model, toks[:4], 2, refit="linear", **kw))


def test_every_figure_has_an_interval_that_contains_it(plans):
    _, none, lin = plans
    for p in (none, lin):
        pairs = [(p.calibration_curves, p.calibration_intervals), (p.held_out_curves, p.held_out_intervals)]
        if p is lin:
            pairs.append((p.held_out_curves_uncorrected, p.held_out_intervals_uncorrected))
        for curves, intervals in pairs:
            assert set(intervals) == set(curves) == set(p.strategies)
            for s, iv in intervals.items():
                assert iv.shape == (3, 2) and iv.dtype == torch.float64
                y = curves[s]
                assert bool(((iv[:, 0] <= y) & (y <= iv[:, 1])).all()), (s, iv, y)
                assert iv[0].tolist() == [0.0, 0.0]  # k = 0 is the clean model: no uncertainty
                assert bool((iv[1:, 1] > iv[1:, 0]).all())
        j = p.k_values.index(p.k)
        assert p.calibration_delta_ce_interval == p.calibration_intervals[p.strategy][j].tolist()
        assert p.held_out_delta_ce_interval == p.held_out_intervals[p.strategy][j].tolist()
        for name in ("calibration_delta_ce", "held_out_delta_ce", "calibration_delta_ce_uncorrected",
                     "held_out_delta_ce_uncorrected"):
            lo, hi = getattr(p, name + "_interval")
            assert lo <= getattr(p, name) <= hi, name
        s = p.summary()
        assert s["held_out_delta_ce_interval"] == p.held_out_delta_ce_interval
        assert all(f"{w}_delta_ce_{st_}_interval" in s for w in ("held_out", "calibration") for st_ in p.strategies)
        assert p.interval["level"] == 0.95 and p.interval["n_bootstrap"] == 1000
        assert p.interval["block_tokens_calibration"] == block_length(11) == 2
    assert lin.calibration_fit == "out-of-fold" and none.calibration_fit == "none"


def test_intervals_recomputed_from_per_token_losses(planner_model, plans):
    """The held-out intervals of the uncorrected plans from the adapter's own per-token loss (a whole forward, not
    PlanLoss's shared prefix), blocked and resampled with the same seed: equal up to the float32 forward's roundoff
    (the two paths agree to ~1e-7 per token, test_gold; interval ends are means of tokens, so within 1e-6)."""
    toks, none, _ = plans
    held = toks[4:]
    ad = adapt(planner_model)
    clean = ad.loss_per_token(held, [])
    blk = block_length(held.shape[1] - 1)
    counts = block_sums(torch.ones_like(clean), blk)
    for s in none.strategies:
        cols = [block_sums(ad.loss_per_token(held, parallel_blocks(planner_model, lay)) - clean, blk)
                for lay in none.plans[s]]
        want = cluster_bootstrap_ci(torch.stack(cols, -1), counts, 1000, seed=3)
        torch.testing.assert_close(none.held_out_intervals[s], want, rtol=0, atol=1e-6)
    assert_no_hooks(planner_model)


def test_choice_rule():
    cal = {"C": 0.30, "a": 0.20, "b": 0.25, "random": 0.01}
    order = ["C", "a", "b"]
    assert st.choose(cal, order) == "a"  # no reference: the lowest
    # a is lower but within noise, b beats C beyond it: b
    margins = {"C": [0, 0, 0], "a": [-0.10, -0.25, 0.05], "b": [-0.05, -0.08, -0.01]}
    assert st.choose(cal, order, "C", margins) == "b"
    # both beyond noise: the lowest of them
    assert st.choose(cal, order, "C", {**margins, "a": [-0.10, -0.15, -0.04]}) == "a"
    # nothing beyond noise (or NaN intervals): the reference
    assert st.choose(cal, order, "C", {**margins, "b": [-0.05, -0.08, 0.001]}) == "C"
    assert st.choose(cal, order, "C", {s: [v[0], float("nan"), float("nan")] for s, v in margins.items()}) == "C"
    # also: the win must hold in the second measurement too (the uncorrected one after in-sample fits)
    assert st.choose(cal, order, "C", margins, also={"b": [-0.02, -0.05, 0.01]}) == "C"
    assert st.choose(cal, order, "C", margins, also={"b": [-0.02, -0.05, -0.01]}) == "b"
    assert st.choose(cal, order, "missing", margins) == "a"  # a reference not compared: the lowest


def test_the_plan_follows_the_rule(plans):
    _, none, lin = plans
    for p in (none, lin):
        at_k = p.at_k("calibration")
        selectable = [s for s in p.strategies if s != "random"]
        assert p.reference == "C" and p.margins["C"] == [0.0, 0.0, 0.0] and "random" in p.margins
        assert p.strategy == st.choose(at_k, selectable, "C", p.margins, p.margins_uncorrected)
        for s, (point, lo, hi) in p.margins.items():
            assert point == pytest.approx(at_k[s] - at_k["C"], abs=1e-12) and lo <= point <= hi
    assert lin.margins_uncorrected == {} and "interval of the paired difference" in lin.choice_rule
