"""Closed-form corrections of the parallel surrogate (tl_steering.parallel.refit; docs/parallel.md "Refit").

* the moments' closed form equals a least-squares solve (torch.linalg.lstsq) on the same data to 1e-10, on
  random data and on the activations of every tiny architecture x backend (fitted on the plan's own forward);
* the gate of ``refit="gate"`` is the closed-form gate of ``calibrate_gates`` (one solve, ``stats.Moments``);
* ``parallel_blocks(..., gates, biases)`` writes g Phi(x) + b (equal to ``parallel_blocks + ffn_gate`` for a gate);
* the sequential fit is the same on one batch (fitted inside the measuring forward) and on many;
* ``plan_parallel(refit=...)``: the corrected plan's calibration loss, its stored corrections, deterministic for a
  seed, the affine plan's calibration loss below the uncorrected one on a tiny model;
* ``refit="linear"``: the moments' solution equals the two-stage ridge regression written on the data, recovers a
  planted map, never fits the write worse than the affine fit; its surrogate, ``plan_parallel`` and the executor
  (fused, unfused, sandwich norms) agree.
"""

import pytest
import torch

import tl_steering as ts
from tests.helpers import assert_no_hooks
from tl_steering.backends import adapt
from tl_steering.data.batching import mean_loss
from tl_steering.errors import InputError
from tl_steering.hooks import ffn_gate, parallel_blocks
from tl_steering.parallel.refit import RefitLoss, fit_corrections
from tl_steering.stats import LINEAR_RIDGE, Moments, ridge_df, solve_correction

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def corrected_loss(model, tokens, plan, refit, batch_size, linears=None):
    """``(mean CE of the corrected plan on the tokens it was fitted on, gates, biases, passes)`` through the hooked
    forward (``RefitLoss`` in-sample, no shared prefix); ``linears`` receives the linear maps."""
    rl = RefitLoss(model, tokens, batch_size, refit=refit, share_prefix=False, crossfit=False)
    loss = rl(plan)
    g, b, w = rl.fitted(plan)
    if linears is not None:
        linears.update(w)
    return loss, g, b, rl.passes


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
    for _ in range(1):
        gates, biases, passes = fit_corrections(tiny, tiny_tokens, plan, "affine", batch_size=8)
        assert passes == 1 and sorted(gates) == plan and sorted(biases) == plan
        for j, lay in enumerate(plan):  # layer j sees the corrected layers before it, uncorrected ones after
            acts = _activations(tiny, tiny_tokens, plan[:j + 1], {q: gates[q] for q in plan[:j]},
                                {q: biases[q] for q in plan[:j]})
            y, p = acts[lay]
            g_ref, b_ref = _lstsq(y, p, affine=True)
            scale = float(y.abs().max())
            _close(gates[lay], g_ref, 1.0)
            _close(biases[lay], b_ref, scale)
    assert_no_hooks(tiny)


def test_gate_is_the_calibrate_gates_closed_form(tiny, tiny_tokens):
    """One layer made parallel: the refit's gate (moments from the fitting hooks: the block's own hook_mlp_out) and
    calibrate_gates' closed form (moments from the adapter's Phi(x + a)) share one solve, stats.Moments; the two
    writes differ by kernel rounding only."""
    ad = adapt(tiny)
    plan = [lay for lay in ad.layers() if not ad.is_parallel(lay)]
    for lay in plan:
        gates, biases, _ = fit_corrections(tiny, tiny_tokens, [lay], "gate")
        ref = ts.calibrate_gates(tiny, tiny_tokens, method="closed_form", plan=[lay], held_out_tokens=tiny_tokens)
        assert biases == {}
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
        loss1, g1, b1, p1 = corrected_loss(planner_model, cal, [0, 2, 3], refit, batch_size=4)
        loss2, g2, b2, p2 = corrected_loss(planner_model, cal, [0, 2, 3], refit, batch_size=1)
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
    # no C among them: the lowest calibration dCE chooses (the reference rule: test_plan.py)
    kw = {"held_out": held, "strategy": ["attribution_abs", "sleb"], "batch_size": 4, "fisher_samples": 0}
    none = ts.plan_parallel(planner_model, cal, 2, refit="none", **kw)
    aff = ts.plan_parallel(planner_model, cal, 2, refit="affine", **kw)
    again = ts.plan_parallel(planner_model, cal, 2, refit="affine", **kw)
    gate = ts.plan_parallel(planner_model, cal, 2, refit="gate", **kw)
    # deterministic: the same choice and bit-identical corrections
    assert aff.layers == again.layers and aff.strategy == again.strategy
    assert torch.equal(aff.gates, again.gates) and torch.equal(aff.biases, again.biases)
    assert aff.gates.shape == (2,) and aff.biases.shape == (2, 32) and float(aff.biases.abs().max()) > 0
    assert none.refit == "none" and torch.equal(none.gates, torch.ones(2, dtype=torch.float64))
    assert gate.biases.abs().max() == 0 and gate.refit_order == "sequential"
    # the stored numbers are the corrected plan's, re-measured directly with its hooks
    ad = adapt(planner_model)
    for p in (aff, gate):
        cal_d = mean_loss(ad, cal, p.hooks(planner_model), 4) - p.clean_loss_calibration
        held_d = mean_loss(ad, held, p.hooks(planner_model), 4) - p.clean_loss_held_out
        assert abs(cal_d - p.calibration_delta_ce) <= 1e-9 and abs(held_d - p.held_out_delta_ce) <= 1e-9
        plain = mean_loss(ad, cal, parallel_blocks(planner_model, p.layers), 4) - p.clean_loss_calibration
        assert abs(plain - p.calibration_delta_ce_uncorrected) <= 1e-9
    # the affine fit, in-sample, lowers the calibration loss of the plan it was fitted on
    assert aff.calibration_delta_ce < aff.calibration_delta_ce_uncorrected
    # the sequential one-batch fit rides in the measuring forward: SLEB's search costs the same passes
    assert aff.strategy_costs["sleb"]["forward"] == none.strategy_costs["sleb"]["forward"] == 5 + 4
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


def _check_executor(model, tokens, layers, linear: bool = False):
    from tl_steering.parallel.apply import parallelize, unfused

    ad = adapt(model)
    gen = torch.Generator().manual_seed(7)
    gates = {lay: 0.6 + 0.3 * i for i, lay in enumerate(layers)}
    biases = {lay: 0.2 * torch.randn(ad.d_model, generator=gen, dtype=torch.float64) for lay in layers}
    d = ad.d_model
    linears = {lay: 0.5 * torch.randn(d, d, generator=gen, dtype=torch.float64) / d ** 0.5 for lay in layers} \
        if linear else None
    ref = ad.run_with_hooks(tokens, parallel_blocks(model, layers, gates, biases, linears))
    plain = ad.run_with_hooks(tokens, parallel_blocks(model, layers, gates, biases) if linear else
                              parallel_blocks(model, layers))
    assert _rel(plain, ref) > 1e-3  # the correction (the linear term) changes the forward: the test is not vacuous
    par = parallelize(model, layers, gates=gates, biases=biases, linears=linears)  # verify=True: fused == unfused
    with torch.no_grad():
        assert _rel(par(tokens), ref) < 1e-4
        with unfused(par):
            assert _rel(par(tokens), ref) < 1e-4
    unf = parallelize(model, layers, fuse=False, gates=gates, biases=biases, linears=linears)
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


@pytest.mark.parametrize("linear", [False, True])
def test_parallelize_with_corrections_equals_surrogate(tiny, tiny_tokens, linear):
    ad = adapt(tiny)
    if ad.any_parallel:  # NeoX: nothing to make parallel
        return
    _check_executor(tiny, tiny_tokens, [0, 1], linear)


@pytest.mark.parametrize("linear", [False, True])
@pytest.mark.parametrize("arch", ["gemma3"])
def test_parallelize_with_corrections_sandwich(arch, tiny_tokens, linear):
    _check_executor(ts.tiny_model(arch, seed=0), tiny_tokens, [0, 1], linear)


# ----------------------------------------------------------------------------------------------------------
# refit="linear": g Phi(x) + b + a W, W a ridge regression on the attention write


def _ridge_reference(y, p, a, ridge):
    """The two-stage fit written on the flattened data (no moments): g of the affine fit, then W = (A^T A + lam I)^-1
    A^T R on the centred attention writes A and residuals R = Y - g P (centred), lam = ridge tr(A^T A) / d."""
    d = y.shape[1]
    pc, yc, ac = p - p.mean(0), y - y.mean(0), a - a.mean(0)
    g = float((yc * pc).sum() / (pc * pc).sum())
    caa = ac.T @ ac
    lam = ridge * float(torch.trace(caa)) / d
    w = torch.linalg.solve(caa + lam * torch.eye(d, dtype=torch.float64), ac.T @ (yc - g * pc))
    return g, y.mean(0) - g * p.mean(0) - a.mean(0) @ w, w


def test_linear_moments_equal_the_ridge_regression():
    gen = torch.Generator().manual_seed(3)
    d = 6
    a = torch.randn(4, 50, d, generator=gen, dtype=torch.float64)
    p = torch.randn(4, 50, d, generator=gen, dtype=torch.float64) + 0.3
    w_true = torch.randn(d, d, generator=gen, dtype=torch.float64) / d ** 0.5
    y = 0.8 * p + a @ w_true + 0.2 + 0.01 * torch.randn(4, 50, d, generator=gen, dtype=torch.float64)
    m = Moments(d, linear=True)
    m.add(y[:2], p[:2], (0,), a[:2])  # two batches: the moments add up
    m.add(y[2:], p[2:], (0,), a[2:])
    flat = [t[:, 1:].reshape(-1, d) for t in (y, p, a)]
    for ridge in (LINEAR_RIDGE, 1e-9):
        g, b, w = m.solve_linear(ridge)
        g_ref, b_ref, w_ref = _ridge_reference(*flat, ridge)
        _close(g, g_ref, 1.0)
        _close(b, b_ref, 1.0)
        _close(w, w_ref, 1.0)
    # a vanishing ridge recovers the planted map and gate (196 tokens for 36 entries, noise 0.01; the two-stage g
    # also carries the sample correlation of P with a W: measured |g - 0.8| = 0.028)
    g, b, w = m.solve_linear(1e-9)
    assert abs(g - 0.8) < 0.05 and float((w - w_true).abs().max()) < 0.05
    # the fitted write is never further from Y than the affine fit's (W = 0 is a candidate of the ridge problem)
    yy, pp, aa = flat
    g_a, b_a = m.solve("affine")
    err_aff = float(((g_a * pp + b_a - yy) ** 2).sum())
    g, b, w = m.solve_linear()
    err_lin = float(((g * pp + b + aa @ w - yy) ** 2).sum())
    assert err_lin < 0.5 * err_aff  # the planted map explains most of the affine residual
    assert m.solve("linear")[0] == g  # solve() gives the same (g, b)
    # no attention variance: W = 0 and the affine fit
    m0 = Moments(d, linear=True)
    m0.add(y, p, (0,), torch.ones_like(a))
    g0, _, w0 = m0.solve_linear()
    assert float(w0.abs().max()) == 0.0
    _close(g0, g_a, 1.0)
    with pytest.raises(InputError, match="attention write"):
        Moments(d, linear=True).add(y, p, (0,))
    with pytest.raises(InputError, match="linear=True"):
        Moments(d).solve_linear()


def test_linear_moments_in_the_row_space():
    """While n <= d / 2 the rows are kept and W = A_c^T (A_c A_c^T + lam I)^-1 R_c, an [n, n] system: the same ridge
    regression as the [d, d] one (batch by batch, with and without the max_df cap), and past d / 2 tokens the
    moments take over with the same answer."""
    gen = torch.Generator().manual_seed(5)
    d = 40
    a, p = (torch.randn(3, 8, d, generator=gen, dtype=torch.float64) for _ in range(2))
    y = 0.6 * p + a @ torch.randn(d, d, generator=gen, dtype=torch.float64) / d ** 0.5 + 0.1
    for n_batch, rows in ((2, True), (3, False)):  # 14 tokens (row space), 21 tokens (past d / 2: the moments)
        m = Moments(d, linear=True)
        for i in range(n_batch):
            m.add(y[i:i + 1], p[i:i + 1], (0,), a[i:i + 1])
        assert (m._rows is not None) == rows
        flat = [t[:n_batch, 1:].reshape(-1, d) for t in (y, p, a)]
        for ridge in (LINEAR_RIDGE, 1e-3):
            for got, want in zip(m.solve_linear(ridge), _ridge_reference(*flat, ridge)):
                _close(got, want, 1.0)
        cap = 4.0  # binds: the default ridge has more degrees of freedom than 4
        _, _, w = m.solve_linear(max_df=cap)
        ac, rc = flat[2] - flat[2].mean(0), flat[0] - flat[0].mean(0)
        g = m.solve_linear()[0]
        rc = rc - g * (flat[1] - flat[1].mean(0))
        eig, lo, hi = torch.linalg.eigvalsh(ac.T @ ac), 1e-12, 1e12
        for _ in range(200):  # the ridge at which the df is the cap, by bisection in log lambda
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if ridge_df(eig, mid) > cap else (lo, mid)
        want = torch.linalg.solve(ac.T @ ac + hi * torch.eye(d, dtype=torch.float64), ac.T @ rc)
        torch.testing.assert_close(w, want, rtol=1e-7, atol=1e-10)


def test_linear_refit_surrogate_and_bad_input(tiny, tiny_tokens):
    ad = adapt(tiny)
    plan = [lay for lay in ad.layers() if not ad.is_parallel(lay)][:2]
    if not plan:
        return
    with pytest.raises(InputError, match="linears="):
        fit_corrections(tiny, tiny_tokens, plan, "linear")
    w: dict = {}
    loss, g, b, passes = corrected_loss(tiny, tiny_tokens, plan, "linear", batch_size=8, linears=w)
    assert passes == 1 and sorted(w) == plan and all(t.shape == (ad.d_model, ad.d_model) for t in w.values())
    ref = mean_loss(tiny, tiny_tokens, parallel_blocks(tiny, plan, g, b, w), 8)
    assert abs(loss - ref) <= 1e-9  # the fitting forward's loss is the corrected model's loss
    # many batches: one fitting forward per layer, the same fit
    w2: dict = {}
    loss2, _, _, passes2 = corrected_loss(tiny, tiny_tokens, plan, "linear", batch_size=1, linears=w2)
    assert passes2 == len(plan) + 1 and abs(loss2 - loss) <= 1e-6
    for lay in plan:
        assert float((w2[lay] - w[lay]).abs().max()) <= 1e-6 * max(1.0, float(w[lay].abs().max()))
    with pytest.raises(InputError, match="d_model"):
        parallel_blocks(tiny, plan, linears={plan[0]: torch.zeros(3, 3)})
    stray = next((q for q in ad.layers() if q not in plan[:1]), None)
    if stray is not None:
        with pytest.raises(InputError, match="not in layers"):
            parallel_blocks(tiny, plan[:1], linears={stray: torch.zeros(ad.d_model, ad.d_model)})
    assert_no_hooks(tiny)


def test_plan_parallel_linear(planner_model, planner_tokens, tmp_path):
    from tl_steering.parallel.apply import parallelize

    cal, held = planner_tokens[:4], planner_tokens[4:]
    kw = {"held_out": held, "strategy": ["C", "attribution_abs", "sleb"], "batch_size": 4, "fisher_samples": 0}
    lin = ts.plan_parallel(planner_model, cal, 2, refit="linear", **kw)
    again = ts.plan_parallel(planner_model, cal, 2, refit="linear", **kw)
    d = adapt(planner_model).d_model
    assert lin.layers == again.layers and torch.equal(lin.linears, again.linears)  # deterministic
    assert lin.linears.shape == (2, d, d) and float(lin.linears.abs().max()) > 0
    assert sorted(lin.linear_maps()) == lin.layers
    ad = adapt(planner_model)
    # held out: the stored corrections (fitted on all calibration windows), re-measured with the plan's hooks
    held_d = mean_loss(ad, held, lin.hooks(planner_model), 4) - lin.clean_loss_held_out
    assert abs(held_d - lin.held_out_delta_ce) <= 1e-9
    # calibration: the out-of-fold loss (refit_crossfit defaults to on for "linear")
    assert lin.options["refit_crossfit"] is True
    oof = RefitLoss(planner_model, cal, 4, refit="linear", crossfit=True).delta(lin.layers)
    assert abs(oof - lin.calibration_delta_ce) <= 1e-9
    g, b = lin.corrections()
    par = parallelize(planner_model, lin.layers, gates=g, biases=b, linears=lin.linear_maps())
    held_exec = mean_loss(adapt(par), held, (), 4) - lin.clean_loss_held_out
    assert abs(held_exec - lin.held_out_delta_ce) <= 1e-5
    path = tmp_path / "plan.safetensors"
    lin.save(path)
    back = type(lin).load(path)
    assert torch.equal(back.linears, lin.linears) and back.refit == "linear"
    assert_no_hooks(planner_model)


def test_crossfit_loss_is_out_of_fold(planner_model, planner_tokens):
    """RefitLoss(crossfit=True): the corrections fitted on each half of the windows, measured on the other half,
    token-weighted; written here with fit_corrections + parallel_blocks on the halves."""
    toks = planner_tokens[:5]  # 3 + 2 windows: unequal halves
    plan = [0, 2]
    for refit in ("linear", "affine"):
        rl = RefitLoss(planner_model, toks, 4, refit=refit, crossfit=True)
        got = rl(plan)
        a, b = toks[:3], toks[3:]
        fits = []
        for part in (a, b):
            w: dict = {}
            g, bias, _ = fit_corrections(planner_model, part, plan, refit, batch_size=4, linears=w)
            fits.append(parallel_blocks(planner_model, plan, g, bias, w))
        want = (mean_loss(planner_model, b, fits[0], 4) * 2 + mean_loss(planner_model, a, fits[1], 4) * 3) / 5
        assert abs(got - want) <= 1e-9, (refit, got, want)
        in_sample = RefitLoss(planner_model, toks, 8, refit=refit, crossfit=False)(plan)
        assert got != in_sample
        assert rl.cost_of(plan) == 2 and rl(plan) == got  # memoised
    assert RefitLoss(planner_model, toks, 4, refit="linear").crossfit  # on by default for linear only
    assert not RefitLoss(planner_model, toks, 4, refit="affine").crossfit
    with pytest.raises(InputError, match="at least 2"):  # asked for, cross-fitting needs two windows
        RefitLoss(planner_model, toks[:1], 4, refit="linear", crossfit=True)
    assert not RefitLoss(planner_model, toks[:1], 4, refit="linear").crossfit  # the default: in-sample then
    assert_no_hooks(planner_model)
