"""The solution-landscape phase of the default finder (docs/critical_points.md section 9): from every equilibrium
found, deflated Newton on the sphere started along the real eigenvectors of its tangent Jacobian nearest zero
reaches its neighbours of any index (Yin et al. 2020, with Newton for index-k saddle dynamics); starts that a known
point explains are deferred, not dropped ("New ground first")."""

import math
from collections import deque

import numpy as np
import torch
from torch import Tensor

from .._util.threads import single_threaded
from ..geometry import EPS_NORM, _normalize, _tangential_part
from .options import DEDUP_ANGLE, LANDSCAPE_DIRS, PATIENCE, FinderOptions
from .fields import _EPS, _add_distinct, _FieldAdapter, _Householder, _match_point, relative_residual
from .spectrum import point_eig, real_eigvecs

#: Newton steps are capped at this many radians
MAX_STEP = 0.5
#: below this relative residual, full Newton steps (no backtracking)
FULL_STEP_BELOW = 1e-4
#: offset δ of a landscape start u* ± δ w (radians)
DELTA = 0.1
#: p and σ of the deflation m(u) = prod_i (||u - u_i||^-p + σ) (Farrell, Birkisson & Funke 2015)
DEFLATION_POWER = 2.0
DEFLATION_SHIFT = 1.0
#: a start is explained (deferred) when a known point's geodesic direction from its origin has this cosine with it
EXPLAINED_COS = 0.99


def _deflation(u: Tensor, known: Tensor) -> tuple[Tensor, Tensor]:
    """(log m(u), ∇ log m(u)) per row of ``u`` ([..., d] -> [...], [..., d]) for the deflation
    m(u) = prod_i (||u - u_i||^-p + σ) of the ``known`` points (p = ``DEFLATION_POWER``, σ = ``DEFLATION_SHIFT``);
    (0, 0) while none is known."""
    if known.shape[0] == 0:
        return u.new_zeros(u.shape[:-1]), torch.zeros_like(u)
    diff = u[..., None, :] - known
    r2 = (diff ** 2).sum(-1).clamp_min(1e-300)
    rp = r2 ** (-DEFLATION_POWER / 2)
    coef = -DEFLATION_POWER * rp / r2 / (rp + DEFLATION_SHIFT)
    return torch.log(rp + DEFLATION_SHIFT).sum(-1), (coef[..., None] * diff).sum(-2)


def _newton_steps(fld: _FieldAdapter, u: Tensor, f: Tensor, rel: Tensor, known: Tensor) -> tuple[Tensor, Tensor]:
    """The deflated Newton step of each row (ambient tangent vectors, capped at ``MAX_STEP``) from DF at the row and
    F(u) = ``f``; and which rows got a finite step. The Newton system of W = P_u F / ||F|| in the tangent space is
    solved bordered by u (no basis): (I - F̂F̂ᵀ) DF t / ||F|| - <u, F̂> t + μ u = -P_u F̂, uᵀ t = 0; in float32
    (DF and the solve) for the rows whose relative residual ``rel`` is >= ``FULL_STEP_BELOW``, where the step is
    backtracked anyway, in the field's dtype for the others (docs/critical_points.md section 9)."""
    n, d = u.shape
    fn = f.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    fh = f / fn
    rhs = torch.cat([-_tangential_part(fh, u), u.new_zeros(n, 1)], dim=-1)
    low, sol = (rel >= FULL_STEP_BELOW).cpu(), torch.zeros_like(rhs)
    for rows in (r for r in (low, ~low) if bool(r.any())):
        jacs = fld.jacobians(u[rows], dtype=torch.float32 if rows is low else u.dtype)
        fr, ur, br, fnr = (x[rows].to(jacs.dtype) for x in (fh, u, rhs, fn))
        k = jacs.new_zeros(ur.shape[0], d + 1, d + 1)
        torch.baddbmm(jacs, fr[:, :, None], fr[:, None, :] @ jacs, alpha=-1, out=k[:, :d, :d])
        k[:, :d, :d].div_(fnr[..., None]).diagonal(dim1=1, dim2=2).sub_((ur * fr).sum(-1, keepdim=True))
        k[:, :d, d], k[:, d, :d] = ur, ur
        with single_threaded():  # torch's batched CPU LU inside its own threads hangs MKL's dgetrf (docs section 2)
            part, info = torch.linalg.solve_ex(k, br)
        for i in (info != 0).nonzero().flatten().tolist():
            part[i] = torch.linalg.lstsq(k[i], br[i][:, None]).solution[:, 0]
        sol[rows] = part.to(sol)
    t, ok = sol[:, :d], torch.isfinite(sol[:, :d]).all(-1)
    if known.shape[0]:
        denom = 1.0 - (_deflation(u, known)[1] * t).sum(-1, keepdim=True)
        t = torch.where(denom.abs() > 1e-12, t / denom, t)
    t = t * (MAX_STEP / t.norm(dim=-1, keepdim=True)).clamp(max=1.0)
    return torch.where(ok[:, None], t, torch.zeros_like(t)), ok.cpu()


def _line_search(fld: _FieldAdapter, u: Tensor, f: Tensor, steps: Tensor, rel: Tensor, merit: Tensor,
                 known: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backtracking on the deflated merit, all rows at once (``f`` = F(u)): a row takes its full step below
    ``FULL_STEP_BELOW`` (when F is finite there), else the first of 12 halvings that lowers the merit. Returns
    (u, F(u), rel, merit, accepted) after the search (unchanged rows where no step was accepted)."""
    u, f, rel, merit, n = u.clone(), f.clone(), rel.clone(), merit.clone(), u.shape[0]
    accepted, full, todo = torch.zeros(n, dtype=torch.bool), (rel < FULL_STEP_BELOW).cpu(), torch.arange(n)
    for _ in range(12):
        cand = _normalize(u[todo] + steps[todo], EPS_NORM)
        fc = fld.many_no_grad(cand)
        rc = relative_residual(cand, fc)
        mc = torch.log(rc.clamp_min(1e-300)) + _deflation(cand, known)[0]
        ok = (torch.isfinite(rc) & (full[todo].to(rc.device) | (mc < merit[todo]))).cpu()
        hit = todo[ok]
        u[hit], f[hit], rel[hit], merit[hit] = cand[ok], fc[ok], rc[ok], mc[ok]
        accepted[hit] = True
        todo = todo[~ok & ~full[todo]]
        if todo.numel() == 0:
            break
        steps[todo] = steps[todo] / 2
    return u, f, rel, merit, accepted


def newton_solve(fld: _FieldAdapter, u0: Tensor, known: Tensor, tol: float, max_iter: int
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """Deflated Newton on the sphere from the rows of ``u0`` (module docstring), rows batched per iteration: one
    vmapped Jacobian call, the steps, one batched backtracking search (:func:`_line_search`).

    Returns ``(u, rel, iterations, status, jacobians)``; status as :func:`tl_steering.critical.solver.lm_solve`
    (0 converged to ``tol``, 1 merit stalled over ``PATIENCE`` iterations, 2 no step decreased the merit,
    3 iteration limit); ``jacobians`` counts the dense Jacobians of F evaluated."""
    n = u0.shape[0]
    u = _normalize(u0.clone(), EPS_NORM)
    f = fld.many_no_grad(u)
    rel = relative_residual(u, f)
    status, iters = torch.full((n,), -1, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    status[(rel <= tol * 1e-3).cpu()] = 0
    merit = torch.log(rel.clamp_min(1e-300)) + _deflation(u, known)[0]
    history = [merit.clone()]
    n_jac = 0
    for _ in range(max_iter):
        idx = (status < 0).nonzero().flatten()
        if idx.numel() == 0:
            break
        n_jac += idx.numel()
        steps, finite = _newton_steps(fld, u[idx], f[idx], rel[idx], known)
        status[idx[~finite]] = 2
        idx, steps = idx[finite], steps[finite]
        u[idx], f[idx], rel[idx], merit[idx], acc = _line_search(
            fld, u[idx], f[idx], steps, rel[idx], merit[idx], known)
        iters[idx] += 1
        miss = idx[~acc]
        status[miss] = torch.where((rel[miss] <= tol).cpu(), 0, 2)
        history.append(merit.clone())
        status[((status < 0) & (rel <= tol * 1e-3).cpu())] = 0
        if len(history) > PATIENCE:  # log merit: "not halved" = not decreased by log 2
            stalled = (status < 0) & (merit > history[-1 - PATIENCE] - math.log(2)).cpu() & (rel > tol * 1e-3).cpu()
            status[stalled] = 1
    status[status < 0] = 3
    status[(status != 0) & (rel <= tol).cpu()] = 0
    return u, rel, iters, status, n_jac


def eigen_directions(fld: _FieldAdapter, x: Tensor, dirs: int) -> list[Tensor]:
    """Ambient unit tangent vectors Q v at the point ``x`` for the real eigenvectors v of its tangent matrix
    (:func:`tl_steering.critical.spectrum.real_eigvecs`) whose eigenvalues are the ``dirs`` nearest zero below it
    and the ``dirs`` nearest zero above it."""
    with torch.no_grad():
        lam = float(x @ fld.one(x))
    vals = point_eig(fld, x, lam).numpy()
    scale = float(np.abs(vals).max()) if vals.size else 0.0
    real = np.abs(vals.imag) <= 1e-12 * max(scale, 1e-300)
    picks: list[int] = []
    for side in (vals.real < 0, vals.real >= 0):
        cand = np.nonzero(real & side)[0]
        picks += cand[np.argsort(np.abs(vals.real[cand]), kind="stable")][:dirs].tolist()
    vecs = real_eigvecs(fld, x, lam, [float(vals.real[j]) for j in picks])
    h = _Householder(x)
    return [w / w.norm().clamp_min(_EPS) for w in (h.q(vecs[:, k].to(x)) for k in range(len(picks)))]


def explained(x: Tensor, w: Tensor, known: Tensor, cos: float = EXPLAINED_COS) -> bool:
    """True when a known point other than the origin ``x`` lies along the unit tangent direction ``w`` from ``x``:
    some u_k with ||P_x u_k|| > 1e-8 (not x itself, nor -x) whose unit geodesic direction P_x u_k / ||P_x u_k|| has
    cosine >= ``cos`` with ``w``."""
    if known.shape[0] == 0:
        return False
    t = known - (known @ x)[:, None] * x[None]
    nrm = t.norm(dim=-1)
    ok = nrm > 1e-8
    return bool(((t[ok] @ w) / nrm[ok] >= cos).any())


def _choose(pending: deque, deferred: deque, queue: list, expand, known: Tensor, room: int, cos: float,
            counts: dict) -> tuple[list[tuple[Tensor, Tensor, Tensor]], str]:
    """The next batch of at most ``room`` starts: unexplained pending starts first (expanding the next queued
    point when no start is pending; explained ones go to ``deferred``), else the deferred ones in order."""
    chosen: list[tuple[Tensor, Tensor, Tensor]] = []
    while len(chosen) < room:
        if not pending and queue:
            expand()
        if not pending:
            break
        item = pending.popleft()
        if explained(item[0], item[1], known, cos):
            deferred.append(item)
            counts["landscape_deferred"] += 1
        else:
            chosen.append(item)
    if chosen:
        return chosen, "landscape"
    while deferred and len(chosen) < room:  # nothing unexplained left and no new point to expand
        chosen.append(deferred.popleft())
    counts["landscape_deferred_run"] += len(chosen)
    return chosen, "landscape/deferred"


def landscape_phase(fld: _FieldAdapter, points: Tensor, opts: FinderOptions, batch: int = 8,
                    explained_cos: float = EXPLAINED_COS) -> tuple[Tensor, Tensor, Tensor, Tensor, list[str], dict]:
    """Breadth-first solution landscape from the distinct ``points`` (docs/critical_points.md section 9): starts at
    u* ± DELTA·w along ``LANDSCAPE_DIRS`` real tangent eigenvectors per side, deflated Newton with every known point
    deflated, explained starts deferred, at most ``opts.landscape_solves`` rows. Returns rows (u, rel, iterations,
    status, kinds: "landscape" or "landscape/deferred") and counts."""
    known = points.detach().clone()
    queue = [known[i] for i in range(known.shape[0])]
    pending: deque[tuple[Tensor, Tensor, Tensor]] = deque()  # (origin, signed unit direction, start)
    deferred: deque[tuple[Tensor, Tensor, Tensor]] = deque()
    parts: list[tuple] = []
    kinds: list[str] = []
    counts = {"landscape_deferred": 0, "landscape_deferred_run": 0}
    solves, jac_before = 0, fld.n_jacobians

    def expand() -> None:  # the next queued point only: a point never expanded needs no eigenvectors
        x = queue.pop(0)
        for w in eigen_directions(fld, x, LANDSCAPE_DIRS):
            pending.extend((x, sw, _normalize(x + DELTA * sw, EPS_NORM)) for sw in (w, -w))

    while solves < opts.landscape_solves:
        chosen, kind = _choose(pending, deferred, queue, expand, known, min(batch, opts.landscape_solves - solves),
                               explained_cos, counts)
        if not chosen:
            break
        part = newton_solve(fld, torch.stack([s for _, _, s in chosen]), known, opts.tol, opts.max_iter)
        solves += len(chosen)
        parts.append(part[:4])
        kinds += [kind] * len(chosen)
        for x in part[0][part[3].to(part[0].device) == 0]:
            if _match_point(known, x, DEDUP_ANGLE) < 0:
                known = _add_distinct(known, x[None], DEDUP_ANGLE)
                queue.append(x)
    empty = (points.new_zeros(0, points.shape[-1]), points.new_zeros(0), *(torch.zeros(0, dtype=torch.long),) * 2)
    u, rel, it, st = (torch.cat([p[k] for p in parts]) if parts else empty[k] for k in range(4))
    info = {"landscape_rows": solves, "landscape_converged": int((st == 0).sum()),
            "landscape_new_points": int(known.shape[0] - points.shape[0]),
            "landscape_jacobians": fld.n_jacobians - jac_before,
            "landscape_exhausted": not (queue or pending or deferred), **counts}
    return u, rel, it, st, kinds, info


__all__ = ["DELTA", "EXPLAINED_COS", "MAX_STEP", "eigen_directions", "explained", "landscape_phase", "newton_solve"]
