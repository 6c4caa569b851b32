"""Critical points, prefix sensitivity and gate calibration on SmolLM2-135M (the session ``smollm2`` fixture; bridge
on TL 4.x, HookedTransformer on TL 3.9): critical points of the FFN field (layer 0; every layer with ``-m slow``),
prefix sensitivity, FFN gate calibration of a parallelized plan.

Numbers were measured on the TL 4.3 bridge (docs/critical_points.md, docs/prefix.md, docs/gates.md) and are pinned
with tolerances that survive the small activation differences between the hooked and bridge backends.
"""

import time

import pytest
import torch

from tl_steering.backends import adapt, weights_fingerprint
from tl_steering.critical import critical_points
from tl_steering.protocols.gates import calibrate_gates
from tl_steering.protocols.prefix import prefix_sensitivity

# one torch thread for the critical-point tests only (small dense eigenproblems spin on a shared runner); the
# prefix and gate tests run full SmolLM2 forwards/backwards, which use both cores
pytestmark = pytest.mark.integration

# critical-point budget: 8 starts (4 token directions + 4 random), 40 LM iterations, dense spectra; the one finder
CRIT = {"n_starts": 8, "eigensolver": "dense", "options": {"max_iter": 40}}
# the flow phase of the finder alone (no landscape solves): what the dynamics reach
FLOW = {"landscape_solves": 0}


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.one_line("tl3")
def test_critical_points_first_layer(smollm2):
    """Default-suite check (about 20 s): layer 0's FFN field has converged equilibria (the every-layer scan,
    13+ minutes on 2 cores, is marked slow and run with ``pytest -m slow``)."""
    from tl_steering import critical_points

    fp = weights_fingerprint(smollm2)
    r = critical_points(smollm2, 0, **CRIT).result(0)
    assert r.options["power_converged"] >= 8  # at least half of the power rows reach relative residual <= 1e-10
    assert 1 <= r.n_points <= 4  # the flow phase measured 2 (docs/critical_points.md section 6.2)
    assert float(r.residuals.max()) <= 1e-10
    assert r.counts()["attractor"] >= 1 and r.counts()["repeller"] >= 1
    assert float(r.options["radius"]) == pytest.approx(3.55, rel=0.1)
    assert set(r.labels) <= {"attractor", "repeller", "saddle", "degenerate"}
    assert weights_fingerprint(smollm2) == fp


@pytest.mark.usefixtures("one_torch_thread")
def test_flow_finder_first_and_middle_layer(smollm2):
    """The flow phase of the finder (``landscape_solves=0``) on SmolLM2. Layer 0: every power row converges, to the same two points
    (1 attractor, 1 repeller of index d - 2 = 575): the evidence that this layer has fewer than 3 points the
    dynamics reach. Layer 5 (8 starts: 16 power rows + edge rows): several attractors and repellers and at least
    one boundary saddle of index 1 or d - 3 = 574 (measured on the TL 4.3 bridge, docs/critical_points.md)."""
    from tl_steering import critical_points

    fp = weights_fingerprint(smollm2)
    s = critical_points(smollm2, [0, 5], n_starts=8, options=FLOW)
    r0, r5 = s.result(0), s.result(5)
    assert r0.method == "landscape" and r0.options["power_rows"] == 16 and r0.options["landscape_solves"] == 0
    assert r0.options["power_converged"] == 16 and r0.n_points == 2
    assert r0.counts()["attractor"] == 1 and r0.counts()["repeller"] == 1 and sorted(r0.index) == [0, 575]
    assert r5.n_converged >= r5.n_starts // 2  # at least half of the rows reach relative residual <= 1e-10
    assert r5.n_points >= 3 and float(r5.residuals.max()) <= 1e-10
    c5 = r5.counts()
    assert c5["attractor"] >= 2 and c5["repeller"] >= 1 and c5["saddle"] >= 1, c5
    for lab, idx in zip(r5.labels, r5.index):  # the power phase: index 0 / 575 only
        assert lab == "saddle" or (lab, idx) in {("attractor", 0), ("repeller", 575)}, (lab, idx)
    # edge tracking lands on saddles with one unstable (index 1) or one stable (index 574) direction; its LM
    # finish may also end on a nearby saddle of another index (measured once: index 2)
    assert any(lab == "saddle" and idx in (1, 574) for lab, idx in zip(r5.labels, r5.index))
    v = s.claim().parts["per_layer"][5]
    assert v["fraction"] < 0.5  # a sample of what the dynamics reach: not "mostly saddles" (see the docs)
    assert weights_fingerprint(smollm2) == fp


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_critical_points_every_layer(smollm2):
    """Issue 13's every-layer acceptance with the flow finder (16 starts per layer, ~7 minutes on one
    thread; run with ``pytest -m slow``). Measured on the TL 4.3 bridge (docs/critical_points.md, section 6.2):
    30/30 layers with at least half of the rows converged to 1e-10, 28/30 with >= 3 distinct points (layers 0 and
    29: 2 points, every power row converging to them), 407 points: 172 attractors, 149 repellers, 86 saddles."""
    ad = adapt(smollm2)
    fp = weights_fingerprint(smollm2)
    t0 = time.perf_counter()
    s = critical_points(smollm2, options=FLOW)  # tokens: text_tokens(model, n_windows=4, length=64); 16 starts
    elapsed = time.perf_counter() - t0
    summ = s.summary()
    print("\ncritical points per layer [attractor, repeller, saddle, degenerate]:", s.counts.tolist())
    print("seconds per layer:", [round(x, 1) for x in s.seconds.tolist()], "total", round(elapsed, 1))
    print("summary:", summ)
    assert s.layers == list(range(ad.n_layers))
    conv = s.converged_fraction()
    assert int((conv >= 0.5).sum()) >= 29  # measured 30/30
    assert int((s.n_points >= 3).sum()) >= 26  # measured 28/30
    for r in s.results:
        if r.n_points:
            assert float(r.residuals.max()) <= 1e-10
    assert int(s.n_points[0]) == 2 and s.result(0).options["power_converged"] == 32
    # ρ = median ||resid_mid||: grows with depth in SmolLM2 (pinned loosely)
    assert float(s.radius[0]) == pytest.approx(3.55, rel=0.1)
    assert float(s.radius[5]) == pytest.approx(90.8, rel=0.1)
    t = s.totals()
    assert summ["equilibria"] == pytest.approx(407, rel=0.15)
    assert t["attractor"] >= 120 and t["repeller"] >= 100 and t["saddle"] >= 50, t
    # the flow sample is not "mostly saddles": 0.21 [0.17, 0.25] measured (a statement about this sample only)
    assert summ["saddle_share"] == pytest.approx(0.21, abs=0.08)
    assert weights_fingerprint(smollm2) == fp


@pytest.mark.one_line("tl4")
def test_prefix_sensitivity_smollm2(smollm2, smollm2_tokens):
    r = prefix_sensitivity(smollm2, smollm2_tokens, 10, 32, eps=1e-2, seed=0)
    assert r.prefix_max_angle < 1e-6 and r.prefix_max_rel_change < 1e-6 and r.prefix_max_kl < 1e-9
    assert float(r.angle_final[0]) == pytest.approx(3.61e-3, rel=0.2)
    assert float(r.kl[0]) == pytest.approx(3.29e-5, rel=0.3)
    # the effect decays with distance: the final-layer angle at distance >= 16 is < 1/10 of that at j
    assert float(r.angle_final[16:].mean()) < 0.1 * float(r.angle_final[0])
    t = prefix_sensitivity(smollm2, smollm2_tokens, 0, 32, mode="token", seed=0)
    assert t.prefix_max_angle < 1e-6 and t.prefix_max_kl < 1e-9
    assert float(t.kl[0]) == pytest.approx(7.29, rel=0.1)
    assert float(t.angle_final[0]) == pytest.approx(0.920, rel=0.1)
    assert float(t.kl[1:].mean()) == pytest.approx(0.115, rel=0.3)


def _low_defect_plan(model, tokens, k=15):
    """The k layers with the lowest ||Phi(x + a) - Phi(x)|| / ||Dx|| (pooled, positions >= 1)."""
    ad = adapt(model)
    names = []
    for layer in range(ad.n_layers):
        names += [ad.hook_name(layer, s) for s in ("resid_pre", "attn_out", "resid_post")]
    _, c = ad.run_with_cache(tokens, names)
    ratio = []
    for layer in range(ad.n_layers):
        x, a, post = (c[ad.hook_name(layer, s)] for s in ("resid_pre", "attn_out", "resid_post"))
        with torch.no_grad():
            d = (ad.ffn(layer)(x + a) - ad.ffn(layer)(x))[:, 1:].double()
        ratio.append(float(d.norm() / (post - x)[:, 1:].double().norm()))
    return sorted(sorted(range(ad.n_layers), key=lambda i: ratio[i])[:k])


@pytest.mark.one_line("tl4")
def test_gate_calibration_of_parallel_plan(smollm2, smollm2_tokens):
    fp = weights_fingerprint(smollm2)
    plan = _low_defect_plan(smollm2, smollm2_tokens[:4])
    assert plan == [6, 7, 8, 9, 10, 11, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    cf = calibrate_gates(smollm2, smollm2_tokens, method="closed_form", plan=plan)
    print("\nclosed form:", cf.summary())
    assert cf.loss_clean_heldout == pytest.approx(3.327, abs=0.02)
    assert cf.loss_base_heldout - cf.loss_clean_heldout == pytest.approx(0.266, abs=0.05)
    assert float(cf.gates[plan].min()) == pytest.approx(0.741, abs=0.05)
    # measured: the closed-form gates do NOT lower the held-out loss (+0.013)
    assert cf.loss_gated_heldout - cf.loss_base_heldout == pytest.approx(0.0128, abs=0.01)
    fit = calibrate_gates(smollm2, smollm2_tokens, method="loss", plan=plan, layers=plan, steps=4, lr=0.05)
    print("loss fit:", fit.summary(), fit.history.tolist())
    assert fit.loss_gated_calib < fit.loss_base_calib - 0.02  # it lowers the calibration loss
    assert fit.history.shape == (4,)
    assert fit.loss_gated_calib - fit.loss_base_calib == pytest.approx(-0.066, abs=0.02)
    # measured (TL 4.3 bridge): the held-out loss RISES by 0.0064 (6 calibration / 2 held-out sequences: the
    # 15 gates overfit). The claim "calibration lowers the held-out loss" is not confirmed; pinned as measured.
    assert fit.loss_gated_heldout - fit.loss_base_heldout == pytest.approx(0.0064, abs=0.02)
    assert weights_fingerprint(smollm2) == fp
    assert all(p.grad is None for p in smollm2.parameters())
