"""The Newton homotopy (``method="homotopy"``): equilibria reached from each start by a path that does not care
about their stability, the unbiased sample of the "mostly saddles" claim (docs/critical_points.md, "The unbiased
sample").

From a start u0 (g0 = F(u0) / ||F(u0)||) the path is the solution curve of

    G(u, t) = P_u [ F(u) / ||F(u)|| - (1 - t) g0 ] = 0,        u ∈ S^{d-1},

which passes through (u0, 0); at t = 1 its points are the zeros of P_u F(u), the equilibria. Along the curve
F̂(u) - (1-t) g0 is radial, so this is the Newton homotopy of the scale-invariant field, whose solution curves are
the trajectories of the (global, Branin) Newton flow: every nondegenerate zero is an attractor of that flow
whatever its Morse index, so the points reached carry no bias toward stability. The remaining bias is that of the
paths: a path that turns back (a fold, where the tangent Jacobian is singular) and leaves to t -> ±∞ (u -> ±g0), or
exceeds the step cap, reaches no equilibrium; the fraction of paths that reach t = 1 is measured and returned.

Tracking: pseudo-arclength continuation (Keller 1977; Allgower & Georg 1990) in the tangent coordinates of the
current point (Householder basis Q): the tangent of the curve is the null vector of [A b], A = Qᵀ D_uG Q,
b = Qᵀ g0 = ∂G/∂t in coordinates; an Euler predictor of length h along it and a chord-Newton corrector on
[G; τᵀ(x - x_pred)] with the bordered matrix [[A, b], [τᵀ]] (one LU per step, retries with h/2 reuse it) pass
turning points. Every crossing of t = 1 is a root: the crossing point (linear interpolation) is polished by Newton on
the sphere (:func:`tl_steering.critical.landscape.newton_solve`, no deflation) to ``tol``. Rows run in lockstep
(one vmapped Jacobian call per step for all active paths).
"""

import math

import torch
from torch import Tensor

from .fields import _EPS, _FieldAdapter, _normalize
from .landscape import newton_solve

#: initial, largest and smallest arclength step (tangent coordinates in radians, t dimensionless)
H0, H_MAX, H_MIN = 0.05, 0.5, 1e-6
#: chord-corrector iterations per attempt and its tolerance on ||G|| (G is dimensionless, |G| <= 2)
CORRECTOR_ITER, CORRECTOR_TOL = 6, 1e-6
#: a chart (one Jacobian) is kept for at most MAX_AGE steps and while the path stays within CHART_RADIUS of its base
MAX_AGE, CHART_RADIUS = 30, 0.3
#: a path that leaves t ∈ [T_LOW, T_HIGH] has run off (u -> ±g0 as t -> ±∞)
T_LOW, T_HIGH = -100.0, 100.0
#: path outcomes
PATH_END = ("roots", "step_cap", "ran_off", "stuck", "closed")


def _house(u: Tensor) -> tuple[Tensor, Tensor]:
    """Batched Householder reflectors H u = ∓e_1 (w, β), as :class:`tl_steering.critical.fields._Householder`."""
    w = u.clone()
    w[:, 0] = w[:, 0] + torch.where(u[:, 0] >= 0, 1.0, -1.0).to(u.dtype)
    return w, 2.0 / (w * w).sum(-1)


def _apply(w: Tensor, beta: Tensor, x: Tensor) -> Tensor:
    return x - (beta * (w * x).sum(-1))[:, None] * w


def _q(w: Tensor, beta: Tensor, s: Tensor) -> Tensor:
    return _apply(w, beta, torch.cat([s.new_zeros(s.shape[0], 1), s], dim=1))


def _qt(w: Tensor, beta: Tensor, v: Tensor) -> Tensor:
    return _apply(w, beta, v)[:, 1:]


def _conjugate(w: Tensor, beta: Tensor, a: Tensor) -> Tensor:
    """H A H for a batch of d × d matrices."""
    aw = (a @ w[:, :, None])[..., 0]
    wa = (w[:, None, :] @ a)[:, 0]
    waw = (w * aw).sum(-1)
    b = beta[:, None, None]
    return (a - b * w[:, :, None] * wa[:, None, :] - b * aw[:, :, None] * w[:, None, :]
            + (beta * beta * waw)[:, None, None] * w[:, :, None] * w[:, None, :])


def _g(f: Tensor, u: Tensor, g0: Tensor, t: Tensor) -> Tensor:
    """G(u, t) = P_u [F̂(u) - (1 - t) g0] (ambient, rows)."""
    hv = f / f.norm(dim=-1, keepdim=True).clamp_min(_EPS) - (1.0 - t)[:, None] * g0
    return hv - (u * hv).sum(-1, keepdim=True) * u


def homotopy_paths(fld: _FieldAdapter, u0: Tensor, tol: float, max_steps: int, max_roots: int = 64,
                   both: bool = True) -> tuple[list[list[tuple[Tensor, float, bool]]], list[str], dict]:
    """Track the Newton homotopy from every row of ``u0`` (module docstring); with ``both`` each start is tracked
    in both directions (rows i and n + i: initial dt/ds > 0 and < 0), and a path goes on through every crossing of
    t = 1 until ``max_roots`` crossings, ``max_steps`` accepted steps, or it runs off.

    Jacobian reuse: a path keeps the chart (base point, Householder basis, LU of the bordered matrix) of its last
    Jacobian while the chord corrector converges within ``CORRECTOR_ITER`` iterations and the path stays within
    ``CHART_RADIUS`` of the base; the predictor is then the secant of the last two points. A failed corrector on an
    old chart refreshes the Jacobian at the current point; on a fresh chart it halves the step.

    Returns (roots per path: [(u, relative residual, converged)], how each path ended (:data:`PATH_END`), counts:
    accepted steps, Jacobians, field evaluations, paths reaching t = 1, final t, arclength)."""
    sign0 = torch.ones(u0.shape[0], dtype=u0.dtype, device=u0.device)
    if both:
        u0, sign0 = torch.cat([u0, u0]), torch.cat([sign0, -sign0])
    n, d = u0.shape
    dev, dt_ = u0.device, u0.dtype
    u0 = _normalize(u0)
    with torch.no_grad():
        f0 = fld.many(u0)
    g0 = f0 / f0.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    eye = torch.eye(d - 1, dtype=dt_, device=dev)
    # per path: chart (base point, reflector, LU of [[A, b], [τᵀ]], τ), position x = (s, t) in the chart, the
    # previous position, the direction of travel (ambient tangent part and t part), step, age of the chart
    base, wb = u0.clone(), u0.clone()
    bb = torch.ones(n, dtype=dt_, device=dev)
    lu = torch.zeros(n, d, d, dtype=dt_, device=dev)
    piv = torch.zeros(n, d, dtype=torch.int32, device=dev)
    tau = torch.zeros(n, d, dtype=dt_, device=dev)
    x = torch.zeros(n, d, dtype=dt_, device=dev)
    x_prev = torch.zeros(n, d, dtype=dt_, device=dev)
    dir_u = torch.zeros(n, d, dtype=dt_, device=dev)
    dir_t = sign0.clone()
    h = torch.full((n,), H0, dtype=dt_, device=dev)
    age = torch.zeros(n, dtype=torch.long)
    stale = torch.ones(n, dtype=torch.bool)
    active = torch.ones(n, dtype=torch.bool)
    end = [""] * n
    roots: list[list[tuple[Tensor, float, bool]]] = [[] for _ in range(n)]
    steps = torch.zeros(n, dtype=torch.long)
    arc = torch.zeros(n, dtype=torch.float64)
    counts = {"jacobians": 0, "evaluations": n, "rejected": 0}

    def point(rows: Tensor, xs: Tensor) -> Tensor:
        return _normalize(base[rows] + _q(wb[rows], bb[rows], xs[:, :-1]))

    for _ in range(60 * max_steps):
        if not bool(active.any()):
            break
        ref = (active & stale).nonzero().flatten()
        if ref.numel():  # new charts at the current points
            rv = ref.to(dev)
            ub = point(rv, x[rv]) if bool((age[ref] >= 0).all()) else base[rv]
            ub = torch.where((steps[ref] == 0).to(dev)[:, None] & (age[ref] == 0).to(dev)[:, None], u0[rv], ub)
            tb = x[rv, -1]
            jl = fld.jacobians(ub)
            jac = torch.stack([j if j is not None else fld.jacobian(y) for j, y in zip(jl, ub)]).detach()
            counts["jacobians"] += ref.numel()
            with torch.no_grad():
                fb = fld.many(ub)
            counts["evaluations"] += ref.numel()
            w, beta = _house(ub)
            fn = fb.norm(dim=-1, keepdim=True).clamp_min(_EPS)
            fh = fb / fn
            dh = (jac - fh[:, :, None] * (fh[:, None, :] @ jac)) / fn[:, :, None]
            hv = fh - (1.0 - tb)[:, None] * g0[rv]
            a = _conjugate(w, beta, dh)[:, 1:, 1:] - (ub * hv).sum(-1)[:, None, None] * eye
            top = torch.cat([a, _qt(w, beta, g0[rv])[:, :, None]], dim=2)
            prev = torch.cat([_qt(w, beta, dir_u[rv]), dir_t[rv][:, None]], dim=1)
            rhs = torch.zeros(ref.numel(), d, dtype=dt_, device=dev)
            rhs[:, -1] = 1.0
            z = torch.linalg.solve(torch.cat([top, prev[:, None, :]], dim=1), rhs)
            z = z / z.norm(dim=-1, keepdim=True)
            lu[rv], piv[rv] = torch.linalg.lu_factor(torch.cat([top, z[:, None, :]], dim=1))
            base[rv], wb[rv], bb[rv], tau[rv] = ub, w, beta, z
            x[rv] = 0.0
            x[rv, -1] = tb
            x_prev[rv] = x[rv]
            age[ref] = 0
            stale[ref] = False
        idx = active.nonzero().flatten()
        iv = idx.to(dev)
        sec = x[iv] - x_prev[iv]
        sn = sec.norm(dim=-1, keepdim=True)
        fresh = (age[idx] == 0).to(dev)[:, None] | (sn <= 0)
        direction = torch.where(fresh, tau[iv], sec / sn.clamp_min(1e-300))
        pred = x[iv] + h[iv][:, None] * direction
        xc = pred.clone()
        ok = torch.zeros(idx.numel(), dtype=torch.bool)
        bad = torch.zeros(idx.numel(), dtype=torch.bool)
        last = torch.full((idx.numel(),), math.inf, dtype=dt_)
        iters = torch.zeros(idx.numel(), dtype=torch.long)
        for it in range(CORRECTOR_ITER):
            run = (~ok & ~bad).nonzero().flatten()
            if run.numel() == 0:
                break
            rr = run.to(dev)
            rows = iv[rr]
            uc = point(rows, xc[rr])
            with torch.no_grad():
                fc = fld.many(uc)
            counts["evaluations"] += run.numel()
            r = _qt(wb[rows], bb[rows], _g(fc, uc, g0[rows], xc[rr, -1]))
            c = (tau[rows] * (xc[rr] - pred[rr])).sum(-1)
            res = torch.cat([r, c[:, None]], dim=1)
            delta = torch.linalg.lu_solve(lu[rows], piv[rows], -res[:, :, None])[..., 0]
            dn = delta.norm(dim=-1).cpu().to(dt_)
            div = ~torch.isfinite(dn) | ((dn > 0.5 * last[run]) & (it >= 1))
            xc[rr] = xc[rr] + torch.where(div.to(dev)[:, None], torch.zeros_like(delta), delta)
            iters[run] += 1
            conv = (r.norm(dim=-1).cpu() < CORRECTOR_TOL) & (dn < 1e-4) & ~div
            ok[run] = conv
            bad[run] = div
            last[run] = dn
        far = (xc[:, :-1].norm(dim=-1) > CHART_RADIUS).cpu()
        good = ok & ((xc - pred).norm(dim=-1).cpu() < h[iv].cpu() + 1e-12)
        crossings: list[tuple[int, Tensor]] = []
        for k, i in enumerate(idx.tolist()):
            if not bool(good[k]):
                counts["rejected"] += 1
                if int(age[i]) > 0:
                    stale[i] = True
                else:
                    h[i] = h[i] / 2
                    if float(h[i]) < H_MIN:
                        active[i], end[i] = False, "stuck"
                continue
            t_old, t_new = float(x[i, -1]), float(xc[k, -1])
            if (t_old - 1.0) * (t_new - 1.0) <= 0.0 and t_new != t_old:
                theta = (1.0 - t_old) / (t_new - t_old)
                xi = x[i] + theta * (xc[k] - x[i])
                crossings.append((i, point(torch.tensor([i], device=dev), xi[None])[0]))
            step = xc[k] - x[i]
            arc[i] += float(step.norm())
            x_prev[i], x[i] = x[i], xc[k]
            amb = _q(wb[i:i + 1], bb[i:i + 1], step[None, :-1])[0]
            dir_u[i], dir_t[i] = amb, step[-1]
            age[i] += 1
            steps[i] += 1
            if int(age[i]) == 1:  # a fresh chart: the corrector's work says how far the linear model holds
                h[i] = min(float(h[i]) * (1.5 if int(iters[k]) <= 3 else 1.0 if int(iters[k]) <= 4 else 0.7), H_MAX)
            if bool(far[k]) or int(age[i]) >= MAX_AGE or (int(age[i]) > 1 and int(iters[k]) >= 4):
                stale[i] = True
            if steps[i] >= max_steps:
                active[i], end[i] = False, "step_cap"
            elif not T_LOW <= t_new <= T_HIGH:
                active[i], end[i] = False, "ran_off"
            elif arc[i] > 0.5 and abs(t_new) < 1e-4:
                if float((point(torch.tensor([i], device=dev), xc[k][None])[0] - u0[i]).norm()) < 1e-4:
                    active[i], end[i] = False, "closed"
        if crossings:
            rows_c = [i for i, _ in crossings]
            ur, rr_, _, sr, nj = newton_solve(fld, torch.stack([y for _, y in crossings]), u0[:0], tol, 30)
            counts["jacobians"] += nj
            for k, i in enumerate(rows_c):
                roots[i].append((ur[k].detach(), float(rr_[k]), int(sr[k]) == 0))
                if len(roots[i]) >= max_roots and active[i]:
                    active[i], end[i] = False, "roots"
    for i in range(n):
        if active[i] or not end[i]:
            end[i] = "step_cap"
    counts["steps"] = int(steps.sum())
    counts["paths_reaching_t1"] = sum(1 for r in roots if r)
    counts["paths_with_root"] = sum(1 for r in roots if any(ok_ for _, _, ok_ in r))
    counts["t_end"] = [round(float(y), 4) for y in x[:, -1]]
    counts["arclength"] = [round(float(y), 4) for y in arc]
    return roots, end, counts


def homotopy_finder(fld: _FieldAdapter, u0: Tensor, kinds: list[str], tol: float, max_steps: int,
                    max_roots: int = 64) -> tuple[Tensor, Tensor, Tensor, Tensor, list[str], dict]:
    """``find_equilibria(method="homotopy")``: two paths per start (both directions); rows = one per root reached
    (path order), then one per path that reached none (status 3, its start). Status 0 converged (polished to
    ``tol``), 1 a crossing whose polish failed, 3 no crossing."""
    roots, end, counts = homotopy_paths(fld, u0, tol, max_steps, max_roots)
    n0 = u0.shape[0]
    kinds = [f"{k}+" for k in kinds] + [f"{k}-" for k in kinds]
    u0 = torch.cat([u0, u0])
    us, rels, sts, ks = [], [], [], []
    for i, rs in enumerate(roots):
        for x, rel, ok in rs:
            us.append(x)
            rels.append(rel)
            sts.append(0 if ok else 1)
            ks.append(f"{kinds[i]}/homotopy")
    for i, rs in enumerate(roots):
        if not rs:
            us.append(u0[i])
            rels.append(math.inf)
            sts.append(3)
            ks.append(f"{kinds[i]}/homotopy:{end[i]}")
    u = torch.stack(us) if us else u0[:0]
    info = {"paths": int(u0.shape[0]), "starts": n0, "path_end": {k: end.count(k) for k in PATH_END}, **counts}
    return (u, torch.tensor(rels, dtype=u0.dtype, device=u0.device), torch.zeros(len(us), dtype=torch.long),
            torch.tensor(sts, dtype=torch.long), ks, info)


__all__ = ["PATH_END", "homotopy_finder", "homotopy_paths"]
