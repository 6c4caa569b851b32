"""The claim in its three parts and the Poincaré-Hopf parity of a found set (docs/critical_points.md section 4)."""

import dataclasses

import numpy as np
import pytest
import torch

from tl_steering.critical import CriticalPointsResult, find_equilibria
from tests.planted import planted_field

pytestmark = pytest.mark.one_line("tl4")  # pure torch, no TransformerLens: the same computation on both lines

F64 = torch.float64


def _wrap(results):
    counts = torch.tensor([[r.labels.count(x) for x in ("attractor", "repeller", "saddle", "degenerate")]
                           for r in results])
    n = len(results)
    return CriticalPointsResult(
        layers=list(range(n)), counts=counts, rotational=torch.tensor([sum(r.rotational) for r in results]),
        rotational_pairs=torch.tensor([sum(r.rotational_pairs()) for r in results]),
        n_points=torch.tensor([r.n_points for r in results]), n_converged=torch.tensor([r.n_converged for r in results]),
        n_starts=torch.tensor([r.n_starts for r in results]), radius=torch.ones(n, dtype=F64),
        seconds=torch.zeros(n, dtype=F64), results=results)


def _subset(res, keep):
    """The result restricted to the points ``keep`` (as if the finder had missed the others)."""
    per_point = {f.name: getattr(res, f.name) for f in dataclasses.fields(res)}
    out = {}
    for name, value in per_point.items():
        if name in ("points", "lambdas", "residuals", "eigenvalues", "spectral_abscissa", "max_im_re",
                    "rotational_fraction"):
            out[name] = value[keep]
        elif name in ("labels", "rotational", "index", "near_zero", "hits", "start_index", "start_kind"):
            out[name] = [value[i] for i in keep]
        elif name == "options":  # a missed point's rows reached nothing; the others point at the kept order
            new = {old: i for i, old in enumerate(keep)}
            out[name] = {**value, "row_point": [new.get(j, -1) for j in value.get("row_point", [])]}
        else:
            out[name] = value
    return type(res)(**out)


@pytest.fixture(scope="module")
def planted12():
    p = planted_field(12, seed=0)
    res = find_equilibria(p, 12, n_starts=16, seed=0)
    assert res.n_points == 16 and sorted(res.index) == sorted(p.index)
    return res


def test_parity_of_a_complete_set_is_zero_and_a_missed_point_shows(planted12):
    # d = 12: S^11 has Euler characteristic 0; indices 0, 1, 2, 3, 6, 9, 10, 11 (each twice) have signs (-1)^(11-k)
    par = planted12.parity()
    assert par == {"index_sum": 0, "euler_characteristic": 0, "missing_at_least": 0}
    even = [i for i, k in enumerate(planted12.index) if k % 2 == 0]
    odd = [i for i, k in enumerate(planted12.index) if k % 2 == 1]
    assert len(even) == len(odd) == 8
    # three points of even index missed: the bound is exactly 3
    keep = [i for i in range(16) if i not in even[:3]]
    assert _subset(planted12, keep).parity()["missing_at_least"] == 3
    # one even and one odd missed: the bound is 0 (a lower bound, not a count)
    keep = [i for i in range(16) if i not in (even[0], odd[0])]
    assert _subset(planted12, keep).parity()["missing_at_least"] == 0


def test_parity_on_an_even_dimensional_sphere():
    # d = 5: S^4 has Euler characteristic 2 (every tangent field has a zero: the empty set misses at least 2)
    rng = np.random.default_rng(1)
    q, _ = np.linalg.qr(rng.standard_normal((5, 5)))
    a = torch.tensor(q @ np.diag([-2.0, -1.0, 0.5, 1.5, 3.0]) @ q.T)
    res = find_equilibria(lambda u: u @ a.T, 5, n_starts=16, seed=0)
    assert res.n_points == 10 and sorted(res.index) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert res.parity() == {"index_sum": 2, "euler_characteristic": 2, "missing_at_least": 0}
    assert _subset(res, []).parity()["missing_at_least"] == 2
    deg = _subset(res, list(range(10)))
    deg.labels[0] = "degenerate"
    assert deg.parity()["missing_at_least"] is None


def test_claim_in_three_parts(planted12):
    out = _wrap([planted12])
    c = out.claim().parts
    # 2 attractors (index 0) among 16 points: "not attractors" fails; every planted point has rotational modes
    assert c["not_attractors"] == {"attractors": 2, "layers_with_attractor": [0], "n_layers": 1, "verdict": "fails"}
    assert c["rotational_modes"]["rotational"] == 16 and c["rotational_modes"]["verdict"] == "supported"
    # the found set's fraction decides nothing; the census bound of the run's random starts does (12 saddles
    # against at most ~4 stable points: tests/unit/critical/test_census.py)
    assert c["pooled"]["saddles"] == 12 and c["mostly_saddles_decided"] is True
    assert c["census"][0]["verdict"] == "supported" and c["census"][0]["saddles_found"] == 12
    assert c["census"][0]["non_saddles_high"] < 12
    assert "landscape" in c["why_undecided"] and "by_crossing" not in c
    assert c["parity"]["missing_at_least"] == 0 and out.summary()["missed_at_least"] == 0.0
    no_attr = _subset(planted12, [i for i, k in enumerate(planted12.index) if k != 0])
    assert _wrap([no_attr]).claim().parts["not_attractors"]["verdict"] == "not contradicted"


def test_the_claim_judges_each_part(planted12):
    c = _wrap([planted12]).claim()
    assert c.verdict == "does not hold" and c.interval == (c.parts["pooled"]["ci_low"], c.parts["pooled"]["ci_high"])
    assert "'not attractors' fails: 2 verified attractors on 1 of 1 layer" in c.why
    assert "rotational modes: 16 of 16 points (100%" in c.why and "supported" in c.why
    assert "'mostly saddles' is not decided by this sample: 12 of 16 found are saddles (75%" in c.why
    assert "Poincaré-Hopf" not in c.why  # the complete set misses none
    assert c.why.endswith("the census bound from its random starts (critical_census) supports it on layers [0]")
    from tl_steering.report.critical_table import critical_layer_table

    cen = c.parts["census"][0]  # the report's table states the layer's census verdict
    assert f"<td>12 / {cen['non_saddles_high']:.1f}: supported</td>" in critical_layer_table(_wrap([planted12]))
    missed = _subset(planted12, [i for i, k in enumerate(planted12.index) if k not in (0, 2)])
    c = _wrap([missed]).claim()
    assert c.verdict == "undecided"  # no attractor, and no sample decides "mostly saddles"
    assert "'not attractors' is not contradicted" in c.why and "at least 4 equilibria went unfound" in c.why


def test_a_layer_without_equilibria_says_what_was_tried():
    from tl_steering.report.critical_table import critical_layer_table

    # a complex structure on R^4: F(u) is orthogonal to u everywhere, so the field has no equilibrium on S^3
    j = torch.tensor([[0.0, -1, 0, 0], [1, 0, 0, 0], [0, 0, 0, -2], [0, 0, 2, 0]], dtype=F64)
    res = find_equilibria(lambda u: u @ j.T, 4, n_starts=6, seed=0)
    assert res.n_points == 0
    out = _wrap([res])
    assert out.claim().parts["not_attractors"]["verdict"] == "no equilibria"
    assert out.claim().parts["parity"]["missing_at_least"] == 0  # chi(S^3) = 0: no point need exist
    table = critical_layer_table(out)
    assert f"no equilibrium found from 6 starts ({res.n_starts} rows): power iteration of F and -F" in table
