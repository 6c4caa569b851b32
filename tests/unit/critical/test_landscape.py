"""The default finder (method="landscape": the flow finder, then the solution-landscape phase) and the Newton
homotopy (method="homotopy") on planted fields whose equilibria, λ, Morse indices and labels are known
(docs/critical_points.md, sections 8-9). No model is loaded; float64 on CPU; tolerances stated per comparison."""

import pytest
import torch

from tl_steering.critical import classify_point, find_equilibria
from tl_steering.critical.planted import planted_field

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _found(p, r) -> list[tuple[int, bool]]:
    """(planted index, found with its λ to 1e-9, index and label) for every planted point."""
    out = []
    for x, lam, k, lab in zip(p.points, p.lambdas, p.index, p.labels):
        if not r.n_points:
            out.append((k, False))
            continue
        dist = (r.points - x).norm(dim=-1)
        j = int(dist.argmin())
        ok = float(dist[j]) < 1e-8 and abs(float(r.lambdas[j]) - float(lam)) < 1e-9
        out.append((k, ok and r.index[j] == k and r.labels[j] == lab))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_default_finder_finds_every_planted_equilibrium_d12(seed):
    """Linear non-normal planted field, indices 0, 1, 2, 3, 6 = d/2, 9, 10, 11 (each ±): the default finder (no
    method given) finds all 16 from 16 random starts with λ (1e-9), index and label right, and nothing else (a
    linear field has no other equilibrium); the flow finder alone finds only the attractors, repellers and boundary
    saddles (measured: 1.2 s per seed, 104 landscape rows of which 18 converge)."""
    p = planted_field(12, seed=seed)
    r = find_equilibria(p, 12, n_starts=16, seed=seed)
    assert r.method == "landscape" and r.options["landscape_rows"] > 0
    assert all(ok for _, ok in _found(p, r)), [k for k, ok in _found(p, r) if not ok]
    assert r.n_points == 16 and bool((r.residuals <= 1e-10).all())
    flow = find_equilibria(p, 12, n_starts=16, seed=seed, method="flow")
    assert sum(ok for _, ok in _found(p, flow)) < 16
    assert {6} & {k for k, ok in _found(p, flow) if not ok}  # the middle index is out of the flow's reach


@pytest.mark.parametrize("seed,gamma", [(0, 2.0), (1, 6.0), (3, 6.0)])
def test_default_finder_nonlinear_planted_field_d12(seed, gamma):
    """F(u) = A u + γ Z_8 W p(Zᵀ_8 u) (a quartic coupling vanishing to first order at the 8 planted axes, so ±z_j
    keep the linear field's λ, index and label while the great circles between them are no longer invariant, and
    at γ = 6 further equilibria appear): every planted point is found by the default finder (measured 16/16 for
    seeds 0-3 at γ = 2 and 6; 22-24 points in all at γ = 6)."""
    p = planted_field(12, seed=seed, quartic=gamma)
    for x, k in zip(p.points[:2], p.index[:2]):  # the ground truth is what the classifier measures
        c = classify_point(p, x)
        assert c.residual < 1e-12 and c.index == k
    r = find_equilibria(p, 12, n_starts=16, seed=seed)
    assert all(ok for _, ok in _found(p, r)), [k for k, ok in _found(p, r) if not ok]


def test_default_finder_finds_every_planted_equilibrium_d576():
    """d = 576, indices 0, 1, 2, 3, 288 = d/2, 573, 574, 575 (each ±): all 16 by the default finder from 16 random
    starts, λ (1e-9), index and label right (measured 23 s on one loaded core: landscape 20 s, 104 rows, 965
    dense Jacobians of the field)."""
    p = planted_field(576, seed=0)
    r = find_equilibria(p, 576, n_starts=16, seed=0)
    assert all(ok for _, ok in _found(p, r)), [k for k, ok in _found(p, r) if not ok]
    assert r.n_points == 16


def test_homotopy_reaches_roots_of_every_kind_and_only_roots():
    """Newton homotopy from 8 random starts, both directions (16 paths), d = 12, linear planted field (seed 1):
    every path crosses t = 1; every point reported is a planted equilibrium (a linear field has no other) with its
    λ, index and label; the sample holds attractors, repellers and saddles of low, middle and high index
    (measured: 15 of the 16 planted points, 300 steps per path)."""
    p = planted_field(12, seed=1)
    r = find_equilibria(p, 12, n_starts=8, seed=1, method="homotopy")
    assert r.method == "homotopy" and r.options["paths"] == 16 and r.options["paths_reaching_t1"] == 16
    found = _found(p, r)
    assert sum(ok for _, ok in found) == r.n_points >= 12
    assert {0, 1, 6, 10, 11} <= {k for k, ok in found if ok}
    counts = r.counts()
    assert counts["attractor"] >= 1 and counts["repeller"] >= 1 and counts["saddle"] >= 8
