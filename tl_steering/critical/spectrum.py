"""Tangent spectra and labels of points on the sphere (see docs/critical_points.md, "Classification").

At an equilibrium u* (F(u*) = λ u*) the projected flow du/dt = P_u F(u) is linearised by the tangent Jacobian
J_T = P DF(u*) P - λ P, written in an orthonormal tangent basis Q as M = Qᵀ DF(u*) Q - λ I_{d-1}. Its spectrum gives
the label (attractor / repeller / saddle / degenerate), the Morse index (number of eigenvalues with Re > tol) and the
rotational modes (|Im| > ROT_RATIO·|Re|)."""

import dataclasses
import math
import warnings
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from ..errors import InputError
from .options import LABEL_TOL, ROT_RATIO
from .fields import _FieldAdapter, _Householder, key, relative_residual

#: In ``eigensolver="auto"`` the dense Jacobian is used up to this dimension, ARPACK above it.
DENSE_MAX_DIM = 1024
LABELS = ("attractor", "repeller", "saddle", "degenerate")


@dataclasses.dataclass
class _Spectrum:
    eigenvalues: Tensor  # complex128 [k], sorted by real part, descending
    label: str
    rotational: bool
    index: int
    spectral_abscissa: float
    near_zero: int
    max_im_re: float
    rotational_fraction: float


def _label_spectrum(eigs: Tensor) -> _Spectrum:
    """The labels, Morse index and rotational modes of docs/critical_points.md section 3 (tol = LABEL_TOL·max|eig|)."""
    eigs = eigs.to(torch.complex128)
    order = torch.argsort(eigs.real, descending=True, stable=True)
    eigs = eigs[order]
    finite = torch.isfinite(eigs.real) & torch.isfinite(eigs.imag)
    e = eigs[finite]
    if e.numel() == 0:
        return _Spectrum(eigs, "degenerate", False, 0, math.nan, 0, math.nan, math.nan)
    re, im = e.real, e.imag
    tol = LABEL_TOL * float(e.abs().max())
    max_re, min_re = float(re.max()), float(re.min())
    if max_re < -tol:
        label = "attractor"
    elif min_re > tol:
        label = "repeller"
    elif max_re > tol and min_re < -tol:
        label = "saddle"
    else:
        label = "degenerate"
    rot = im.abs() > torch.clamp(ROT_RATIO * re.abs(), min=tol)
    ratio = torch.where(im.abs() > tol, im.abs() / re.abs(), torch.zeros_like(re))
    return _Spectrum(
        eigenvalues=eigs, label=label, rotational=bool(rot.any()), index=int((re > tol).sum()),
        spectral_abscissa=max_re, near_zero=int((re.abs() <= tol).sum()),
        max_im_re=float(ratio.max()), rotational_fraction=float(rot.double().mean()))


def point_eig(fld: _FieldAdapter, u: Tensor, lam: float) -> Tensor:
    """Eigenvalues (complex128) of the tangent matrix M = Qᵀ DF(u) Q - λ I at a point u, Q the Householder basis of
    u: computed once per point and kept in the adapter's point cache with DF(u) (the classification and the landscape
    phase read the same eigenvalues)."""
    entry = fld.point_cache.setdefault(key(u), {})
    if "vals" not in entry:
        jac = fld.point_jacobians(u[None])[0]
        entry["vals"] = torch.linalg.eigvals(tangent_matrix(u, jac, lam).detach().cpu().to(torch.float64))
    return entry["vals"]


def real_eigvecs(fld: _FieldAdapter, u: Tensor, lam: float, mus: list[float]) -> Tensor:
    """Unit eigenvectors (columns, float64) of the tangent matrix M at u for its real eigenvalues ``mus`` (from
    :func:`point_eig`), by inverse iteration: two solves with the LU of M - (μ + δ) I, δ = 1e-10 max|M|, each
    (docs/critical_points.md section 9). Where two of ``mus`` lie within 1e-8 max|M| of each other or a vector's
    residual |M v - μ v| exceeds 1e-8 max|M|, the eigenvectors of all of M (LAPACK) instead."""
    m = tangent_matrix(u, fld.point_jacobians(u[None])[0], lam).detach().cpu().to(torch.float64)
    scale = float(m.abs().max()) or 1.0
    gaps = [abs(a - b) for i, a in enumerate(mus) for b in mus[i + 1:]]
    out = []
    if min(gaps, default=math.inf) > 1e-8 * scale:
        eye = torch.eye(m.shape[0], dtype=m.dtype)
        for mu in mus:
            lu, piv, _ = torch.linalg.lu_factor_ex(m - (mu + 1e-10 * scale) * eye)
            v = torch.ones(m.shape[0], 1, dtype=m.dtype)
            for _ in range(2):
                v = torch.linalg.lu_solve(lu, piv, v)
                v = v / v.norm()
            out.append(v[:, 0])
    vecs = torch.stack(out, dim=1) if out else m[:, :0]
    if len(out) < len(mus) or not bool(((m @ vecs - vecs * torch.tensor(mus, dtype=m.dtype)).norm(dim=0)
                                        <= 1e-8 * scale).all()):
        vals, full = torch.linalg.eig(m)
        vecs = torch.stack([full[:, int((vals - mu).abs().argmin())].real for mu in mus], dim=1) if mus else vecs
    return vecs / vecs.norm(dim=0).clamp_min(1e-300)


def tangent_matrix(u: Tensor, jac: Tensor, lam: float) -> Tensor:
    """M = Qᵀ DF(u) Q - λ I (dense, (d-1) × (d-1)) for DF(u) = ``jac``."""
    m = _Householder(u).conjugate(jac)[1:, 1:]
    return m - lam * torch.eye(m.shape[0], dtype=m.dtype, device=m.device)


def _tangent_operator(fld: _FieldAdapter, u: Tensor, lam: float):
    """scipy LinearOperator for M = Qᵀ DF(u) Q - λ I built from JVPs (never forms DF)."""
    from scipy.sparse.linalg import LinearOperator

    h = _Householder(u)
    jvp = fld.linearize(u)
    n = u.shape[0] - 1

    def matvec(x: np.ndarray) -> np.ndarray:
        s = torch.as_tensor(np.asarray(x, dtype=np.float64).reshape(-1), dtype=fld.dtype, device=u.device)
        out = h.qt(jvp(h.q(s))) - lam * s
        return out.detach().cpu().numpy().astype(np.float64)

    return LinearOperator((n, n), matvec=matvec, dtype=np.float64)


def _arpack_extremes(op, n_eigs: int) -> Tensor:
    """The n_eigs eigenvalues of largest and of smallest real part (ARPACK), 2·n_eigs in all."""
    from scipy.sparse.linalg import ArpackNoConvergence, eigs

    n = op.shape[0]
    v0 = np.random.default_rng(0).standard_normal(n)  # ARPACK's own start vector is random: fix it
    out = []
    for which in ("LR", "SR"):
        ncv = min(n, max(2 * n_eigs + 1, 40))
        vals = None
        for attempt in range(2):
            try:
                vals = eigs(op, k=n_eigs, which=which, v0=v0, ncv=ncv, maxiter=max(1000, 20 * n),
                            return_eigenvectors=False)
                break
            except ArpackNoConvergence as exc:
                vals = exc.eigenvalues
                ncv = min(n, 2 * ncv)
                if attempt == 1:
                    warnings.warn(f"ARPACK ({which}) converged {len(vals)} of {n_eigs} eigenvalues; the rest are "
                                  "reported as NaN. Use eigensolver='dense' or a larger n_eigs margin.",
                                  stacklevel=3)
        vals = np.asarray(vals, dtype=np.complex128)
        vals = vals[np.argsort(-vals.real if which == "LR" else vals.real, kind="stable")][:n_eigs]
        if len(vals) < n_eigs:
            vals = np.concatenate([vals, np.full(n_eigs - len(vals), np.nan + 1j * np.nan)])
        out.append(vals)
    return torch.as_tensor(np.concatenate(out), dtype=torch.complex128)


def _resolve_eigensolver(eigensolver: str, dim: int, n_eigs: int) -> Literal["dense", "arpack"]:
    if eigensolver not in ("auto", "dense", "arpack"):
        raise InputError(f"unknown eigensolver {eigensolver!r}; use 'auto', 'dense' or 'arpack'")
    solver = ("dense" if dim <= DENSE_MAX_DIM else "arpack") if eigensolver == "auto" else eigensolver
    if solver == "arpack":
        if not isinstance(n_eigs, int) or n_eigs < 1:
            raise InputError(f"n_eigs must be a positive int, got {n_eigs!r}")
        if n_eigs > dim - 3:
            raise InputError(f"ARPACK needs n_eigs < (d-1) - 1, i.e. n_eigs <= {dim - 3} for d = {dim}; got "
                             f"n_eigs = {n_eigs}. Use eigensolver='dense' at this size or lower n_eigs.")
    return solver  # type: ignore[return-value]


def _classify(fld: _FieldAdapter, u: Tensor, solver: str, n_eigs: int) -> tuple[_Spectrum, float, float]:
    with torch.no_grad():
        f = fld.one(u)
    lam = float(u @ f)
    res = float(relative_residual(u, f))
    if solver == "dense":
        eigs = point_eig(fld, u, lam)
    else:
        eigs = _arpack_extremes(_tangent_operator(fld, u, lam), n_eigs)
    return _label_spectrum(eigs), lam, res
