"""Layer planning (tl_steering.parallel; docs/defect.md "Attribution", docs/parallel.md "Planning").

* the attribution score equals the measured single-layer loss change in the small-defect limit (attention
  writes scaled down with ``hooks.attention_gain``: the defect Phi(x + g a) - Phi(x) is O(g), the error of the
  first-order estimate O(g^2)), on float64 copies of every tiny architecture and backend;
* SLEB's choices are re-checked step by step by direct evaluation (``parallel_blocks`` + the adapter's
  next-token loss), "best" against every strategy;
* plans are deterministic for a seed; the pure strategies on hand-made scores.
"""

import math

import pytest
import torch

import tl_steering as ts
from tests.helpers import assert_no_grads, assert_no_hooks
from tl_steering.backends import adapt, weights_fingerprint
from tl_steering.errors import InputError
from tl_steering.hooks import attention_gain, parallel_blocks
from tl_steering.parallel import strategies as st
from tl_steering.parallel.scores import attribution_scores
from tl_steering.parallel.strategies import PLANNER, STRATEGIES


def _mean_loss(model, tokens, layers) -> float:
    """Direct evaluation, written independently of PlanLoss: one forward over all windows."""
    lpt = adapt(model).loss_per_token(tokens, parallel_blocks(model, list(layers)))
    return float(lpt.mean())


# ----------------------------------------------------------------------------------------------------------
# attribution


def test_attribution_is_the_small_defect_limit(tiny64, tiny_tokens):
    ad = adapt(tiny64)
    layers = ad.layers()
    before = weights_fingerprint(tiny64)
    requires = [p.requires_grad for p in tiny64.parameters()]
    if not any(not ad.is_parallel(lay) for lay in layers):  # NeoX: nothing to make parallel
        scores, _ = attribution_scores(tiny64, tiny_tokens, layers)
        assert all(bool(torch.isnan(v).all()) for v in scores.values())
        return
    rel_err = {}
    for gain in (0.1, 0.01):
        with tiny64.hooks(fwd_hooks=attention_gain(tiny64, gain)):  # the user's own hooks: kept by every call
            scores, clean = attribution_scores(tiny64, tiny_tokens, layers, batch_size=2)
            base = _mean_loss(tiny64, tiny_tokens, [])
            measured = torch.tensor([_mean_loss(tiny64, tiny_tokens, [lay]) - base for lay in layers],
                                    dtype=torch.float64)
        assert clean == pytest.approx(base, abs=1e-12)
        err = (scores["attribution"] - measured).abs().max()
        rel_err[gain] = float(err / measured.abs().max())
        # absolute variant bounds the signed one; rms >= abs / sqrt(N) * ... only sign-free facts are asserted
        assert bool((scores["attribution_abs"] >= scores["attribution"].abs() - 1e-15).all())
    assert rel_err[0.01] < 0.02, rel_err  # first order: the relative error shrinks ~linearly with the gain
    assert rel_err[0.01] < 0.3 * rel_err[0.1] + 1e-6, rel_err
    assert weights_fingerprint(tiny64) == before
    assert [p.requires_grad for p in tiny64.parameters()] == requires
    assert_no_grads(tiny64)
    assert_no_hooks(tiny64)


def test_fisher_term_is_the_gauss_newton_quadratic():
    """The sampled-label estimate equals ``1/(2N) sum_t dz_t^T F_t dz_t`` computed from the measured change of the
    logits dz (one layer parallel), F_t = diag(p_t) - p_t p_t^T, in the small-defect limit (gain 0.01: dz is
    first order in the defect). 64 samples of 3 sequences: relative noise about sqrt(2 / 192) = 10%; seeded."""
    model = ts.tiny_model("llama", backend="bridge", seed=0).to(torch.float64)
    ad = adapt(model)
    tokens = torch.randint(1, 257, (3, 16), generator=torch.Generator().manual_seed(0))
    layers = ad.layers()
    with model.hooks(fwd_hooks=attention_gain(model, 0.01)):
        scores, _ = attribution_scores(model, tokens, layers, batch_size=3, fisher_samples=64, seed=0)
        few = [attribution_scores(model, tokens, layers, batch_size=b, fisher_samples=3, seed=sd)[0]
               for b, sd in ((1, 0), (2, 0), (2, 1))]
        z0 = ad.run_with_hooks(tokens, [], return_type="logits")[:, :-1]
        p = torch.softmax(z0, -1)
        exact = []
        for lay in layers:
            dz = ad.run_with_hooks(tokens, parallel_blocks(model, [lay]), return_type="logits")[:, :-1] - z0
            exact.append(float(((p * dz * dz).sum(-1) - (p * dz).sum(-1) ** 2).sum()) / (2 * z0.shape[0] * z0.shape[1]))
    exact = torch.tensor(exact, dtype=torch.float64)
    assert bool((exact > 0).all())
    torch.testing.assert_close(scores["attribution_fisher"], exact, rtol=0.35, atol=0)
    torch.testing.assert_close(scores["attribution_fisher_diag"], exact, rtol=0.5, atol=0)  # biased: looser
    torch.testing.assert_close(scores["attribution_2nd"], scores["attribution"] + scores["attribution_fisher"],
                               rtol=0, atol=0)
    # the labels depend on the seed only (not on the batching); another seed gives another estimate
    torch.testing.assert_close(few[0]["attribution_fisher"], few[1]["attribution_fisher"], rtol=1e-9, atol=0)
    assert not torch.allclose(few[2]["attribution_fisher"], few[1]["attribution_fisher"], rtol=1e-3, atol=0)
    assert_no_grads(model)
    assert_no_hooks(model)
    with pytest.raises(InputError, match="fisher_samples"):
        attribution_scores(model, tokens, layers, fisher_samples=-1)


def test_parallel_scores(planner_model, planner_tokens, tmp_path):
    res = ts.parallel_scores(planner_model, planner_tokens, gold=True, batch_size=4, fisher_samples=2)
    defect = ts.parallel_defect(planner_model, planner_tokens, batch_size=4)
    for k in ("C", "C_phi", "C1", "C_tan"):
        torch.testing.assert_close(res.scores[k], defect.scores[k], rtol=0, atol=0)
    base = _mean_loss(planner_model, planner_tokens, [])
    direct = torch.tensor([_mean_loss(planner_model, planner_tokens, [lay]) - base for lay in range(5)],
                          dtype=torch.float64)
    torch.testing.assert_close(res.delta_ce, direct, rtol=1e-5, atol=1e-7)
    assert set(res.spearman) == set(res.scores) and -1 <= res.spearman["attribution"] <= 1
    # C + attribution forwards, clean + 5 single-layer runs; 1 true-label + 2 sampled-label backwards
    assert res.cost["forward"] == 2 + 6 and res.cost["backward"] == 1 + 2
    back = ts.Result.load(res.save(tmp_path / "scores.safetensors"))
    torch.testing.assert_close(back.scores["attribution"], res.scores["attribution"], rtol=0, atol=0)
    assert len(res.plot().data) == len(res.scores) + 1 and "spearman_attribution" in res.summary()
    assert_no_grads(planner_model)
    assert_no_hooks(planner_model)


# ----------------------------------------------------------------------------------------------------------
# planners


@pytest.fixture(scope="module")
def plan(planner_model, planner_tokens):
    cal, held = planner_tokens[:2], planner_tokens[2:]
    # every strategy of the registry, uncorrected (the default compares PLANNER's with the linear correction)
    return ts.plan_parallel(planner_model, cal, 2, held_out=held, k_values=[0, 1, 2, 3], batch_size=2,
                            strategy=list(STRATEGIES), refit="none")


def test_sleb_choices_rechecked(planner_model, planner_tokens, plan):
    cal = planner_tokens[:2]
    order = []  # SLEB: each step adds the layer of lowest measured loss among every remaining one
    for step, j in enumerate(plan.k_values[1:], start=1):
        chosen = plan.plans["sleb"][step]
        assert set(plan.plans["sleb"][step - 1]) <= set(chosen)  # nested plans
        added = (set(chosen) - set(order)).pop()
        losses = {lay: _mean_loss(planner_model, cal, order + [lay]) for lay in range(5) if lay not in order}
        best = min(losses.values())
        assert losses[added] <= best + 1e-6, (step, added, losses)
        order.append(added)
    assert plan.strategy_costs["sleb"] == {"forward": 5 + 4 + 3, "backward": 0.0,
                                           "seconds": plan.strategy_costs["sleb"]["seconds"]}


def test_reported_losses_and_best(planner_model, planner_tokens, plan):
    cal, held = planner_tokens[:2], planner_tokens[2:]
    clean_cal, clean_held = _mean_loss(planner_model, cal, []), _mean_loss(planner_model, held, [])
    direct: dict[tuple, tuple[float, float]] = {}  # one direct evaluation per distinct layer set
    for s in plan.strategies:
        for j, layers in enumerate(plan.plans[s]):
            assert len(layers) == plan.k_values[j] and layers == sorted(layers)
        lay2 = tuple(plan.plan_of(s))
        if lay2 not in direct:
            direct[lay2] = (_mean_loss(planner_model, cal, lay2) - clean_cal,
                            _mean_loss(planner_model, held, lay2) - clean_held)
        assert plan.at_k("calibration")[s] == pytest.approx(direct[lay2][0], abs=1e-6)
        assert plan.at_k("held_out")[s] == pytest.approx(direct[lay2][1], abs=1e-6)
    # the choice: C (the reference) unless a strategy beats it by more than its paired interval, then the lowest
    selectable = {s: v for s, v in plan.at_k("calibration").items() if s != "random"}
    assert plan.reference == "C" and set(plan.margins) == set(plan.strategies)
    beat = [s for s, (_, _, hi) in plan.margins.items() if s in selectable and hi < 0]
    assert plan.calibration_delta_ce == min([selectable["C"]] + [selectable[s] for s in beat])
    for s, (point, lo, hi) in plan.margins.items():
        assert point == pytest.approx(selectable.get(s, plan.at_k("calibration")[s]) - selectable["C"], abs=1e-15)
    assert plan.layers == plan.plan_of(plan.strategy) and plan.k == 2 and plan.requested == "best"
    assert plan.total_cost["forward"] > 0 and plan.total_cost["backward"] >= 1


def test_plans_deterministic_for_a_seed(planner_model, planner_tokens, plan, tmp_path):
    redo = ["attribution_2nd", "sleb", "random"]  # the seeded / searching ones
    again = ts.plan_parallel(planner_model, planner_tokens[:2], 2, held_out=planner_tokens[2:],
                             k_values=[0, 1, 2, 3], batch_size=2, strategy=redo, refit="none")
    for s in redo:
        assert again.plans[s] == plan.plans[s], s
        torch.testing.assert_close(again.held_out_curves[s], plan.held_out_curves[s], rtol=0, atol=0)
    back = ts.ParallelPlan.load(plan.save(tmp_path / "plan.json"))
    assert back.plans == plan.plans and back.layers == plan.layers and back.cost == plan.cost
    assert len(plan.plot().data) == 2 * len(plan.strategies)
    assert plan.summary()["strategy"] == plan.strategy
    assert_no_grads(planner_model)
    assert_no_hooks(planner_model)


def test_single_strategy_and_split(planner_model, planner_tokens):
    """A named strategy runs alone; without held_out the second half of the windows is held out."""
    p = ts.plan_parallel(planner_model, planner_tokens, 1, strategy="C", batch_size=2)
    assert p.strategies == ["C"] and p.strategy == "C" and p.n_calibration == 2 and p.n_held_out == 2
    assert p.cost == {"forward": 1.0, "backward": 0.0, "seconds": p.cost["seconds"]}


def test_bad_inputs(planner_model, planner_tokens):
    with pytest.raises(InputError, match="strategy"):
        ts.plan_parallel(planner_model, planner_tokens, 1, strategy="nope")
    with pytest.raises(InputError, match="k must be"):
        ts.plan_parallel(planner_model, planner_tokens, 9)
    with pytest.raises(InputError, match="held_out"):
        ts.plan_parallel(planner_model, planner_tokens[:1], 1)
    with pytest.raises(InputError, match="strategy"):
        ts.plan_parallel(planner_model, planner_tokens, 1, strategy=["C", "C"])
    with pytest.raises(InputError, match="fisher_samples"):
        ts.plan_parallel(planner_model, planner_tokens, 1, strategy="attribution_2nd", fisher_samples=0)


# ----------------------------------------------------------------------------------------------------------
# pure strategies


def test_strategies_on_hand_made_scores():
    cand = [0, 1, 2, 4, 5]
    score = {0: 3.0, 1: 1.0, 2: 1.0, 4: math.nan, 5: 0.5}
    # the order 5, 1, 2, 0, 4: ties by layer, NaN last
    assert [st.one_shot(cand, score, k) for k in (1, 2, 4, 5)] == [[5], [1, 5], [0, 1, 2, 5], [0, 1, 2, 4, 5]]
    assert st.one_shot(cand, score, 2) == [1, 5]
    assert st.one_shot(cand, score, 2, lowest=False) == [0, 1]
    assert st.contiguous(cand, score, 2) == [1, 2]  # windows containing the NaN layer lose
    assert st.random_sets(cand, [0, 2], 2, seed=1) == st.random_sets(cand, [0, 2], 2, seed=1)
    assert st.default_k_values(30) == [0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30]
    for bad in (-1, 6, 1.5, True):
        with pytest.raises(InputError):
            st.check_k(bad, 5)


def test_the_default_call(planner_model):
    """plan_parallel(model, tokens, k) alone: the one-shot comparison with the cross-fitted linear correction at
    k (curves at 0 and k) on the first half of the windows; the choice is the strategy of lowest out-of-fold
    calibration dCE, its held-out dCE is its corrections run as hooks on the second half, and total_cost counts
    the passes the call ran."""
    from tl_steering.data.batching import mean_loss

    toks = torch.randint(1, 257, (8, 12), generator=torch.Generator().manual_seed(7))
    p = ts.plan_parallel(planner_model, toks, 3)
    assert p.strategies == list(PLANNER.strategies) and p.refit == "linear" and p.options["refit_crossfit"]
    assert p.k_values == [0, 3] and (p.n_calibration, p.n_held_out) == (4, 4)
    cal_at_k = p.at_k("calibration")
    assert p.reference == "C" and p.calibration_fit == "out-of-fold" and p.calibration_note == ""
    assert p.strategy == st.choose(cal_at_k, p.strategies, "C", p.margins)
    held = toks[4:]
    direct = mean_loss(planner_model, held, p.hooks(planner_model), 8) - mean_loss(planner_model, held, [], 8)
    assert direct == pytest.approx(p.held_out_delta_ce, abs=1e-9, rel=0)
    assert p.linears.shape == (3, 32, 32) and set(p.held_out_curves_uncorrected) == set(p.strategies)
    # the scores (2 forwards + 1 + 8 backwards) and a few passes per distinct plan: tens, not hundreds
    n_plans = len({tuple(q) for s in p.strategies for q in p.plans[s] if q})
    assert p.total_cost["backward"] == 9
    assert 2 + 3 * n_plans <= p.total_cost["forward"] <= 2 + 7 * n_plans + 4, (p.total_cost, n_plans)
    assert_no_hooks(planner_model)
