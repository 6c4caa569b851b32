"""Unit tests of the equilibrium finder (docs/critical_points.md): fields with analytically known equilibria and spectra.

No model is loaded. Tolerances are stated per comparison; everything runs in float64 on CPU.
"""

import re
import time

import numpy as np
import plotly.graph_objects as go
import pytest
import scipy.linalg
import torch
from jaxtyping import TypeCheckError

from tl_steering.critical.fields import _Householder, relative_residual  # noqa: PLC2701 - the reflector itself
from tl_steering.critical.finder import classify_point, find_equilibria
from tl_steering.critical.results import EquilibriaResult, PointClassification
from tl_steering.critical.spectrum import DENSE_MAX_DIM
from tl_steering.critical.spectrum import _resolve_eigensolver  # noqa: PLC2701 - the auto rule itself
from tl_steering.errors import InputError

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.one_line("tl4")]  # pure torch, no TransformerLens: the same computation on both lines

F64 = torch.float64


def _orthogonal(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=F64))
    return q


# ---------------------------------------------------------------------------------------------------------
# symmetric linear field: equilibria = ±eigenvectors, tangent spectrum at v_i = {μ_j - μ_i}

MU = torch.tensor([3.0, 2.0, 1.0, -0.5, -1.5, -2.5], dtype=F64)
V = _orthogonal(6, 0)  # columns = eigenvectors
M_SYM = V @ torch.diag(MU) @ V.T


def _linear(m: torch.Tensor):
    return lambda u: u @ m.T  # batched convention


def _check_symmetric_point(p: torch.Tensor, lam: float, eigs: torch.Tensor, label: str, index: int) -> int:
    overlaps = (V.T @ p).abs()
    i = int(overlaps.argmax())
    assert overlaps[i] > 1 - 1e-12  # p = ±v_i
    assert abs(lam - float(MU[i])) < 1e-10
    expected = torch.sort(torch.cat([MU[:i], MU[i + 1:]]) - MU[i], descending=True).values
    assert eigs.imag.abs().max() < 1e-8
    torch.testing.assert_close(eigs.real, expected, rtol=0, atol=1e-8)
    n_larger = int((MU > MU[i]).sum())
    assert index == n_larger
    assert label == ("attractor" if i == 0 else "repeller" if i == len(MU) - 1 else "saddle")
    return i


def test_symmetric_linear_random_starts_find_only_eigenvectors():
    res = find_equilibria(_linear(M_SYM), 6, n_starts=64, seed=0)
    o = res.options
    assert o["n_starts"] == 64 and res.eigensolver == "dense" and res.method == "landscape"
    assert o["power_rows"] == 128 and o["landscape_rows"] == 40
    assert res.n_starts == o["power_rows"] + o["edge_rows"] + o["plain_rows"] + o["landscape_rows"]
    assert res.eigenvalues.shape == (res.n_points, 5) and res.eigenvalues.dtype == torch.complex128
    assert bool((res.residuals < 1e-8).all())
    found = set()
    for k in range(res.n_points):
        i = _check_symmetric_point(res.points[k], float(res.lambdas[k]), res.eigenvalues[k], res.labels[k],
                                   res.index[k])
        found.add((i, int(torch.sign(res.points[k] @ V[:, i]))))
    # the power rows reach the ends (±v_1 for F, ±v_6 for -F), edge tracking and the landscape the rest
    assert found == {(i, s) for i in range(6) for s in (1, -1)}
    assert len(found) == res.n_points  # deduplicated
    assert sum(res.hits) == res.n_converged
    assert {k.split("/")[0] for k in res.start_kind} <= {"random", "edge+", "edge-", "landscape"}
    assert res.counts()["attractor"] == 2 and res.counts()["repeller"] == 2
    assert res.counts()["rotational"] == 0
    # sorted by λ, descending
    assert bool((res.lambdas[:-1] >= res.lambdas[1:]).all())


def test_symmetric_linear_all_twelve_from_perturbed_starts():
    g = torch.Generator().manual_seed(3)
    starts = torch.cat([V.T, -V.T]) + 0.01 * torch.randn(12, 6, generator=g, dtype=F64)
    res = find_equilibria(_linear(M_SYM), 6, n_starts=12, starts=starts)
    assert res.n_points == 12
    assert res.options["given_starts"] == 12
    assert {k.split("/")[0] for k in res.start_kind} <= {"given", "edge+", "edge-", "landscape"}
    seen = {_check_symmetric_point(res.points[k], float(res.lambdas[k]), res.eigenvalues[k], res.labels[k],
                                   res.index[k]) for k in range(12)}
    assert seen == set(range(6))
    assert res.counts() == {"attractor": 2, "repeller": 2, "saddle": 8, "degenerate": 0, "rotational": 0}
    assert res.near_zero == [0] * 12


# ---------------------------------------------------------------------------------------------------------
# non-symmetric linear field M = S + K with a rotation block: complex tangent pairs


def _rotational_matrix() -> tuple[torch.Tensor, torch.Tensor]:
    r = _orthogonal(5, 1)
    block = torch.zeros(5, 5, dtype=F64)
    block[0, 0], block[1, 1], block[2, 2] = 3.0, 1.0, -2.0
    block[3:, 3:] = torch.tensor([[0.5, 2.0], [-2.0, 0.5]], dtype=F64)  # eigenvalues 0.5 ± 2i
    return r @ block @ r.T, r


def test_antisymmetric_part_gives_rotational_modes():
    m, r = _rotational_matrix()
    s, k = (m + m.T) / 2, (m - m.T) / 2
    assert torch.linalg.norm(k) > 1  # really non-symmetric: M = S + K
    cases = {  # real eigenvalue -> (expected tangent spectrum, label)
        0: (3.0, "attractor"),
        1: (1.0, "saddle"),
        2: (-2.0, "repeller"),
    }
    res = find_equilibria(lambda u: m @ u, 5, n_starts=6, starts=torch.cat([r[:, :3].T, -r[:, :3].T]))
    assert res.n_points == 6 and res.options["field_mode"] == "vmap"
    for p, lam, eigs, label, rot, ratio in zip(res.points, res.lambdas, res.eigenvalues, res.labels,
                                               res.rotational, res.max_im_re):
        col = int((r[:, :3].T @ p).abs().argmax())
        mu, want = cases[col]
        assert abs(float(lam) - mu) < 1e-10
        others = [x for x in (3.0, 1.0, -2.0) if x != mu]
        expected = sorted([complex(x - mu) for x in others] + [complex(0.5 - mu, 2.0), complex(0.5 - mu, -2.0)],
                          key=lambda z: (-z.real, z.imag))
        got = sorted(eigs.tolist(), key=lambda z: (-round(z.real, 6), z.imag))
        np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-8, rtol=0)
        assert label == want
        assert rot is True
        assert abs(float(ratio) - 2.0 / abs(0.5 - mu)) < 1e-8
    assert res.counts()["rotational"] == 6
    # the same spectrum from classify_point, and none of it is rotational for the symmetric part alone
    one = classify_point(lambda u: m @ u, r[:, 0])
    assert isinstance(one, PointClassification) and one.label == "attractor" and one.rotational
    assert one.residual < 1e-14
    w, vecs = torch.linalg.eigh(s)
    sym = classify_point(lambda u: s @ u, vecs[:, -1])
    assert not sym.rotational and sym.max_im_re == 0.0


# ---------------------------------------------------------------------------------------------------------
# nonlinear fields with analytically known equilibria


def test_quadratic_field_known_equilibria_and_spectra():
    """F(u) = A u + c <a,u>² a with A symmetric, A a = μ a: F(±a) = (±μ + c) a, so ±a are equilibria with
    λ = μ + c at a and λ = μ - c at -a; DF(±a) = A ± 2c a aᵀ, whose tangent part is A on a^⊥."""
    d, c, mu_a = 5, 0.7, 2.5
    q = _orthogonal(d, 2)
    mus = torch.tensor([mu_a, 2.0, -1.0, 1.3, -2.2], dtype=F64)
    a_mat = q @ torch.diag(mus) @ q.T
    a = q[:, 0]

    def field(u):
        return u @ a_mat.T + c * (u @ a)[..., None] ** 2 * a

    res = find_equilibria(field, d, n_starts=64, seed=0)
    for sign, lam in ((1.0, mu_a + c), (-1.0, mu_a - c)):
        hit = [k for k in range(res.n_points) if float(res.points[k] @ (sign * a)) > 1 - 1e-10]
        assert len(hit) == 1, f"u* = {sign:+}a not found from random starts"
        k = hit[0]
        assert abs(float(res.lambdas[k]) - lam) < 1e-10
        expected = torch.sort(mus[1:] - lam, descending=True).values
        torch.testing.assert_close(res.eigenvalues[k].real, expected, rtol=0, atol=1e-8)
        assert res.eigenvalues[k].imag.abs().max() < 1e-8
    for k in range(res.n_points):  # every reported point really is an equilibrium
        f = field(res.points[k])
        assert float(relative_residual(res.points[k], f)) < 1e-8


def test_planted_mlp_equilibrium_found_and_spectrum_matches_independent_basis():
    """F(u) = W2 tanh(W1 u + b) with W2 corrected so that F(u*) = λ* u* for a chosen u*. The spectrum is checked
    against the analytic DF = W2 diag(1 - h²) W1 in an independent tangent basis (scipy null_space)."""
    g = torch.Generator().manual_seed(1)
    d, hid, lam_star = 5, 16, 1.7
    w1 = torch.randn(hid, d, generator=g, dtype=F64)
    b = 0.3 * torch.randn(hid, generator=g, dtype=F64)
    w2 = torch.randn(d, hid, generator=g, dtype=F64) / hid ** 0.5
    u_star = torch.randn(d, generator=g, dtype=F64)
    u_star /= u_star.norm()
    h = torch.tanh(w1 @ u_star + b)
    w2 = w2 + torch.outer(lam_star * u_star - w2 @ h, h) / (h @ h)

    def field(u):
        return torch.tanh(u @ w1.T + b) @ w2.T

    res = find_equilibria(field, d, n_starts=64, seed=0)
    k = int((res.points @ u_star).argmax())
    assert float(res.points[k] @ u_star) > 1 - 1e-10, "planted equilibrium not found from random starts"
    assert abs(float(res.lambdas[k]) - lam_star) < 1e-10
    df = w2 @ torch.diag(1 - h ** 2) @ w1
    n = torch.as_tensor(scipy.linalg.null_space(u_star[None].numpy()))
    expected = np.linalg.eigvals((n.T @ df @ n - lam_star * torch.eye(d - 1, dtype=F64)).numpy())
    got = res.eigenvalues[k].numpy()
    np.testing.assert_allclose(np.sort_complex(got), np.sort_complex(expected), atol=1e-8, rtol=0)
    assert res.n_converged > 0 and bool((res.residuals < 1e-8).all())


# ---------------------------------------------------------------------------------------------------------
# ARPACK vs dense


OUTLIERS = [4.5, -4.0, 4.0, 3.5, 3.0, -3.0, -3.5]  # real eigenvalues; then 2.5 ± 1.5i, -2.5 ± 1.0i, bulk in [-1, 1]


def _schur_matrix(d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random non-symmetric, non-normal m = Q T Qᵀ with a known spectrum, from a real Schur form T: Q is a random
    orthogonal matrix, T is block upper triangular with the outliers, two rotation blocks and a bulk on its
    diagonal, and random couplings in its first 11 rows. Returns m, the eigenvalues, and the unit eigenvectors
    of 4.5 (= Q e_1) and of -4.0 (from the leading 2 × 2 block). No dense eig is needed to build the test."""
    g = torch.Generator().manual_seed(seed)
    q = _orthogonal(d, seed)
    t = torch.zeros(d, d, dtype=F64)
    head = 11
    t[:head] = torch.triu(torch.randn(head, d, generator=g, dtype=F64), diagonal=1) / 2
    bulk = torch.linspace(-1.0, 1.0, d - head, dtype=F64)
    t.diagonal()[:7] = torch.tensor(OUTLIERS, dtype=F64)
    t.diagonal()[head:] = bulk
    t[7:9, 7:9] = torch.tensor([[2.5, 1.5], [-1.5, 2.5]], dtype=F64)
    t[9:11, 9:11] = torch.tensor([[-2.5, 1.0], [-1.0, -2.5]], dtype=F64)
    eig = torch.cat([torch.tensor(OUTLIERS, dtype=torch.complex128),
                     torch.tensor([2.5 + 1.5j, 2.5 - 1.5j, -2.5 + 1.0j, -2.5 - 1.0j]), bulk.to(torch.complex128)])
    m = q @ t @ q.T
    top = q[:, 0]
    x = torch.zeros(d, dtype=F64)
    x[0], x[1] = t[0, 1] / (-4.0 - 4.5), 1.0  # (T + 4 I) x = 0 on the leading 2 × 2 block
    bottom = q @ x
    return m, eig, top, bottom / bottom.norm()


def _expected_tangent(eig: torch.Tensor, lam: float) -> torch.Tensor:
    """{μ_j - λ} over all eigenvalues but one copy of λ, sorted by real part, descending."""
    i = int((eig - lam).abs().argmin())
    rest = torch.cat([eig[:i], eig[i + 1:]]) - lam
    return rest[torch.argsort(rest.real, descending=True, stable=True)]


def _extremes(eigs: torch.Tensor, n_eigs: int) -> torch.Tensor:
    """Real parts of the n_eigs rightmost (descending) then the n_eigs leftmost (ascending) eigenvalues: the
    layout of the ARPACK output."""
    re = eigs.real
    return torch.cat([torch.sort(re, descending=True).values[:n_eigs], torch.sort(re).values[:n_eigs]])


def _assert_extremes_agree(dense: torch.Tensor, arpack: torch.Tensor, n_eigs: int) -> None:
    got = torch.cat([torch.sort(arpack.real[:n_eigs], descending=True).values,
                     torch.sort(arpack.real[n_eigs:]).values])
    torch.testing.assert_close(got, _extremes(dense, n_eigs), rtol=0, atol=1e-6)


def test_arpack_matches_dense_d256_through_the_finder():
    d, n_eigs = 256, 6
    m, eig, top, bottom = _schur_matrix(d, 0)
    g = torch.Generator().manual_seed(5)
    starts = torch.stack([top, bottom]) + 1e-4 * torch.randn(2, d, generator=g, dtype=F64)  # Newton must refine
    kw = dict(n_starts=2, starts=starts, options={"n_eigs": n_eigs, "landscape_solves": 0, "edge_pairs": 0})
    dense = find_equilibria(_linear(m), d, eigensolver="dense", **kw)
    arpack = find_equilibria(_linear(m), d, eigensolver="arpack", **kw)  # the same rows, ARPACK spectra
    # ±top (λ = 4.5: the power row of F, and the plain row of -F, which the shifted map replaced) and bottom
    assert dense.n_points == arpack.n_points == 3
    assert arpack.eigenvalues.shape == (3, 2 * n_eigs) and dense.eigenvalues.shape == (3, d - 1)
    # a power row stops at a relative residual <= tol = 1e-10; λ = <u, m u> is then within about tol·||m|| of μ
    lam_tol = 10 * dense.options["tol"] * float(torch.linalg.matrix_norm(m, 2))
    torch.testing.assert_close(dense.lambdas, torch.tensor([4.5, 4.5, -4.0], dtype=F64), rtol=0, atol=lam_tol)
    torch.testing.assert_close((dense.points @ top).abs(), torch.tensor([1.0, 1.0, 0.0220], dtype=F64), rtol=0,
                               atol=1e-4)
    torch.testing.assert_close(arpack.points, dense.points, rtol=0, atol=1e-10)
    torch.testing.assert_close(arpack.lambdas, dense.lambdas, rtol=0, atol=1e-10)
    for k, lam in enumerate((4.5, 4.5, -4.0)):
        want = _expected_tangent(eig, lam)
        torch.testing.assert_close(dense.eigenvalues[k].real, want.real, rtol=0, atol=1e-8)  # analytic spectrum
        _assert_extremes_agree(dense.eigenvalues[k], arpack.eigenvalues[k], n_eigs)
    assert arpack.labels == dense.labels == ["attractor", "attractor", "repeller"]
    assert arpack.index == [0, 0, 2 * n_eigs] and dense.index == [0, 0, d - 1]  # ARPACK: the computed ones only
    torch.testing.assert_close(arpack.spectral_abscissa, dense.spectral_abscissa, rtol=0, atol=1e-6)
    assert arpack.rotational == dense.rotational == [True, True, True]  # a rotation block is among the extremes


def test_arpack_matches_dense_d1024_classify_point(capsys):
    d, n_eigs = 1024, 6
    m, eig, top, _ = _schur_matrix(d, 1)
    t0 = time.perf_counter()
    dense = classify_point(_linear(m), top, eigensolver="dense")
    t_dense = time.perf_counter() - t0
    t0 = time.perf_counter()
    arpack = classify_point(_linear(m), top, eigensolver="arpack", n_eigs=n_eigs)
    t_arpack = time.perf_counter() - t0
    assert dense.eigensolver == "dense" and dense.eigenvalues.shape == (d - 1,)
    assert arpack.eigensolver == "arpack" and arpack.eigenvalues.shape == (2 * n_eigs,)
    assert dense.residual < 1e-12 and abs(dense.lam - 4.5) < 1e-10
    want = _expected_tangent(eig, 4.5)
    torch.testing.assert_close(_extremes(dense.eigenvalues, n_eigs), _extremes(want, n_eigs), rtol=0, atol=1e-8)
    _assert_extremes_agree(dense.eigenvalues, arpack.eigenvalues, n_eigs)
    assert dense.label == arpack.label == "attractor" and dense.rotational and arpack.rotational
    with capsys.disabled():
        print(f"\n[equilibria] d=1024 classify_point: dense {t_dense:.2f} s, arpack {t_arpack:.2f} s")


def test_auto_eigensolver_switches_at_dense_max_dim():
    assert _resolve_eigensolver("auto", DENSE_MAX_DIM, 6) == "dense"
    assert _resolve_eigensolver("auto", DENSE_MAX_DIM + 1, 6) == "arpack"


# ---------------------------------------------------------------------------------------------------------
# conventions, determinism, serialisation, degenerate cases


def test_field_calling_conventions_agree():
    m = M_SYM[:4, :4] + M_SYM[:4, :4].T
    batched = find_equilibria(lambda u: u @ m.T, 4, n_starts=8, seed=2)
    single = find_equilibria(lambda u: m @ u, 4, n_starts=8, seed=2)

    def not_vmappable(u):  # .item() breaks vmap and forward AD: the loop and reverse-mode paths take over
        return m @ u + 0.0 * float(u.sum().item())

    looped = find_equilibria(not_vmappable, 4, n_starts=8, seed=2)
    assert (batched.options["field_mode"], single.options["field_mode"], looped.options["field_mode"]) == (
        "batched", "vmap", "loop")
    # The three conventions reach the points through different summation orders, and LM amplifies the difference
    # below its tolerance, so they are compared by what the finder guarantees, not by bits: the same set of points
    # (as a set: the order can change), each within its convergence radius of the true equilibrium ±v_i of this
    # linear field. A relative residual ||P_u F(u)|| / ||F(u)|| <= tol puts u within tol * max|mu| / gap of the
    # eigenvector (gap: the smallest distance between eigenvalues); the Jacobian's spectrum moves with
    # ||m|| times that distance.
    mu, vecs = torch.linalg.eigh(m)
    gap = float((mu[1:] - mu[:-1]).min())
    radius = 10 * batched.options["tol"] * float(mu.abs().max()) / gap
    truth = torch.cat([vecs.T, -vecs.T])
    for res in (batched, single, looped):
        assert res.n_points == batched.n_points >= 4  # of the 8 points ±v_i, from 8 starts
        dist = torch.cdist(res.points, truth)
        assert float(dist.min(1).values.max()) <= radius, res.options["field_mode"]
        assert len(set(dist.argmin(1).tolist())) == res.n_points, res.options["field_mode"]  # distinct points
    for other in (single, looped):
        idx = torch.cdist(other.points, batched.points).argmin(1)
        assert sorted(idx.tolist()) == list(range(batched.n_points))  # the same set
        torch.testing.assert_close(other.points, batched.points[idx], rtol=0, atol=2 * radius)
        torch.testing.assert_close(other.eigenvalues, batched.eigenvalues[idx], rtol=0,
                                   atol=10 * float(mu.abs().max()) * 2 * radius + 1e-12)


def test_deterministic_given_seed_and_fills_random_starts():
    kw = dict(n_starts=16, starts=V[:, 0][None], seed=7)
    a = find_equilibria(_linear(M_SYM), 6, **kw)
    b = find_equilibria(_linear(M_SYM), 6, **kw)
    assert torch.equal(a.points, b.points) and torch.equal(a.eigenvalues, b.eigenvalues)
    assert a.labels == b.labels and a.hits == b.hits
    assert a.options["n_starts"] == 16 and a.options["given_starts"] == 1
    assert a.start_kind[a.start_index.index(0)] == "given/power+"  # row 0: the given start's power row of F
    assert all(k.startswith("given/") == (i % 16 == 0 and i < 32) for i, k in zip(a.start_index, a.start_kind))
    c = find_equilibria(_linear(M_SYM), 6, n_starts=16, starts=V[:, 0][None], seed=8)
    assert c.hits != a.hits or not torch.equal(c.points, a.points)


@pytest.mark.parametrize("suffix", [".json", ".safetensors"])
def test_save_load_round_trip_is_exact(tmp_path, suffix):
    m, _ = _rotational_matrix()
    res = find_equilibria(lambda u: u @ m.T, 5, n_starts=16)
    assert res.n_points > 0
    back = EquilibriaResult.load(res.save(tmp_path / f"eq{suffix}"))
    for name in ("points", "lambdas", "residuals", "eigenvalues", "spectral_abscissa", "max_im_re",
                 "rotational_fraction"):
        x, y = getattr(res, name), getattr(back, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for name in ("labels", "rotational", "index", "near_zero", "hits", "start_index", "start_kind", "n_starts",
                 "n_converged", "dim", "method", "eigensolver", "seconds", "options"):
        assert getattr(res, name) == getattr(back, name), name
    assert back.provenance.seed == 0


def test_no_equilibrium_gives_an_empty_result(tmp_path):
    # F(u) = J u with J a complex structure on R^4: <u, Ju> = 0, so P_u F = F ≠ 0 everywhere
    j = torch.zeros(4, 4, dtype=F64)
    j[0, 1], j[1, 0], j[2, 3], j[3, 2] = 1.0, -1.0, 1.0, -1.0
    res = find_equilibria(_linear(j), 4, n_starts=4, options={"max_iter": 20})
    assert res.n_points == 0 and res.n_converged == 0
    assert res.points.shape == (0, 4) and res.eigenvalues.shape == (0, 3) and res.lambdas.shape == (0,)
    assert res.counts() == {"attractor": 0, "repeller": 0, "saddle": 0, "degenerate": 0, "rotational": 0}
    assert res.summary()["n_points"] == 0
    assert isinstance(res.plot(), go.Figure) and isinstance(res.plot_counts(), go.Figure)
    back = EquilibriaResult.load(res.save(tmp_path / "empty.safetensors"))
    assert back.points.shape == (0, 4) and back.eigenvalues.shape == (0, 3)


def test_identity_field_is_degenerate_everywhere():
    # every point is an equilibrium of F(u) = u and the tangent Jacobian is 0
    out = classify_point(lambda u: u, torch.tensor([1.0, 2.0, 2.0], dtype=F64))
    assert out.label == "degenerate" and out.near_zero == 2
    assert out.residual <= 4 * torch.finfo(F64).eps  # 0 up to the rounding of normalising u
    assert abs(out.lam - 1.0) < 1e-15


def test_plots_and_summary():
    res = find_equilibria(_linear(M_SYM), 6, n_starts=16)
    fig = res.plot()
    assert isinstance(fig, go.Figure)
    assert {t.name for t in fig.data} == set(res.labels)
    assert sum(len(t.x) for t in fig.data) == res.eigenvalues.numel()
    bars = res.plot_counts()
    assert list(bars.data[0].x) == ["attractor", "repeller", "saddle", "degenerate", "rotational"]
    s = res.summary()
    assert s["n_points"] == res.n_points and s["max_residual"] < 1e-8 and s["lambda_max"] == pytest.approx(3.0)


def test_tangent_basis_is_orthonormal_and_tangent():
    u = torch.tensor([0.0, -3.0, 4.0, 1.0], dtype=F64)
    h = _Householder(u / u.norm())
    q = torch.stack([h.q(e) for e in torch.eye(3, dtype=F64)], dim=1)  # Q e_1, Q e_2, Q e_3 as columns
    assert q.shape == (4, 3)
    torch.testing.assert_close(q.T @ q, torch.eye(3, dtype=F64), rtol=0, atol=1e-14)
    assert float((q.T @ (u / u.norm())).abs().max()) < 1e-14


def test_householder_matches_the_explicit_reflector():
    # apply, q, qt and conjugate are H x, Q s, Qᵀ x and H A H of the explicit d × d reflector H = I - β w wᵀ
    # (Q = columns 2..d of H), for both signs of u[0] and u[0] = 0; unit x, s and ||A||_F = 1, so that 1e-14 is a
    # few ulps of the two summation orders
    gen = torch.Generator().manual_seed(7)
    n, d = 6, 9
    u = torch.randn(n, d, generator=gen, dtype=F64)
    u[0, 0], u[1, 0], u[2, 0] = -abs(float(u[0, 0])), abs(float(u[1, 0])), 0.0
    u = u / u.norm(dim=-1, keepdim=True)
    x, s = torch.randn(n, d, generator=gen, dtype=F64), torch.randn(n, d - 1, generator=gen, dtype=F64)
    x, s = x / x.norm(dim=-1, keepdim=True), s / s.norm(dim=-1, keepdim=True)
    a = torch.randn(n, d, d, generator=gen, dtype=F64)
    a = a / a.flatten(1).norm(dim=-1)[:, None, None]
    for i in range(n):
        h = _Householder(u[i])
        big = torch.eye(d, dtype=F64) - h.beta * torch.outer(h.w, h.w)
        torch.testing.assert_close(big @ big.T, torch.eye(d, dtype=F64), rtol=0, atol=1e-14)
        assert float((big[:, 1:].T @ u[i]).abs().max()) < 1e-14  # Q spans u^⊥
        for got, want in ((h.apply(x[i]), big @ x[i]), (h.q(s[i]), big[:, 1:] @ s[i]),
                          (h.qt(x[i]), big[:, 1:].T @ x[i]), (h.conjugate(a[i]), big @ a[i] @ big),
                          (h.qt(h.q(s[i])), s[i])):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------
# bad input


# Under the suite's runtime type checking (--jaxtyping-packages=tl_steering,beartype.beartype) a value outside a
# Literal or a non-callable field is rejected by the type checker before the body runs; without it, the body
# raises InputError with the message below.
TYPED = (InputError, TypeCheckError, TypeError)


def _assert_message(excinfo: pytest.ExceptionInfo, match: str) -> None:
    if excinfo.type is InputError or issubclass(excinfo.type, InputError):
        assert re.search(match, str(excinfo.value)), str(excinfo.value)


@pytest.mark.parametrize(
    ("kwargs", "match", "typed"),
    [
        (dict(dim=1), "dim must be an int >= 2", False),
        (dict(n_starts=0), "n_starts must be an int >= 1", False),
        (dict(method="newton"), "unexpected keyword", True),
        (dict(options={"method": "lm"}), "unknown finder options", False),
        (dict(options={"landscape_solves": -1}), "landscape_solves must be an int >= 0", False),
        (dict(eigensolver="lapack"), "unknown eigensolver", True),
        (dict(eigensolver="arpack", options={"n_eigs": 4}), "n_eigs <= 3", False),
        (dict(starts=torch.ones(2, 5, dtype=F64)), r"starts must have shape \[m, 6\]", False),
        (dict(starts=torch.zeros(1, 6, dtype=F64)), "finite non-zero", False),
        (dict(options={"tol": 0.0}), "tol must be a float", False),
    ],
)
def test_bad_options_raise_input_error(kwargs, match, typed):
    args = dict(field=_linear(M_SYM), dim=6, n_starts=4) | kwargs
    with pytest.raises(TYPED if typed else InputError) as excinfo:
        find_equilibria(**args)
    _assert_message(excinfo, match)


def test_bad_fields_raise_input_error():
    with pytest.raises(InputError, match="returned shape"):
        find_equilibria(lambda u: torch.cat([u, u], dim=-1), 4, n_starts=2)
    with pytest.raises(InputError, match="NaN/Inf"):
        find_equilibria(lambda u: u * float("nan"), 4, n_starts=2)
    with pytest.raises(InputError, match="torch tensor"):
        find_equilibria(lambda u: u.numpy(), 4, n_starts=2)
    with pytest.raises(TYPED) as excinfo:
        find_equilibria("not a field", 4, n_starts=2)  # type: ignore[arg-type]
    _assert_message(excinfo, "callable")
    with pytest.raises(TYPED) as excinfo:  # a batch where one point is expected
        classify_point(lambda u: u, torch.ones(2, 3, dtype=F64))
    _assert_message(excinfo, "single")
