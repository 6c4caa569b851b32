"""The finder (the flow phase, then the solution-landscape phase) on planted fields whose equilibria, λ, Morse indices and labels are known
(docs/critical_points.md, sections 8-9). No model is loaded; float64 on CPU; tolerances stated per comparison."""

import pytest
import torch

from tl_steering.critical import classify_point, find_equilibria
from tl_steering.critical.landscape import explained
from tests.planted import planted_field, symmetric_field

#: the budget of the coverage measurements (docs/critical_points.md section 9)
FULL = {"landscape_solves": 256}

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.one_line("tl4")]  # pure torch, no TransformerLens: the same computation on both lines


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
    saddles (measured: 1.2 s per seed, 104 landscape rows of which 24 converge; 80 starts deferred as explained
    by a known point, the last new point found at landscape row 20-24, 72 before the deferral)."""
    p = planted_field(12, seed=seed)
    r = find_equilibria(p, 12, n_starts=16, seed=seed, options=FULL)
    assert r.method == "landscape" and r.options["landscape_rows"] > 0
    assert all(ok for _, ok in _found(p, r)), [k for k, ok in _found(p, r) if not ok]
    assert r.n_points == 16 and bool((r.residuals <= 1e-10).all())
    flow = find_equilibria(p, 12, n_starts=16, seed=seed, options={"landscape_solves": 0})
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
    r = find_equilibria(p, 12, n_starts=16, seed=seed, options=FULL)
    assert all(ok for _, ok in _found(p, r)), [k for k, ok in _found(p, r) if not ok]


def test_default_finder_finds_every_planted_equilibrium_d576():
    """d = 576, indices 0, 1, 2, 3, 288 = d/2, 573, 574, 575 (each ±): all 16 by the default finder from 16 random
    starts, λ (1e-9), index and label right (measured 23 s on one loaded core: landscape 20 s, 104 rows, 944
    dense Jacobians of the field; the last new point at landscape row 20, 72 before the deferral of explained starts)."""
    p = planted_field(576, seed=0)
    r = find_equilibria(p, 576, n_starts=16, seed=0, options=FULL)
    assert all(ok for _, ok in _found(p, r)), [k for k, ok in _found(p, r) if not ok]
    assert r.n_points == 16


@pytest.mark.parametrize("d,seed", [(12, 0), (24, 3), (32, 0)])
def test_default_finder_finds_every_equilibrium_of_a_symmetric_linear_field(d, seed):
    """Symmetric linear field (:func:`symmetric_field`), d = 12 / 24 / 32: all 2d equilibria ±q_i (every Morse index
    0..d-1, each sign) by the default finder from 16 starts within its 256 landscape rows, λ (1e-9), index and label
    right. Before the deferral of explained starts, d = 24 seed 3 found 38 of 48 and d = 32 seed 0 44 of 64: the 256
    rows ran out on starts heading to known neighbours. Measured now: every point for d = 12, 16, 24, 32, seeds 0-3,
    the last new point at landscape row 30-38 / 42-50 / 78-86 / 110-114; ~2 s each."""
    p = symmetric_field(d, seed)
    r = find_equilibria(p, d, n_starts=16, seed=seed, options=FULL)
    assert r.n_points == 2 * d and bool((r.residuals <= 1e-10).all())
    assert all(ok for _, ok in _found(p, r)), [k for k, ok in _found(p, r) if not ok]
    o = r.options
    assert o["landscape_rows"] <= 256 and o["landscape_deferred"] > 0
    assert 0 <= o["landscape_deferred_run"] <= o["landscape_deferred"]
    # exhausted = every queued start ran (deferred ones included); a phase stopped short of 256 rows ran out of starts
    assert not o["landscape_exhausted"] or o["landscape_deferred_run"] == o["landscape_deferred"]
    assert o["landscape_exhausted"] or o["landscape_rows"] == 256


def test_explained_start_is_a_known_point_along_its_direction():
    """On a linear field the tangent eigenvector at v_j toward v_i is P v_i exactly, so the start v_j + δ P v_i is
    explained (cosine 1) once v_i is known, and not by v_j itself, -v_j or a point off that direction."""
    q = symmetric_field(6, 0).points[:6].T  # columns: the eigenvectors q_i
    x, w = q[:, 2], q[:, 4]  # v_2 and the tangent direction toward v_4 (orthogonal eigenvectors)
    assert not explained(x, w, torch.stack([x, -x]))
    assert not explained(x, w, torch.stack([x, q[:, 3], -q[:, 4]]))  # -v_4 lies along -w
    assert explained(x, w, torch.stack([x, q[:, 3], q[:, 4]]))
    assert explained(x, -w, torch.stack([-q[:, 4]]))
    off = torch.nn.functional.normalize(q[:, 4] + 0.2 * q[:, 5], dim=0)  # cosine 0.98 with w: below 0.99
    assert not explained(x, w, off[None]) and explained(x, w, off[None], cos=0.95)



@pytest.mark.parametrize("close", [False, True])
def test_real_eigvecs_are_the_tangent_eigenvectors(close):
    """On a symmetric linear field at q_j the tangent matrix has the eigenvalues μ_i - μ_j with eigenvectors Qᵀ q_i:
    inverse iteration returns them (1 - |cos| <= 1e-12, residual <= 1e-10 max|M|); with two picked eigenvalues 1e-13
    apart (μ_2 = μ_1 + 1e-13), the LAPACK path returns unit eigenvectors of M instead (residual <= 1e-10 max|M|)."""
    from tl_steering.critical.fields import _FieldAdapter, _Householder
    from tl_steering.critical.spectrum import point_eig, real_eigvecs, tangent_matrix

    q = symmetric_field(8, 0).points[:8].T  # columns q_i
    mu = torch.tensor([-3.0, -1.0, -0.5, 0.2, 0.7, 1.5, 2.0, 3.0], dtype=torch.float64)
    if close:
        mu[2] = mu[1] + 1e-13
    a = q @ torch.diag(mu) @ q.T
    fld = _FieldAdapter(lambda u: u @ a.T, 8, torch.float64, torch.device("cpu"))
    x = q[:, 4]
    fld.probe(torch.stack([x, -x]))
    lam = float(x @ fld.one(x))
    vals = point_eig(fld, x, lam)
    picks = [1, 2, 5, 6]
    mus = [float(mu[i] - mu[4]) for i in picks]
    assert torch.allclose(torch.sort(vals.real).values, torch.sort(torch.cat([mu[:4], mu[5:]]) - mu[4]).values,
                          atol=1e-12)
    vecs = real_eigvecs(fld, x, lam, mus)
    m = tangent_matrix(x, fld.point_jacobians(x[None])[0], lam)
    scale = float(m.abs().max())
    assert float((m @ vecs - vecs * torch.tensor(mus, dtype=torch.float64)).norm(dim=0).max()) <= 1e-10 * scale
    assert torch.allclose(vecs.norm(dim=0), torch.ones(4, dtype=torch.float64), atol=1e-14)
    if not close:
        want = torch.stack([_Householder(x).qt(q[:, i]) for i in picks], dim=1)  # Qᵀ q_i
        cos = (want * vecs).sum(0).abs() / want.norm(dim=0)
        assert float((1 - cos).abs().max()) <= 1e-12


_TWO_THREADS = """
import torch
from tl_steering.critical.landscape import _newton_steps
gen = torch.Generator().manual_seed(0)
n, d = 4, 576
u = torch.randn(n, d, generator=gen, dtype=torch.float64)
u = u / u.norm(dim=-1, keepdim=True)
f = torch.randn(n, d, generator=gen, dtype=torch.float64)
base = torch.randn(d, d, generator=gen, dtype=torch.float64)
known = torch.randn(2, d, generator=gen, dtype=torch.float64)
rel = torch.tensor([0.5, 1e-5, 0.5, 1e-5], dtype=torch.float64)  # two float32 rows, two float64 rows


class Field:
    def jacobians(self, x, dtype=None):
        return (base + x[:, :, None] * x[:, None, :]).to(dtype)


torch.set_num_threads(1)
one = _newton_steps(Field(), u, f, rel, known)[0]
torch.set_num_threads(2)
two = _newton_steps(Field(), u, f, rel, known)[0]
assert torch.get_num_threads() == 2
print(float((one - two).abs().max() / one.abs().max()))
"""


def test_batched_newton_solve_returns_on_two_threads():
    """The landscape's batched Newton solve (577 x 577 bordered systems) returns on two torch threads with the
    one-thread steps: torch's batched CPU LU on two threads hangs inside MKL (docs/critical_points.md section 2),
    so it runs on one intra-op thread. A subprocess with a time limit, so that a hang fails instead of waiting."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", _TWO_THREADS], capture_output=True, text=True, timeout=120,
                         cwd=root, env={**os.environ, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"})
    assert out.returncode == 0 and "DLASWP" not in out.stderr, out.stderr[-2000:]
    assert float(out.stdout.strip().splitlines()[-1]) == 0.0  # the same kernels: one thread either way
