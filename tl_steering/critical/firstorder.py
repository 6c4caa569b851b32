"""First-order phases and the matrix-free Newton finish (see docs/critical_points.md, "Solver").

* :func:`_riemannian_descent`: Riemannian gradient descent on g(u) = ½||P_u F||²/||F||² (Armijo, batched); the
  optional first phase of ``method="riemannian"``.
* :func:`_fixed_point`: the projected power iteration u <- sign(λ) normalize(F(u)); ``method="fixed_point"``
  (biased toward points stable for that map: never the only finder).
* :func:`_newton`: Riemannian Newton with GMRES on JVPs and step halving, used instead of the dense
  Levenberg-Marquardt solver above the dense dimension limit.
"""

import inspect
import math

import numpy as np
import torch
from torch import Tensor

from .fields import _EPS, _FieldAdapter, _Householder, _normalize, relative_residual, tangent_part
from .spectrum import _tangent_matrix, _tangent_operator


def _objective(fld: _FieldAdapter, u: Tensor) -> Tensor:
    """g(u) = ½ ||P_u F(u)||² / ||F(u)||² per row (inf where F is not finite or vanishes)."""
    f = fld.many(u)
    fn2 = (f * f).sum(-1)
    v = tangent_part(u, f)
    g = 0.5 * (v * v).sum(-1) / fn2.clamp_min(_EPS)
    bad = ~torch.isfinite(g) | (fn2 <= 0)
    return torch.where(bad, torch.full_like(g, math.inf), g)


def _riemannian_descent(fld: _FieldAdapter, u: Tensor, max_iter: int, switch: float) -> Tensor:
    """Riemannian gradient descent on g with per-row Armijo backtracking, batched over rows.

    Rows stop when their residual sqrt(2g) < ``switch``, when no step decreases g (a local minimum of g or the
    float floor), or after ``max_iter`` iterations.
    """
    n = u.shape[0]
    step = torch.ones(n, dtype=u.dtype, device=u.device)
    with torch.no_grad():
        g = _objective(fld, u)
    active = torch.isfinite(g) & (torch.sqrt(2 * g) >= switch)
    c = 1e-4
    for _ in range(max_iter):
        idx = active.nonzero().flatten()
        if idx.numel() == 0:
            break
        ua = u[idx].detach().requires_grad_(True)
        ga = _objective(fld, ua)
        (grad,) = torch.autograd.grad(ga.sum(), ua)
        ua = ua.detach()
        ga = ga.detach()
        rgrad = tangent_part(ua, grad)
        gn2 = (rgrad * rgrad).sum(-1)
        t = torch.clamp(step[idx] * 2.0, max=1e8)
        accepted = torch.zeros(idx.numel(), dtype=torch.bool, device=u.device)
        new_u, new_g = ua.clone(), ga.clone()
        with torch.no_grad():
            for _bt in range(60):
                pend = (~accepted).nonzero().flatten()
                if pend.numel() == 0:
                    break
                trial = _normalize(ua[pend] - t[pend, None] * rgrad[pend])
                gt = _objective(fld, trial)
                ok = torch.isfinite(gt) & (gt <= ga[pend] - c * t[pend] * gn2[pend])
                hit = pend[ok]
                new_u[hit], new_g[hit] = trial[ok], gt[ok]
                accepted[hit] = True
                t[pend[~ok]] *= 0.5
        u = u.clone()
        u[idx] = new_u
        g[idx] = new_g
        step[idx] = t
        done = ~accepted | (torch.sqrt(2 * new_g) < switch) | (gn2 <= 0)
        active[idx[done]] = False
    return u.detach()


def _fixed_point(fld: _FieldAdapter, u: Tensor, max_iter: int, switch: float) -> Tensor:
    """Projected fixed-point iteration u ← sign(λ) normalize(F(u)) (nonlinear power iteration), batched."""
    with torch.no_grad():
        f = fld.many(u)
        active = torch.isfinite(relative_residual(u, f)) & (relative_residual(u, f) >= switch)
        for _ in range(max_iter):
            idx = active.nonzero().flatten()
            if idx.numel() == 0:
                break
            lam = (u[idx] * f[idx]).sum(-1, keepdim=True)
            sign = torch.where(lam < 0, -1.0, 1.0).to(u.dtype)
            u = u.clone()
            u[idx] = _normalize(sign * f[idx])
            f = f.clone()
            f[idx] = fld.many(u[idx])
            res = relative_residual(u[idx], f[idx])
            active[idx[~torch.isfinite(res) | (res < switch)]] = False
    return u


def _gmres(op, b: np.ndarray) -> np.ndarray:
    from scipy.sparse.linalg import gmres

    kw = "rtol" if "rtol" in inspect.signature(gmres).parameters else "tol"
    x, _info = gmres(op, b, atol=0.0, restart=min(op.shape[0], 60), maxiter=20, **{kw: 1e-12})
    return x


def _newton(fld: _FieldAdapter, u: Tensor, steps: int, tol: float, solver: str) -> Tensor:
    """Riemannian Newton on V(u) = P_u F(u): solve (Qᵀ DF Q - λI) s = -Qᵀ F, then u ← normalize(u + Q s), with
    step halving when the residual does not drop. Stops at residual < 1e-3·tol or when no step helps."""
    with torch.no_grad():
        f = fld.one(u)
    res = float(relative_residual(u, f))
    for _ in range(steps):
        if not math.isfinite(res) or res < 1e-3 * tol:
            break
        lam = float(u @ f)
        h = _Householder(u)
        rhs = -h.qt(f)
        if solver == "dense":
            m = _tangent_matrix(fld, u, lam).detach()
            try:
                s = torch.linalg.solve(m, rhs)
            except RuntimeError:
                s = torch.linalg.lstsq(m, rhs[:, None]).solution[:, 0]
        else:
            op = _tangent_operator(fld, u, lam)
            s = torch.as_tensor(_gmres(op, rhs.detach().cpu().numpy()), dtype=u.dtype, device=u.device)
        if not bool(torch.isfinite(s).all()):
            break
        direction = h.q(s)
        improved = False
        alpha = 1.0
        with torch.no_grad():
            for _half in range(8):
                cand = _normalize(u + alpha * direction)
                fc = fld.one(cand)
                rc = float(relative_residual(cand, fc))
                if rc < res:
                    u, f, res, improved = cand, fc, rc, True
                    break
                alpha *= 0.5
        if not improved:
            break
    return u
