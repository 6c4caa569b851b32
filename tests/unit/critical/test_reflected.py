"""The reflected finder (method="reflected") on planted fields whose equilibria and Morse indices are known
(docs/critical_points.md, section 8). No model is loaded; float64 on CPU; tolerances stated per comparison."""

import pytest
import torch

from tl_steering.critical import classify_point, find_equilibria
from tl_steering.critical.dynamics import _reached, power_iterate
from tl_steering.critical.fields import _FieldAdapter, _normalize
from tl_steering.critical.planted import planted_field
from tl_steering.critical.reflected import reflected_solve
from tl_steering.errors import InputError

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.one_line("tl4")]  # pure torch, no TransformerLens: the same computation on both lines

F64 = torch.float64


def test_planted_field_ground_truth_is_what_the_classifier_measures():
    p = planted_field(12, seed=0)
    assert sorted(p.index) == [0, 0, 1, 1, 2, 2, 3, 3, 6, 6, 9, 9, 10, 10, 11, 11]
    for x, lam, k, lab in zip(p.points, p.lambdas, p.index, p.labels):
        c = classify_point(p, x)
        assert c.residual < 1e-12
        assert abs(c.lam - float(lam)) < 1e-10
        assert (c.index, c.label, c.rotational) == (k, lab, True)
    with pytest.raises(InputError, match="multiple of 4"):
        planted_field(10)


def test_reflected_finder_finds_every_planted_equilibrium_d12():
    """Indices 0, 1, 2, 3, d/2, d-3, d-2, d-1 (each ±): all 16 points from 48 random starts (seed 1), with the
    planted λ (1e-9), index and label; nothing else is reported (a linear field has no other equilibrium). The
    reflected rows alone reach 13 of them here (both index-6 points and one index-10 point are missed): the
    landscape searches from the points found supply the rest."""
    p = planted_field(12, seed=1)
    r = find_equilibria(p, 12, n_starts=48, seed=1, method="reflected", max_iter=100)
    assert r.n_points == 16
    assert bool((r.residuals <= 1e-10).all())
    for x, lam, k, lab in zip(p.points, p.lambdas, p.index, p.labels):
        dist = (r.points - x).norm(dim=-1)
        j = int(dist.argmin())
        assert float(dist[j]) < 1e-8, f"planted point of index {k} not found"
        assert abs(float(r.lambdas[j]) - float(lam)) < 1e-9
        assert (r.index[j], r.labels[j]) == (k, lab)
    assert r.options["method"] == "reflected" and r.options["landscape"] is True
    assert r.options["reflected_rows"] == 48 and r.options["jacobians"] > 0 and r.options["landscape_rows"] > 0
    plain = find_equilibria(p, 12, n_starts=48, seed=1, method="reflected", max_iter=100, landscape=False)
    assert plain.n_points < 16


def test_fixed_index_search_reaches_only_that_index():
    """GHiSD with k fixed: every index-k equilibrium is an attractor of the reflected flow and no other is, so the
    rows that converge land on points of index k (d = 12, k = 6 = d/2, 12 random starts)."""
    p = planted_field(12, seed=1)
    fld = _FieldAdapter(p, 12, F64, torch.device("cpu"))
    u0 = _normalize(torch.randn(12, 12, generator=torch.Generator().manual_seed(3), dtype=F64))
    fld.probe(u0[:2])
    u, rel, _, status, info = reflected_solve(fld, u0, 1e-10, 100, target_index=[6] * 12)
    ok = (status == 0).nonzero().flatten().tolist()
    assert len(ok) >= 10
    for i in ok:
        assert float(rel[i]) <= 1e-10
        dist = (p.points - u[i]).norm(dim=-1)
        j = int(dist.argmin())
        assert float(dist[j]) < 1e-8 and p.index[j] == 6


def test_reflected_needs_dense_spectra():
    p = planted_field(12)
    with pytest.raises(InputError, match="reflected"):
        find_equilibria(p, 12, n_starts=2, method="reflected", eigensolver="arpack", n_eigs=2)


def test_result_carries_index_histogram_and_sample_and_the_report_renders_them():
    from tl_steering.critical import CriticalPointsResult
    from tl_steering.report.critical_table import critical_histogram, critical_layer_table

    p = planted_field(12, seed=0)
    res = find_equilibria(p, 12, n_starts=16, seed=0, starts=p.points[:4], method="lm")
    counts = torch.tensor([[res.labels.count(x) for x in ("attractor", "repeller", "saddle", "degenerate")]])
    out = CriticalPointsResult(layers=[3], counts=counts, rotational=torch.tensor([sum(res.rotational)]),
                               rotational_pairs=torch.tensor([sum(res.rotational_pairs())]),
                               n_points=torch.tensor([res.n_points]), n_converged=torch.tensor([res.n_converged]),
                               n_starts=torch.tensor([res.n_starts]), radius=torch.tensor([1.0], dtype=F64),
                               seconds=torch.tensor([res.seconds], dtype=F64), results=[res])
    s = out.sample()
    assert s["methods"] == ["lm"] and s["token_starts_per_layer"] == [4] and s["starts_per_layer"] == [16]
    assert s["points"] == res.n_points and s["rows"] == 16 and "Levenberg" in s["note"]
    summ = out.summary()
    assert summ["morse_histogram"] == res.morse_histogram()
    html = critical_histogram(out)
    hist = res.morse_histogram()
    # d = 12 bins: 0, 1, 2, 3-5, 6-8, 9, 10, 11
    expect = [hist.get(0, 0), hist.get(1, 0), hist.get(2, 0), sum(hist.get(k, 0) for k in (3, 4, 5)),
              sum(hist.get(k, 0) for k in (6, 7, 8)), hist.get(9, 0), hist.get(10, 0), hist.get(11, 0)]
    assert "<th>3-5</th><th>6-8</th>" in html
    assert "<td>points</td>" + "".join(f"<td>{n}</td>" for n in expect) in html
    assert f"Sample: {res.n_points} distinct equilibria over 1 layer(s), finder lm, 16 starts per layer (4 token" in html
    assert html in critical_layer_table(out)


def test_flow_finder_shifts_the_map_where_the_power_iteration_fixes_nothing():
    """Linear field, d = 6: ±e1 is the only attractor (λ = 1, tangent spectrum -0.5 ± 1.5i, -0.75, -2.2, -2.3), and
    the rotation pair 0.5 ± 1.5i dominates |eigenvalue|, so the plain map u <- normalize(±F(u)) only rotates (no
    fixed point for either sign); the shifted map normalize(F + σu) holds ±e1 once 1 + σ > |μ|²/(2|Re μ|) = 2.5:
    σ = 1·median ||F|| (~1.2) does not, σ = 4·median ||F|| does."""
    a = torch.zeros(6, 6, dtype=F64)
    a[0, 0] = 1.0
    a[1:3, 1:3] = torch.tensor([[0.5, 1.5], [-1.5, 0.5]], dtype=F64)
    a[3, 3], a[4, 4], a[5, 5] = 0.25, -1.2, -1.3
    q = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(0), dtype=F64))[0]
    m = q @ a @ q.T
    r = find_equilibria(lambda u: u @ m.T, 6, n_starts=8, seed=0, method="flow")
    assert r.options["shift"][0] > 2.5
    assert r.options["power_converged"] >= 8 and "lm_rows" not in r.options  # the power rows, not the LM fallback
    e1 = q[:, 0]
    for x in (e1, -e1):
        dist = (r.points - x).norm(dim=-1)
        j = int(dist.argmin())
        assert float(dist[j]) < 1e-8 and r.labels[j] == "attractor" and abs(float(r.lambdas[j]) - 1.0) < 1e-9
        assert r.start_kind[j] == "random/power+"


def test_flow_shifts_a_sign_whose_rows_sit_on_a_point_of_the_other_sign():
    """d = 4, μ = (-3, -1, 0.5, 2): the plain map u <- normalize(A u) is dominated by μ = -3 (it flips ±v_1, a 2-cycle
    on an equilibrium with λ < 0), so no +1 row reaches a point with λ > 0. Such rows do not count as fixed for
    s = +1 (docs/critical_points.md, section 8.3): the shifted map normalize(A u + σ u) reaches the attractor v_4
    (λ = 2, index 0), which the plain +1 map cannot; the s = -1 sign needs no shift. Before the fix (a small residual
    alone counted as fixed) the +1 sign was never shifted: measured, the attractor was then reached only by an LM
    finish of an s = -1 edge row, by chance."""
    q = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(0), dtype=F64))[0]
    mu = torch.tensor([-3.0, -1.0, 0.5, 2.0], dtype=F64)
    a = q @ torch.diag(mu) @ q.T
    fld = _FieldAdapter(lambda u: u @ a.T, 4, F64, torch.device("cpu"))
    u0 = torch.nn.functional.normalize(torch.randn(8, 4, generator=torch.Generator().manual_seed(1),
                                                   dtype=F64), dim=-1)
    plus = torch.ones(8, dtype=F64)
    up, rel = power_iterate(fld, u0, plus, 200, 1e-10)
    assert bool((rel < 1e-10).all()) and bool(((up @ q[:, 0]).abs() > 1 - 1e-9).all())  # all on ±v_1 (λ = -3)
    assert not _reached(fld, up, rel, plus) and _reached(fld, up, rel, -plus)
    r = find_equilibria(lambda u: u @ a.T, 4, n_starts=8, seed=1, method="flow")
    assert r.options["shift"][0] > 0 and r.options["shift"][1] == 0
    assert r.options["plain_rows"] == 8  # the plain +1 rows (on ±v_1, an equilibrium) are kept as extra rows
    j = int((r.points - q[:, 3]).norm(dim=-1).argmin())
    assert float((r.points[j] - q[:, 3]).norm()) < 1e-8 and r.labels[j] == "attractor" and r.index[j] == 0
    assert r.start_kind[j] == "random/power+"  # reached by the (shifted) +1 map itself
    assert abs(float(r.lambdas[j]) - 2.0) < 1e-10
