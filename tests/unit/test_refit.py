"""Closed-form corrections of the parallel surrogate (tl_steering.planning.refit; docs/parallel.md "Refit").

* the moments' closed form equals a least-squares solve (torch.linalg.lstsq) on the same data to 1e-10, on
  random data and on the activations of every tiny architecture x backend (fitted on the plan's own forward);
* the gate of ``refit="gate", fit="joint"`` is the closed-form gate of ``calibrate_gates`` (the twin);
* ``parallel_blocks(..., gates, biases)`` writes g Phi(x) + b (equal to ``parallel_blocks + ffn_gate`` for a gate);
* the sequential fit is the same on one batch (fitted inside the measuring forward) and on many;
* ``plan_parallel(refit=...)``: the corrected plan's calibration loss, its stored corrections, deterministic for a
  seed, the affine plan's calibration loss below the uncorrected one on a tiny model.
"""

import pytest
import torch

import tl_steering as ts
from tests.helpers import assert_no_hooks
from tl_steering.backends import adapt
from tl_steering.batching import mean_loss
from tl_steering.errors import InputError
from tl_steering.hooks import ffn_gate, parallel_blocks
from tl_steering.planning.refit import Moments, corrected_loss, fit_corrections, solve_correction

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _lstsq(y: torch.Tensor, p: torch.Tensor, affine: bool) -> tuple[float, torch.Tensor]:
    """min over g (and b) of ||g P + b - Y||² by torch.linalg.lstsq on the flattened design [P | one-hot(dim)]."""
    n, d = y.shape
    cols = [p.reshape(-1, 1)]
    if affine:
        cols.append(torch.eye(d, dtype=torch.float64).repeat(n, 1))
    sol = torch.linalg.lstsq(torch.cat(cols, 1), y.reshape(-1, 1), driver="gelsd").solution.flatten()
    return float(sol[0]), (sol[1:] if affine else torch.zeros(d, dtype=torch.float64))


def _close(a: torch.Tensor | float, b: torch.Tensor | float, scale: float) -> None:
    diff = float(torch.as_tensor(a, dtype=torch.float64).sub(torch.as_tensor(b, dtype=torch.float64)).abs().max())
    assert diff <= 1e-10 * scale, (diff, scale)


def test_closed_form_equals_lstsq_on_random_data():
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(3, 9, 8, generator=gen, dtype=torch.float64) * 2 + 0.5
    y = 0.7 * p + torch.randn(8, generator=gen, dtype=torch.float64) + 0.1 * torch.randn(3, 9, 8, generator=gen,
                                                                                       dtype=torch.float64)
    m = Moments(8)
    m.add(y, p, (0,))  # position 0 excluded
    yy, pp = y[:, 1:].reshape(-1, 8), p[:, 1:].reshape(-1, 8)
    assert m.n == 3 * 8
    for refit, affine in (("gate", False), ("affine", True)):
        g, b = m.solve(refit)
        g_ref, b_ref = _lstsq(yy, pp, affine)
        _close(g, g_ref, 1.0)
        _close(b, b_ref, 1.0)
    g, b = m.solve("affine")
    assert abs(g - 0.7) < 0.05  # the planted gate
    g, b = m.solve("none")
    assert g == 1.0 and float(b.abs().max()) == 0.0
    # a degenerate design (constant P) keeps g = 1 and fits the bias alone
    g, b = solve_correction(float((y * 0 + 1).sum()), 24.0 * 8, torch.full((8,), 24.0, dtype=torch.float64),
                            yy.sum(0), 24, "affine")
    assert g == 1.0
    _close(b, yy.mean(0) - 1.0, 1.0)
    with pytest.raises(InputError):
        solve_correction(1.0, 1.0, torch.zeros(2), torch.zeros(2), 4, "diagonal")


def _activations(model, tokens, plan, gates, biases):
    """Per plan layer, (Phi(resid_mid), Phi(resid_pre)) of the forward that runs the corrected plan (float64,
    position 0 dropped), from a cache of that forward: written independently of the fitting hooks."""
    ad = adapt(model)
    names = [ad.hook_name(lay, s) for lay in plan for s in ("resid_pre", "resid_mid")]
    _, cache = ad.run_with_cache(tokens, names, fwd_hooks=parallel_blocks(model, plan, gates, biases))
    out = {}
    for lay in plan:
        phi = ad.ffn(lay)
        with torch.no_grad():
            y = phi(cache[ad.hook_name(lay, "resid_mid")])[:, 1:].to(torch.float64)
            p = phi(cache[ad.hook_name(lay, "resid_pre")])[:, 1:].to(torch.float64)
        out[lay] = (y.reshape(-1, y.shape[-1]), p.reshape(-1, p.shape[-1]))
    return out


def test_fit_on_a_model_equals_lstsq(tiny, tiny_tokens):
    ad = adapt(tiny)
    plan = [lay for lay in ad.layers() if not ad.is_parallel(lay)]
    if not plan:  # NeoX: nothing is fitted
        assert fit_corrections(tiny, tiny_tokens, ad.layers(), "affine") == ({}, {}, 0)
        return
    for fit in ("sequential", "joint"):
        gates, biases, passes = fit_corrections(tiny, tiny_tokens, plan, "affine", fit, batch_size=8)
        assert passes == 1 and sorted(gates) == plan and sorted(biases) == plan
        for j, lay in enumerate(plan):
            if fit == "sequential":  # layer j sees the corrected layers before it, uncorrected ones after
                acts = _activations(tiny, tiny_tokens, plan[:j + 1], {q: gates[q] for q in plan[:j]},
                                    {q: biases[q] for q in plan[:j]})
            else:
                acts = _activations(tiny, tiny_tokens, plan, {}, {})
            y, p = acts[lay]
            g_ref, b_ref = _lstsq(y, p, affine=True)
            scale = float(y.abs().max())
            _close(gates[lay], g_ref, 1.0)
            _close(biases[lay], b_ref, scale)
    assert_no_hooks(tiny)


def test_joint_gate_is_the_calibrate_gates_closed_form(tiny, tiny_tokens):
    ad = adapt(tiny)
    plan = [lay for lay in ad.layers() if not ad.is_parallel(lay)]
    if not plan:
        return
    gates, biases, _ = fit_corrections(tiny, tiny_tokens, plan, "gate", "joint")
    ref = ts.calibrate_gates(tiny, tiny_tokens, method="closed_form", plan=plan, held_out_tokens=tiny_tokens)
    assert biases == {}
    for lay in plan:
        assert abs(gates[lay] - float(ref.gates[lay])) <= 1e-12 * abs(gates[lay])


def test_corrected_parallel_blocks(tiny, tiny_tokens):
    ad = adapt(tiny)
    plan = [lay for lay in ad.layers() if not ad.is_parallel(lay)]
    if not plan:
        assert parallel_blocks(tiny, ad.layers(), {}, {}) == []
        return
    lay = plan[0]
    # a gate alone: the same forward as parallel_blocks + ffn_gate (the twin on the shared hook point)
    a = ad.run_with_hooks(tiny_tokens, parallel_blocks(tiny, plan, {lay: 0.8}))
    b = ad.run_with_hooks(tiny_tokens, parallel_blocks(tiny, plan) + ffn_gate(tiny, {lay: 0.8}))
    assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
    # g Phi(x) + b at hook_mlp_out
    bias = torch.linspace(-1, 1, ad.d_model, dtype=torch.float64)
    _, cache = ad.run_with_cache(tiny_tokens, [ad.hook_name(lay, "resid_pre"), ad.hook_name(lay, "mlp_out")],
                                 fwd_hooks=parallel_blocks(tiny, plan, {lay: 0.5}, {lay: bias}))
    with torch.no_grad():
        want = ad.ffn(lay)(cache[ad.hook_name(lay, "resid_pre")]).to(torch.float64) * 0.5 + bias
    got = cache[ad.hook_name(lay, "mlp_out")].to(torch.float64)
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())
    with pytest.raises(InputError, match="d_model"):
        parallel_blocks(tiny, plan, biases={lay: torch.zeros(3)})
    stray = next((q for q in ad.layers() if q not in plan[:1]), None)
    if stray is not None:
        with pytest.raises(InputError, match="not in layers"):
            parallel_blocks(tiny, plan[:1], gates={stray: 1.0})
    assert_no_hooks(tiny)


@pytest.fixture(scope="module")
def planner_tokens():
    return torch.randint(1, 257, (8, 12), generator=torch.Generator().manual_seed(5))


def test_sequential_fit_one_batch_equals_many(planner_model, planner_tokens):
    cal = planner_tokens[:4]
    for refit in ("gate", "affine"):
        loss1, g1, b1, p1 = corrected_loss(planner_model, cal, [0, 2, 3], refit, "sequential", batch_size=4)
        loss2, g2, b2, p2 = corrected_loss(planner_model, cal, [0, 2, 3], refit, "sequential", batch_size=1)
        assert (p1, p2) == (1, 4)  # one forward (fitted inside it) vs three fitting forwards + one for the loss
        assert abs(loss1 - loss2) <= 1e-6
        for lay in g1:
            assert abs(g1[lay] - g2[lay]) <= 1e-6
            if refit == "affine":
                assert float((b1[lay] - b2[lay]).abs().max()) <= 1e-6
        ref = mean_loss(planner_model, cal, parallel_blocks(planner_model, [0, 2, 3], g1, b1), 4)
        assert abs(loss1 - ref) <= 1e-9  # the loss of the one forward is the corrected model's loss
    assert_no_hooks(planner_model)


def test_plan_parallel_refit(planner_model, planner_tokens, tmp_path):
    cal, held = planner_tokens[:4], planner_tokens[4:]
    kw = {"held_out": held, "strategies": ["C", "attribution_abs", "greedy_measured", "contiguous"],
          "batch_size": 4, "fisher_samples": 0}
    none = ts.plan_parallel(planner_model, cal, 2, **kw)
    aff = ts.plan_parallel(planner_model, cal, 2, refit="affine", **kw)
    again = ts.plan_parallel(planner_model, cal, 2, refit="affine", **kw)
    gate = ts.plan_parallel(planner_model, cal, 2, refit="gate", refit_order="joint", **kw)
    # deterministic: the same choice and bit-identical corrections
    assert aff.layers == again.layers and aff.strategy == again.strategy
    assert torch.equal(aff.gates, again.gates) and torch.equal(aff.biases, again.biases)
    assert aff.gates.shape == (2,) and aff.biases.shape == (2, 32) and float(aff.biases.abs().max()) > 0
    assert none.refit == "none" and torch.equal(none.gates, torch.ones(2, dtype=torch.float64))
    assert gate.biases.abs().max() == 0 and gate.refit_order == "joint"
    # the stored numbers are the corrected plan's, re-measured directly with its hooks
    ad = adapt(planner_model)
    for p in (aff, gate):
        cal_d = mean_loss(ad, cal, p.hooks(planner_model), 4) - p.clean_loss_calibration
        held_d = mean_loss(ad, held, p.hooks(planner_model), 4) - p.clean_loss_held_out
        assert abs(cal_d - p.calibration_delta_ce) <= 1e-9 and abs(held_d - p.held_out_delta_ce) <= 1e-9
        plain = mean_loss(ad, cal, parallel_blocks(planner_model, p.layers), 4) - p.clean_loss_calibration
        assert abs(plain - p.calibration_delta_ce_uncorrected) <= 1e-9
    # measured (tiny Llama, seed 3; the same on TL 4.3 and 3.9): the best plans' calibration dCE
    # none: greedy_measured [0, 3] -3.6552e-4; affine: C [3, 4] -4.1341e-4 (uncorrected -1.5933e-4), below the
    # uncorrected best; gate (joint): greedy_measured [0, 3] -2.3779e-4, ABOVE the uncorrected -3.6552e-4: a
    # least-squares fit of the FFN write is not a fit of the loss (SmolLM2: the gate raises the C plan's loss too)
    assert none.layers == [0, 3] and abs(none.calibration_delta_ce - -3.6552e-4) < 1e-7
    assert aff.layers == [3, 4] and abs(aff.calibration_delta_ce - -4.1341e-4) < 1e-7
    assert abs(aff.calibration_delta_ce_uncorrected - -1.5933e-4) < 1e-7
    assert gate.layers == [0, 3] and abs(gate.calibration_delta_ce - -2.3779e-4) < 1e-7
    assert aff.calibration_delta_ce < aff.calibration_delta_ce_uncorrected
    assert aff.calibration_delta_ce < none.calibration_delta_ce < gate.calibration_delta_ce
    # the sequential one-batch fit costs no extra pass; joint one more per fitted plan
    assert aff.strategy_costs["greedy_measured"]["forward"] == none.strategy_costs["greedy_measured"]["forward"]
    # (the k = 0 window is the clean model: one pass either way)
    assert gate.strategy_costs["contiguous"]["forward"] == 2 * none.strategy_costs["contiguous"]["forward"] - 1
    path = tmp_path / "plan.safetensors"
    aff.save(path)
    back = type(aff).load(path)
    assert torch.equal(back.biases, aff.biases) and back.corrections()[0] == aff.corrections()[0]
    with pytest.raises(InputError, match="refit"):
        ts.plan_parallel(planner_model, cal, 2, refit="diagonal", **kw)
    assert_no_hooks(planner_model)


# ----------------------------------------------------------------------------------------------------------
# the executor runs the corrected plan: parallelize(..., gates=, biases=) equals the corrected surrogate


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _check_executor(model, tokens, layers):
    from tl_steering.parallel import parallelize, unfused

    ad = adapt(model)
    gen = torch.Generator().manual_seed(7)
    gates = {lay: 0.6 + 0.3 * i for i, lay in enumerate(layers)}
    biases = {lay: 0.2 * torch.randn(ad.d_model, generator=gen, dtype=torch.float64) for lay in layers}
    ref = ad.run_with_hooks(tokens, parallel_blocks(model, layers, gates, biases))
    plain = ad.run_with_hooks(tokens, parallel_blocks(model, layers))
    assert _rel(plain, ref) > 1e-3  # the correction changes the forward (the test is not vacuous)
    par = parallelize(model, layers, gates=gates, biases=biases)  # verify=True: fused == unfused
    with torch.no_grad():
        assert _rel(par(tokens), ref) < 1e-4
        with unfused(par):
            assert _rel(par(tokens), ref) < 1e-4
    unf = parallelize(model, layers, fuse=False, gates=gates, biases=biases)
    with torch.no_grad():
        assert _rel(unf(tokens), ref) < 1e-4
    # a copy of the corrected copy keeps its corrections; the original is untouched
    from tl_steering.backends.copying import deepcopy_module

    with torch.no_grad():
        assert _rel(deepcopy_module(par)(tokens), ref) < 1e-4
        assert _rel(model(tokens), ad.run_with_hooks(tokens)) == 0
    with pytest.raises(InputError, match="not made parallel"):
        parallelize(model, layers[:1], gates={layers[-1] + 1: 1.0} if layers[-1] + 1 < ad.n_layers else {-1: 1.0})
    assert_no_hooks(model)


def test_parallelize_with_corrections_equals_surrogate(tiny, tiny_tokens):
    ad = adapt(tiny)
    if ad.any_parallel:  # NeoX: nothing to make parallel
        return
    _check_executor(tiny, tiny_tokens, [0, 1])


@pytest.mark.parametrize("arch", ["gemma3"])
def test_parallelize_with_corrections_sandwich(arch, tiny_tokens):
    _check_executor(ts.tiny_model(arch, seed=0), tiny_tokens, [0, 1])
