"""parallel_defect on SmolLM2-135M: pinned scores and the paper's claims (docs/defect.md).

One run (module fixture) on the first 4 of the 8 pydoc windows (seed 0, 128 tokens, no BOS; position 0
excluded from the scores), with brackets, the gold standard (30 single-layer parallel runs) and the curves at
k = 0, 8, 15, 22, 30 with 3 random draws. Numbers were measured on TL 4.3 (bridge) and TL 3.9 (hooked); the
tolerances cover the ~1e-5 relative activation differences between the two model classes.

What holds on SmolLM2 and what does not (measured, written plainly):

* C_l ranks layers by single-layer parallel damage only moderately: Spearman(C, dCE_l) = 0.51 over the 30
  layers (C1, the first-order JVP estimate, ranks best: 0.56; C_phi 0.44, C_tan 0.47). Without layers 0 and 1
  (the two largest C and the two most damaging layers) it drops to 0.40 (C1: 0.45).
* The largest-C layer (0) is the most damaging single layer (dCE 1.68 nats).
* Parallelizing the 15 lowest-C layers costs 0.30 nats; the 15 highest-C layers cost 4.47 nats (random
  15-sets: 2.85 on average). The claim "low-defect layers parallelize cheaply, high-defect layers degrade
  sharply" holds in that ordering.
* The paper's absolute number does NOT carry over: GPT-2-large loses about +0.02 for its 18 lowest-C of 36
  layers; SmolLM2-135M loses 0.30 nats for its 15 lowest of 30. At k = 8 the best contiguous window
  (layers 22-29, 0.148) even beats the 8 lowest-C layers (0.181): C is a one-shot, per-layer ranking and
  ignores interactions.
* The speedup estimate depends on the machine; on a shared CPU the sub-module times are noisy, so only its
  range and label are tested here.
"""

import math

import pytest
import torch

from tl_steering.backends import adapt, weights_fingerprint
from tl_steering.hooks import parallel_blocks
from tl_steering.parallel.defect import SPEEDUP_LABEL, DefectResult, parallel_defect

pytestmark = [pytest.mark.integration, pytest.mark.one_line("tl3")]

K_VALUES = [0, 8, 15, 22, 30]

# Measured on TL 4.3 bridge; TL 3.9 hooked agrees to 1.2e-5 relative (scores) and 6e-6 nats (losses).
C_PINNED = [1.03349, 0.861806, 0.347222, 0.460365, 0.462991, 0.391104, 0.309855, 0.256533, 0.280009,
            0.244426, 0.309776, 0.144627, 0.468521, 0.473271, 0.532956, 0.491072, 0.574784, 0.45641,
            0.424596, 0.503054, 0.325903, 0.313469, 0.258591, 0.240657, 0.23731, 0.170645, 0.195818,
            0.228157, 0.0717359, 0.119463]
DCE_PINNED = [1.68355, 0.61248, 0.10182, 0.07708, 0.02685, 0.00232, 0.02165, 0.00464, 0.02601, -0.00628,
              0.02237, 0.03169, 0.02960, 0.02924, 0.05850, 0.05706, 0.09615, 0.02529, 0.01625, 0.05472,
              0.02330, 0.02287, 0.00335, 0.01723, 0.00530, 0.00975, 0.00300, 0.02139, 0.04841, 0.10745]
SPEARMAN_PINNED = {"C": 0.5115, "C_phi": 0.4372, "C1": 0.5564, "C_tan": 0.4692}
CLEAN_LOSS = 3.181126
CURVES_PINNED = {
    "lowest": [0.0, 0.18080, 0.30007, 0.63150, 5.18713],
    "highest": [0.0, 4.34662, 4.46707, 5.07088, 5.18713],
    "contiguous": [0.0, 0.14808, 0.70606, 1.12565, 5.18713],
    "random_mean": [0.0, 3.18674, 2.85397, 1.86115, 5.18713],
}
PLAN_15 = [6, 7, 8, 9, 10, 11, 21, 22, 23, 24, 25, 26, 27, 28, 29]


@pytest.fixture(scope="module")
def defect(smollm2, smollm2_tokens):
    before = weights_fingerprint(smollm2)
    res = parallel_defect(smollm2, smollm2_tokens[:4], brackets=True, evaluate=True, k_values=K_VALUES,
                          n_random=3, batch_size=4, timing=True, timing_repeats=1)
    assert weights_fingerprint(smollm2) == before
    return res


def test_pinned_scores(defect):
    assert defect.layers == list(range(30)) and not any(defect.already_parallel)
    assert defect.n_tokens == 4 * 127
    torch.testing.assert_close(defect.score, torch.tensor(C_PINNED, dtype=torch.float64), rtol=2e-4,
                               atol=0)
    # Phi(resid_mid) recomputed by ad.ffn is hook_mlp_out
    assert float(defect.phi_check.max()) <= 1e-5
    # every variant is a positive finite number; C_tan <= C (a projection); first order is rough on SmolLM2
    for v in defect.scores.values():
        assert bool(torch.isfinite(v).all()) and bool((v > 0).all())
    assert bool((defect.scores["C_tan"] <= defect.scores["C"] + 1e-12).all())
    assert float(defect.nonlinearity.median()) == pytest.approx(0.3668, abs=1e-3)
    assert float(defect.nonlinearity.max()) == pytest.approx(1.875, rel=1e-3)  # layer 2: nu > 1
    assert int((defect.nonlinearity > 1).sum()) == 4  # layers 0, 1, 2, 11


def test_pinned_gold_standard(defect):
    assert defect.clean_loss == pytest.approx(CLEAN_LOSS, abs=1e-4)
    torch.testing.assert_close(defect.delta_ce, torch.tensor(DCE_PINNED, dtype=torch.float64), rtol=0,
                               atol=1e-4)
    for k, v in SPEARMAN_PINNED.items():  # identical on both backends (ranks of well-separated values)
        assert defect.spearman[k] == pytest.approx(v, abs=2e-3), k
    assert defect.curves["k"].tolist() == K_VALUES
    for name, vals in CURVES_PINNED.items():
        torch.testing.assert_close(defect.curves[name], torch.tensor(vals, dtype=torch.float64), rtol=0,
                                   atol=1e-4)
    assert defect.plan(15) == PLAN_15


def test_c_ranks_single_layer_damage(defect):
    """Moderate rank agreement (0.51 for C, 0.56 for C1); the largest-C layer is the most damaging one."""
    assert defect.spearman["C"] > 0.4
    assert defect.spearman["C1"] > 0.4
    assert int(defect.score.argmax()) == int(defect.delta_ce.argmax()) == 0


def test_lowest_half_costs_less_than_highest_half(defect):
    j = K_VALUES.index(15)
    low, high = float(defect.curves["lowest"][j]), float(defect.curves["highest"][j])
    assert low < 0.1 * high  # 0.30 vs 4.47 nats
    assert low < float(defect.curves["random_mean"][j])
    # at every interior k the lowest-C choice beats the highest-C choice and the random mean
    for j in range(1, len(K_VALUES) - 1):
        low, rnd, high = (float(defect.curves[s][j]) for s in ("lowest", "random_mean", "highest"))
        assert low < rnd <= high + 1e-9
    # not the paper's +0.02 (GPT-2-large, 18 of 36 layers): SmolLM2 loses ~0.3 nats at k = L/2
    assert float(defect.curves["lowest"][K_VALUES.index(15)]) > 0.1


def test_curve_point_matches_a_direct_run(defect, smollm2, smollm2_tokens):
    ad = adapt(smollm2)
    toks = smollm2_tokens[:4]
    j = K_VALUES.index(8)
    ce = float(ad.loss_per_token(toks, parallel_blocks(smollm2, defect.plan(8))).mean())
    assert ce - defect.clean_loss == pytest.approx(float(defect.curves["lowest"][j]), abs=1e-6)
    assert sum(len(hp.fwd_hooks) for hp in smollm2.hook_dict.values()) == 0


def test_brackets(defect):
    """The defect's RMS follows DPhi.A layer by layer (its first-order term); the bracket is reported."""
    from scipy.stats import spearmanr

    for k in ("DPhi_A", "DA_Phi", "bracket"):
        v = defect.brackets[k]
        assert bool(torch.isfinite(v).all()) and bool((v > 0).all())
    torch.testing.assert_close(defect.brackets["DPhi_A"], defect.rms["first_order"])
    rho = spearmanr(defect.rms["defect"].numpy(), defect.brackets["DPhi_A"].numpy()).statistic
    assert rho == pytest.approx(0.952, abs=0.03)


def test_speedup_estimate(defect, tmp_path):
    est = defect.speedup_estimate(defect.plan(15))
    assert est["label"] == SPEEDUP_LABEL and est["k"] == 15 and est["timing_shape"] == [2, 128]
    # max(a, f) >= (a + f) / 2, so any plan gives 1 <= speedup <= 2; the value depends on the machine and its
    # load (1.25 on TL 4.3 bridge and 1.36 on TL 3.9 hooked, on a heavily shared 2-core CPU)
    assert 1.0 < est["speedup"] <= 2.0
    assert math.isfinite(est["speedup_with_other"])
    assert 1.0 <= est["speedup_with_other"] <= est["speedup"] + 1e-12
    back = DefectResult.load(defect.save(tmp_path / "defect.json"))
    assert back.speedup_estimate(defect.plan(15)) == est


# ----------------------------------------------------------------------------------------------------------
# layer planning (tl_steering.parallel, docs/defect.md "Layer planning"): the loss-aware attribution score and
# a planner chosen on the same 4 calibration windows, reported on the other 4 (held out). Cost on an idle
# 2-core machine: one forward + backward (attribution) reusing the gold of the `defect` fixture, then
# plan_parallel with C / attribution_abs at k = 15 (about 8 forward + 1 backward passes of 4 x 128).


def test_attribution_ranks_single_layer_damage(smollm2, smollm2_tokens, defect):
    from tl_steering.parallel.scores import attribution_scores
    from tl_steering.parallel.gold import spearman

    scores, clean = attribution_scores(smollm2, smollm2_tokens[:4], list(range(30)), batch_size=4)
    assert clean == pytest.approx(CLEAN_LOSS, abs=2e-3)
    # measured: attribution_abs 0.775, attribution_rms 0.746, signed attribution 0.116 (first order fails at the
    # most damaging layers: -0.24 / -0.12 nats predicted at layers 0 / 1, +1.68 / +0.61 measured), C 0.511
    rho = {k: spearman(v, defect.delta_ce) for k, v in scores.items()}
    assert rho["attribution_abs"] == pytest.approx(0.775, abs=0.02), rho
    assert rho["attribution_abs"] > defect.spearman["C"] + 0.2
    assert rho["attribution"] < 0.3 and float(scores["attribution"][0]) < 0 < float(defect.delta_ce[0])
    # the two most damaging single layers (0, 1) have the two highest absolute attributions
    assert set(torch.argsort(scores["attribution_abs"], descending=True)[:2].tolist()) == {0, 1}


def test_planner_vs_the_C_plan_held_out(smollm2, smollm2_tokens):
    """Measured (benchmarks/plan_quality.py): the attribution_abs plan costs 0.223 nats held out vs 0.316 for the
    C plan (-29%), but 0.308 vs 0.300 on the calibration windows, so "best" (chosen on calibration only) keeps
    the C plan. The issue's target (half the C plan's held-out loss) is NOT met by one-shot plans."""
    import tl_steering as ts

    before = weights_fingerprint(smollm2)
    plan = ts.plan_parallel(smollm2, smollm2_tokens[:4], 15, held_out=smollm2_tokens[4:8], k_values=[15],
                            strategy=["C", "attribution_abs"], batch_size=4, refit="none")
    assert weights_fingerprint(smollm2) == before
    assert plan.plan_of("C") == PLAN_15  # the paper's plan is the lowest-C plan of the defect fixture
    assert plan.plan_of("attribution_abs") == [6, 7, 8, 9, 14, 15, 18, 20, 21, 22, 23, 24, 25, 26, 27]
    at_cal, at_held = plan.at_k("calibration"), plan.at_k("held_out")
    assert at_cal["C"] == pytest.approx(CURVES_PINNED["lowest"][2], abs=5e-3)
    assert at_cal["attribution_abs"] == pytest.approx(0.3076, abs=5e-3)
    assert at_held["C"] == pytest.approx(0.3156, abs=5e-3)
    assert at_held["attribution_abs"] == pytest.approx(0.2231, abs=5e-3)
    assert plan.strategy == "C" and plan.held_out_delta_ce == at_held["C"]  # chosen on calibration, not held out
