"""Levenberg-Marquardt on the sphere, the end game of the finder's power and edge rows and of ``polish_points``:
merit, step, damping rule, stopping rules and why not scipy in docs/critical_points.md section 2."""

import math

import torch
from torch import Tensor

from ..geometry import EPS_NORM, _normalize, _tangential_part
from .fields import _EPS, _FieldAdapter, relative_residual
from .options import PATIENCE

#: Converged starts are polished to ``POLISH * tol`` where steps still decrease the residual.
POLISH = 1e-3
#: Below this relative residual a pure Gauss-Newton step is tried first.
GAUSS_NEWTON_BELOW = 1e-4
#: initial Levenberg-Marquardt damping μ (relative to the largest diagonal entry of JᵀJ)
MU0 = 1e-3


class _Merit:
    """Residual r(u) = P_u F / ||F|| for a batch, and its Jacobian per row."""

    def __init__(self, fld: _FieldAdapter) -> None:
        self.fld = fld

    def rows(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """(r [n, d], relative residual [n]) without autograd; r is inf where the residual is."""
        with torch.no_grad():
            f = self.fld.many(u)
            rel = relative_residual(u, f)
            r = _tangential_part(f, u) / f.norm(dim=-1, keepdim=True).clamp_min(_EPS)
        return torch.where(torch.isfinite(rel)[:, None], r, torch.full_like(r, math.inf)), rel

    def jacobian(self, u: Tensor) -> Tensor:
        """Dr(u) per row, [n, d, d], from DF (:meth:`_FieldAdapter.jacobians`) at unit rows:
        ((I - u uᵀ) DF - u Fᵀ - <u, F> I) / ||F|| - r (F̂ᵀ DF) / ||F||."""
        jac = self.fld.jacobians(u)
        with torch.no_grad():
            f = self.fld.many(u)
        fn = f.norm(dim=-1, keepdim=True).clamp_min(_EPS)
        uf = (u * f).sum(-1, keepdim=True)
        r = (f - uf * u) / fn
        fj = (f / fn)[:, None, :] @ jac / fn[..., None]
        dg = jac.baddbmm_(u[:, :, None], u[:, None, :] @ jac + f[:, None, :], alpha=-1)  # in place: DF is ours
        dg.diagonal(dim1=1, dim2=2).sub_(uf)
        return dg.div_(fn[..., None]).baddbmm_(r[:, :, None], fj, alpha=-1)


def _damped_solve(h: Tensor, g: Tensor, u: Tensor, scale: Tensor, mu: Tensor) -> Tensor:
    """δ = -(H + s u uᵀ + μ s I)^-1 g per row (Cholesky; least squares where it fails)."""
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    m = h + scale[:, None, None] * (u[:, :, None] * u[:, None, :] + mu[:, None, None] * eye)
    chol, info = torch.linalg.cholesky_ex(m)
    delta = -torch.cholesky_solve(g[..., None], chol)[..., 0]
    bad = (info != 0) | ~torch.isfinite(delta).all(-1)
    if bool(bad.any()):
        idx = bad.nonzero().flatten()
        delta[idx] = -torch.linalg.lstsq(m[idx], g[idx][..., None]).solution[..., 0]
    return delta


def lm_solve(fld: _FieldAdapter, u0: Tensor, tol: float, max_iter: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Batched Levenberg-Marquardt from the rows of ``u0`` (unit).

    Rows are iterated until the relative residual is below ``POLISH * tol`` or no step decreases it; a row
    counts as converged when its final relative residual is <= ``tol``. Returns ``(u, rel, iterations, status)``: final points, relative residuals, iterations per row, and
    status per row (0 converged, 1 merit stalled, 2 no damped step decreased it, 3 iteration limit)."""
    merit = _Merit(fld)
    target = tol * POLISH  # iterate past tol while it still pays: one more quadratic step costs one Jacobian
    n = u0.shape[0]
    u = u0.clone()
    r, rel = merit.rows(u)
    c = r.norm(dim=-1)
    mu = torch.full((n,), MU0, dtype=u.dtype, device=u.device)
    nu = torch.full((n,), 2.0, dtype=u.dtype, device=u.device)
    status = torch.full((n,), -1, dtype=torch.long, device=u.device)
    iters = torch.zeros(n, dtype=torch.long, device=u.device)
    status[rel <= target] = 0
    status[(status < 0) & ~torch.isfinite(c)] = 2
    history: list[Tensor] = [c.clone()]
    for _ in range(max_iter):
        idx = (status < 0).nonzero().flatten()
        if idx.numel() == 0:
            break
        ua, ra, ca = u[idx], r[idx], c[idx]
        jac = merit.jacobian(ua).detach()
        a = jac.baddbmm_(jac @ ua[:, :, None], ua[:, None, :], alpha=-1)  # J P_u, in place
        g = (a.transpose(1, 2) @ ra[:, :, None])[..., 0]
        h = a.transpose(1, 2) @ a
        scale = h.diagonal(dim1=1, dim2=2).amax(-1).clamp_min(1e-300)
        pending = torch.arange(idx.numel(), device=u.device)
        gauss_newton = rel[idx] < GAUSS_NEWTON_BELOW
        accepted = torch.zeros(idx.numel(), dtype=torch.bool, device=u.device)
        for trial in range(16):
            if pending.numel() == 0:
                break
            rows = idx[pending]
            mu_try = mu[rows].clone()
            if trial == 0:
                mu_try = torch.where(gauss_newton[pending], torch.zeros_like(mu_try), mu_try)
            delta = _damped_solve(h[pending], g[pending], ua[pending], scale[pending], mu_try)
            cand = _normalize(ua[pending] + delta, EPS_NORM)
            rc, relc = merit.rows(cand)
            cc = rc.norm(dim=-1)
            ok = torch.isfinite(cc) & (cc < ca[pending])
            pred = ca[pending] ** 2 - ((ra[pending] + (a[pending] @ delta[..., None])[..., 0]) ** 2).sum(-1)
            ratio = (ca[pending] ** 2 - cc ** 2) / pred.clamp_min(1e-300)
            hit = rows[ok]
            u[hit], r[hit], c[hit], rel[hit] = cand[ok], rc[ok], cc[ok], relc[ok]
            if not (trial == 0 and bool(gauss_newton[pending].all())):
                factor = torch.clamp(1 - (2 * ratio[ok] - 1) ** 3, min=1.0 / 3.0)
                mu[hit] = torch.clamp(mu[hit] * factor, min=1e-15)
            nu[hit] = 2.0
            accepted[pending[ok]] = True
            miss = rows[~ok]
            if not (trial == 0 and bool(gauss_newton[pending].all())):
                mu[miss] = mu[miss] * nu[miss]
                nu[miss] = nu[miss] * 2.0
            pending = pending[~ok]
        iters[idx] += 1
        status[idx[~accepted]] = 2
        history.append(c.clone())
        conv = (status < 0) & (rel <= target)
        status[conv] = 0
        if len(history) > PATIENCE:
            stalled = (status < 0) & (c > 0.5 * history[-1 - PATIENCE]) & (rel > target)
            status[stalled] = 1
    status[status < 0] = 3
    status[(status != 0) & (rel <= tol)] = 0
    return u, rel, iters, status


__all__ = ["GAUSS_NEWTON_BELOW", "lm_solve"]
