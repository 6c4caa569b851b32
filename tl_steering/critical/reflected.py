"""The reflected finder (``method="reflected"``): equilibria reached without a bias toward stability
(docs/critical_points.md, "The reflected finder").

Flow. On the sphere the scale-invariant field W(u) = P_u F(u) / ||F(u)|| has the equilibria of F as its zeros, and
at a zero its tangent Jacobian is M / ||F|| (M = Qᵀ DF Q - λ I), so it has the same Morse index. Following
generalized high-index saddle dynamics (GHiSD: Yin, Zhang & Zhang 2019, SIAM J. Sci. Comput. 41, A3576; Yin, Yu &
Zhang 2020 for non-gradient systems), the flow

    u' = (I - 2 V Vᵀ) W(u),

where the columns of V are an orthonormal basis of the invariant subspace of DW(u) of its k eigenvalues with
positive real part, has every index-k equilibrium as an attractor: in a real Schur basis of DW ordered by sign,
(I - 2 V Vᵀ) DW = [[-T11, -T12], [0, T22]], whose eigenvalues are -eig(T11) (the k unstable ones, reflected) and
eig(T22) (stable). Here k is the local one: at every step it is the number of eigenvalues of DW(u) with positive
real part (the ordered real Schur form ``scipy.linalg.schur(..., sort="rhp")`` of the exact dense DW), so every
hyperbolic equilibrium, of any index, is an attractor of the flow; ``target_index`` fixes k instead (the k
eigenvalues of largest real part), for the downward search of a solution landscape.

Steps. The flow is stiff (eigenvalues of DW span three decades on model fields), so it is integrated by linearly
implicit Euler with the time step grown as the residual falls (pseudo-transient continuation, Kelley & Keyes 1998,
"switched evolution relaxation": dt <- dt · ||W_prev|| / ||W||): with S = I - 2 V Vᵀ,

    (I / dt - S·DW) s = S·W,        u <- (u + Q s) / ||u + Q s||,

which is the reflected flow for small dt and Newton's step s = -DW⁻¹ W for large dt (S cancels), so the end game is
quadratic. Steps are capped at ``max_step`` radians. No merit function has to decrease (unlike Levenberg-Marquardt
from a raw start, docs section 6.1). A row hands over to the Levenberg-Marquardt end game of
:mod:`tl_steering.critical.solver` (no deflation) once its relative residual is below ``switch``.

Cost per step and row: one dense Jacobian of F (vmapped over the rows) and one (d-1)×(d-1) real Schur form.
"""

import math
import time

import numpy as np
import torch
from torch import Tensor

from .fields import _add_distinct, _FieldAdapter, _Householder, _normalize, relative_residual
from .firstorder import _newton
from .solver import lm_solve

#: a step is accepted when the relative residual grows by at most this factor (non-monotone), else it is retried
#: with dt / 4 and half the trust radius, up to RETRIES times
GROWTH = 1.5
RETRIES = 6
#: a row that stops (stalled or at the step limit) below this relative residual is still handed to LM
FINISH_BELOW = 5e-2
#: the ordered Schur form is recomputed every REFRESH steps; in between the subspace is carried along
REFRESH = 1
#: a row has stalled when its relative residual has not halved over this many steps
STALL_STEPS = 40


def _sorted_schur(dw: np.ndarray, target: int | None) -> tuple[np.ndarray, int]:
    """Orthonormal basis of the invariant subspace of ``dw`` for its eigenvalues of positive real part (``target``
    None) or of its ``target`` eigenvalues of largest real part (a complex pair cut by the boundary is kept whole),
    from the ordered real Schur form. Returns (basis [d-1, k], k)."""
    import scipy.linalg as sl

    n = dw.shape[0]
    if target is not None and target <= 0:
        return dw[:, :0], 0
    if target is not None and target >= n:
        return np.eye(n), n
    cut = 0.0
    if target is not None:
        re = np.sort(np.linalg.eigvals(dw).real)[::-1]
        cut = 0.5 * (re[target - 1] + re[target])
    try:
        _, z, k = sl.schur(dw, output="real", sort=lambda x, y: x > cut)
        return z[:, :k], int(k)
    except (np.linalg.LinAlgError, ValueError):
        # an eigenvalue within rounding of the cut moved across it while reordering: the span of the selected
        # eigenvectors (real and imaginary parts), orthonormalised, is the same subspace
        vals, vecs = np.linalg.eig(dw)
        sel = vals.real > cut
        if not sel.any():
            return dw[:, :0], 0
        cols = np.concatenate([vecs[:, sel].real, vecs[:, sel & (np.abs(vals.imag) > 0)].imag], axis=1)
        q, r = np.linalg.qr(cols)
        keep = np.abs(np.diag(r)) > 1e-10 * max(1.0, float(np.abs(np.diag(r)).max()))
        return q[:, keep], int(keep.sum())


class _System:
    """The reflected linear system at one row: (I/dt - S·DW) s = S·W in the tangent basis of ``u``."""

    def __init__(self, u: Tensor, f: Tensor, jac: Tensor, target: int | None,
                 carried: np.ndarray | None = None) -> None:
        fn = float(f.norm())
        self.u, self.h = u, _Householder(u)
        lam = float(u @ f)
        g = (self.h.qt(f) / fn).cpu().numpy()
        d1 = u.shape[0] - 1
        m = (self.h.conjugate(jac)[1:, 1:] - lam * torch.eye(d1, dtype=jac.dtype, device=jac.device)) / fn
        grad_norm = (self.h.qt(jac.T @ f) / fn**2).cpu().numpy()  # tangent gradient of ||F||, over ||F||
        dw = m.cpu().numpy() - np.outer(g, grad_norm)  # exact tangent Jacobian of W = P F / ||F||
        self.dw = dw
        if carried is None:
            v, self.k = _sorted_schur(dw, target)
        else:  # the previous step's subspace (ambient columns), carried to this tangent space and re-orthonormalised
            amb = torch.as_tensor(carried, dtype=u.dtype, device=u.device)
            amb = amb - u[:, None] * (u @ amb)[None]
            v = np.linalg.qr((amb - self.h.beta * self.h.w[:, None] * (self.h.w @ amb)[None])[1:].cpu().numpy())[0]
            self.k = v.shape[1]
        w = self.h.w.cpu().numpy()
        x = np.concatenate([np.zeros((1, v.shape[1])), v])
        self.ambient = x - self.h.beta * np.outer(w, w @ x)  # Q v: the subspace as ambient columns
        self.sg = g - 2.0 * v @ (v.T @ g)
        self.sdw = dw - 2.0 * v @ (v.T @ dw)

    def step(self, dt: float, radius: float) -> Tensor:
        a = np.eye(self.sdw.shape[0]) / dt - self.sdw
        try:
            s = np.linalg.solve(a, self.sg)
        except np.linalg.LinAlgError:
            s = np.linalg.lstsq(a, self.sg, rcond=None)[0]
        ns = float(np.linalg.norm(s))
        if not math.isfinite(ns):
            return self.u
        if ns > radius:
            s = s * (radius / ns)
        return _normalize(self.u + self.h.q(torch.as_tensor(s, dtype=self.u.dtype, device=self.u.device)))


def reflected_solve(fld: _FieldAdapter, u0: Tensor, tol: float, max_iter: int, dt0: float = 0.5,
                    max_step: float = 0.3, switch: float = 1e-4, target_index: list[int | None] | None = None,
                    finish_iter: int = 30, patience: int = 8) -> tuple[Tensor, Tensor, Tensor, Tensor, dict]:
    """Rows of ``u0`` (unit) driven by the reflected flow to equilibria of any index, then finished by LM.

    Returns ``(u, rel, steps, status, info)``: final rows, relative residuals, reflected steps per row, status per
    row (0 converged to ``tol``, 1 stalled, 3 step limit) and ``info`` (``"local_index"``: the last k per row,
    ``"jacobians"``: dense Jacobians evaluated in the reflected phase).
    """
    n = u0.shape[0]
    u = u0.clone()
    with torch.no_grad():
        f = fld.many(u)
    rel = relative_residual(u, f)
    dt = torch.full((n,), float(dt0), dtype=torch.float64)
    radius = torch.full((n,), float(max_step), dtype=torch.float64)
    steps = torch.zeros(n, dtype=torch.long)
    status = torch.full((n,), -1, dtype=torch.long)
    k_last = [-1] * n
    carried: list[np.ndarray | None] = [None] * n
    targets = list(target_index) if target_index is not None else [None] * n
    history: list[Tensor] = [rel.detach().cpu().clone()]
    n_jac = 0
    status[(rel <= switch).cpu()] = 0
    for _ in range(int(max_iter)):
        idx = (status < 0).nonzero().flatten()
        if idx.numel() == 0:
            break
        ua = u[idx.to(u.device)]
        with torch.no_grad():
            fa = fld.many(ua)
        jacs = fld.jacobians(ua.detach())
        n_jac += len(jacs)
        for j, row in enumerate(idx.tolist()):
            jac = jacs[j] if jacs[j] is not None else fld.jacobian(ua[j])
            fresh = int(steps[row]) % REFRESH == 0 or carried[row] is None
            system = _System(ua[j], fa[j], jac.detach(), targets[row], None if fresh else carried[row])
            carried[row] = system.ambient
            k_last[row] = system.k
            old = float(rel[row])
            for _try in range(RETRIES):  # the Jacobian and Schur form serve every retry: one F per try
                cand = system.step(float(dt[row]), float(radius[row]))
                with torch.no_grad():
                    rc = float(relative_residual(cand, fld.one(cand)))
                if math.isfinite(rc) and rc <= GROWTH * old:
                    break
                dt[row] = max(float(dt[row]) / 4.0, 1e-6 * dt0)
                radius[row] = float(radius[row]) / 2.0
            else:
                carried[row] = None  # no acceptable step: stay, with a fresh Schur form next time
                continue
            u[row], rel[row] = cand, rc
            grow = old / max(rc, 1e-300)
            dt[row] = min(max(float(dt[row]) * grow, dt0), 1e12)  # SER, never below dt0: a climb stays a flow
            if rc < old:
                radius[row] = min(max_step, 2.0 * float(radius[row]))
        nr = rel[idx.to(rel.device)].detach().cpu()
        steps[idx] += 1
        status[idx[(nr <= switch)]] = 0
        history.append(rel.detach().cpu().clone())
        if len(history) > STALL_STEPS:
            best_then = history[-1 - STALL_STEPS]
            stalled = (status < 0) & ~(rel.detach().cpu() < 0.5 * best_then)
            status[stalled] = 1
    status[status < 0] = 3
    near = ((status == 0) | (rel.detach().cpu() < FINISH_BELOW)) & (rel.detach().cpu() > tol * 1e-3)
    rows = near.nonzero().flatten()
    if rows.numel():  # end game: Newton with step halving (no reflection: local convergence needs none), then LM
        for i in rows.tolist():
            u[i] = _newton(fld, u[i].detach(), int(finish_iter), tol, "dense")
        with torch.no_grad():
            rel[rows.to(rel.device)] = relative_residual(u[rows.to(u.device)], fld.many(u[rows.to(u.device)]))
        rows = rows[(rel[rows.to(rel.device)].detach().cpu() > tol)]
    if rows.numel():
        ub, rb, _, sb = lm_solve(fld, u[rows.to(u.device)].detach(), u[:0], tol, int(finish_iter),
                                 patience=int(patience))
        u[rows.to(u.device)], rel[rows.to(rel.device)] = ub.detach(), rb
    status[(status == 0) & (rel.detach().cpu() > tol)] = 1
    status[rel.detach().cpu() <= tol] = 0
    info = {"local_index": k_last, "jacobians": n_jac}
    return u.detach(), rel.detach(), steps, status, info





def reflected_rows(fld: _FieldAdapter, u0: Tensor, kinds: list[str], tol: float, max_iter: int,
                   repair: bool = True, **kwargs) -> tuple[Tensor, Tensor, Tensor, Tensor, list[str], dict]:
    """method="reflected": the adaptive reflected flow from every start; each row that stalls (on a surface where
    an eigenvalue of DW changes sign, the flow's reflection switches and the row slides along it) is continued
    twice with the index fixed one below and one above its last local index (``repair``): the sliding surface
    lies between the basins of equilibria of those indices. Rows: one per start, then two per stalled start."""
    u, rel, steps, status, info = reflected_solve(fld, u0, tol, max_iter, **kwargs)
    row_kinds = [f"{k}/reflected" for k in kinds]
    out = {"reflected_rows": u0.shape[0], "reflected_converged": int((status == 0).sum()),
           "local_index": list(info["local_index"]), "jacobians": int(info["jacobians"]),
           "reflected_steps": steps.tolist()}
    stalled = [i for i in (status != 0).nonzero().flatten().tolist() if info["local_index"][i] >= 0]
    if repair and stalled:
        dim1 = u0.shape[1] - 1
        rows, targets, names = [], [], []
        for i in stalled:
            for shift in (-1, 1):
                k = info["local_index"][i] + shift
                if 0 <= k <= dim1:
                    rows.append(i)
                    targets.append(k)
                    names.append(f"{kinds[i]}/repair{'+' if shift > 0 else '-'}")
        if rows:
            ur, rr, sr, str_, ir = reflected_solve(fld, u[rows], tol, max_iter, target_index=targets, **kwargs)
            u, rel = torch.cat([u, ur]), torch.cat([rel, rr])
            steps, status = torch.cat([steps, sr]), torch.cat([status, str_])
            row_kinds += names
            out.update(repair_rows=len(rows), repair_converged=int((str_ == 0).sum()),
                       jacobians=out["jacobians"] + int(ir["jacobians"]),
                       local_index=out["local_index"] + list(ir["local_index"]))
    return u, rel, steps, status, row_kinds, out



def _neighbour_starts(fld: _FieldAdapter, x: Tensor, eps: float, depth: int) -> list[tuple[Tensor, int, str]]:
    """Starts of the solution-landscape searches next to the equilibrium ``x`` (index k): for j = 1..``depth``,
    x ± eps·v_j along the eigenvector of the j-th least unstable eigenvalue (target k - j: downward search) and of
    the j-th least stable one (target k + j: upward search); a complex pair counts as two eigenvalues."""
    with torch.no_grad():
        f = fld.one(x)
    jac = fld.jacobians(x[None])[0]
    jac = fld.jacobian(x) if jac is None else jac
    h = _Householder(x)
    d1 = x.shape[0] - 1
    m = (h.conjugate(jac.detach())[1:, 1:] - float(x @ f) * torch.eye(d1, dtype=jac.dtype, device=jac.device))
    vals, vecs = np.linalg.eig(m.cpu().numpy())
    k = int((vals.real > 0).sum())
    up = np.nonzero(vals.real > 0)[0]
    down = np.nonzero(vals.real <= 0)[0]
    order = {"down": up[np.argsort(vals.real[up], kind="stable")],
             "up": down[np.argsort(-vals.real[down], kind="stable")]}
    out = []
    for side, pool in order.items():
        for j in range(1, min(depth, pool.size) + 1):
            target = k - j if side == "down" else k + j
            vec = vecs[:, pool[j - 1]]
            v = h.q(torch.as_tensor((vec.real if j % 2 or not abs(vals[pool[j - 1]].imag) else vec.imag).copy(),
                                    dtype=x.dtype, device=x.device))
            v = v / v.norm().clamp_min(1e-300)
            for sgn in (1.0, -1.0):
                out.append((_normalize(x + sgn * eps * v), target, f"landscape{side}"))
    return out


def landscape_rows(fld: _FieldAdapter, points: Tensor, tol: float, max_iter: int, eps: float = 0.05,
                   depth: int = 3, **kwargs) -> tuple[Tensor, Tensor, Tensor, Tensor, list[str], dict]:
    """Solution-landscape searches (Yin et al. 2020, Phys. Rev. Lett. 124, 090601) from each row of ``points``
    (distinct equilibria): index-fixed reflected searches started next to the point along its least unstable /
    least stable eigendirections, 1..``depth`` indices down and up. 4·depth rows per point."""
    starts = [s for x in points for s in _neighbour_starts(fld, x, eps, depth)]
    if not starts:
        empty = points[:0]
        return empty, empty[:, 0], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), [], {}
    u0 = torch.stack([s for s, _, _ in starts])
    u, rel, steps, status, info = reflected_solve(fld, u0, tol, max_iter, target_index=[t for _, t, _ in starts],
                                                  **kwargs)
    return u, rel, steps, status, [n for _, _, n in starts], {"landscape_rows": len(starts),
                                                              "landscape_converged": int((status == 0).sum()),
                                                              "landscape_jacobians": int(info["jacobians"])}



def reflected_finder(fld: _FieldAdapter, u0: Tensor, kinds: list[str], tol: float, max_iter: int,
                     landscape: bool, dedup_angle: float) -> tuple[Tensor, Tensor, Tensor, Tensor, list[str], dict]:
    """``find_equilibria(method="reflected")``: :func:`reflected_rows` from the starts, then (``landscape``)
    :func:`landscape_rows` from each distinct point they found. Rows in that order."""

    clock = time.perf_counter()
    u, rel, steps, status, row_kinds, info = reflected_rows(fld, u0, kinds, tol, max_iter)
    seconds = {"reflected": time.perf_counter() - clock}
    if landscape:
        clock = time.perf_counter()
        pts = _add_distinct(u[:0], u[status.to(u.device) == 0], dedup_angle)
        ul, rl, sl, stl, kl, il = landscape_rows(fld, pts, tol, max_iter)
        u, rel, steps, status = torch.cat([u, ul]), torch.cat([rel, rl]), torch.cat([steps, sl]), torch.cat([status, stl])
        row_kinds += kl
        info.update(il)
        seconds["landscape"] = time.perf_counter() - clock
    info["phase_seconds"] = seconds
    return u, rel, steps, status, row_kinds, info
__all__ = ["STALL_STEPS", "landscape_rows", "reflected_finder", "reflected_rows", "reflected_solve"]
