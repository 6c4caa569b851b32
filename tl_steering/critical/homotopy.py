"""The homotopy finder (``method="homotopy"``): equilibria crossed by paths from each start that are not defined by
their stability, the sample of the "mostly saddles" claim in docs/critical_points.md, section 10.

From a start u0 the path is the solution curve through (u0, 0) of G(u, t) = P_u h(u, t) = 0 on S^{d-1} × R, with
F̂ = F / ||F|| and either

* ``kind="fixed_point"`` (the default): h = t F̂(u) + (1 - t) u0 (the fixed-point / probability-one homotopy of Chow,
  Mallet-Paret & Yorke 1978: at t = 0 the only zeros are ±u0, and the curve from u0 is regular for almost every u0);
  tracked for F and for -F (λ > 0 and λ < 0), or
* ``kind="newton"``: h = F̂(u) - (1 - t) e, e = P_u0 F̂(u0) (the Newton homotopy: its curves are the trajectories of
  the global (Branin) Newton flow, which has every nondegenerate zero as an attractor); tracked both ways from u0.

At t = 1 both are P_u F̂ = 0: every crossing of t = 1 is an equilibrium. Neither construction refers to the stability
of a zero (the tangent spectrum enters only through the regularity of the curve), but the order of the crossings is
not neutral: for t < 1 a fixed-point path is a branch of fixed points of u ↦ normalize(t F̂(u) + (1 - t) u0), stable
from t = 0 until a fold, so its first crossing is an attractor (F) or a repeller (-F) unless it folds before t = 1;
its later crossings (after folds) walk to saddles. The rows record each crossing's number along its path
(``start_kind`` ends in ``:k``) so that a sample can be split by it (measured on planted fields and real models:
docs section 10). A path that runs off (|t| > 100), stalls (step below 1e-6) or reaches the step cap before
crossing t = 1 contributes nothing; the fraction of paths that reach t = 1 is returned. Measured on SmolLM2 layer 15:
the Newton homotopy's t stays within 0.04 of 0 over 3.5 rad of path (its curves wind through the region where F̂
turns fast, ||DF|| / ||F|| ≈ 33), while the fixed-point homotopy crosses t = 1 on both paths of one start.

Tracking: pseudo-arclength continuation (Keller 1977; Allgower & Georg 1990) in the tangent coordinates of a chart
(base point and Householder basis Q): the tangent of the curve is the null vector of [A b], A = Qᵀ D_uG Q, b = Qᵀ ∂h/∂t;
an Euler (fresh chart) or secant predictor of length h and a chord-Newton corrector on [G; τᵀ(x - x_pred)] with the
LU of the bordered matrix [[A, b], [τᵀ]], which passes turning points. A chart (one dense Jacobian) is kept while
the corrector converges within 3 iterations and the path stays within CHART_RADIUS of its base; the step grows by
1.5 when a fresh chart's corrector needs <= 3 iterations and shrinks (× 0.7, or halves on failure) otherwise. Every
crossing of t = 1 (linear interpolation) is polished by Newton on the sphere
(:func:`tl_steering.critical.landscape.newton_solve`, no deflation) to ``tol``. Paths run in lockstep (one vmapped
Jacobian call per refresh for all paths that need one).
"""

import math

import torch
from torch import Tensor

from .fields import _EPS, _FieldAdapter, _Householder, _normalize
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


def _h(f: Tensor, t: Tensor, g0: Tensor, u0: Tensor, kind: str) -> Tensor:
    """The vector whose tangent part is G: F̂ - (1 - t) e ("newton") or t F̂ + (1 - t) u0 ("fixed_point")."""
    fh = f / f.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    if kind == "newton":
        return fh - (1.0 - t)[:, None] * g0
    return t[:, None] * fh + (1.0 - t)[:, None] * u0


def _g(f: Tensor, u: Tensor, g0: Tensor, t: Tensor, u0: Tensor, kind: str) -> Tensor:
    """G(u, t) = P_u h (ambient, rows)."""
    hv = _h(f, t, g0, u0, kind)
    return hv - (u * hv).sum(-1, keepdim=True) * u


def homotopy_paths(fld: _FieldAdapter, u0: Tensor, tol: float, max_steps: int, max_roots: int = 64,
                   both: bool = True, kind: str = "newton") -> tuple[list[list[tuple[Tensor, float, bool]]], list[str], dict]:
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
    fsign = sign0.clone()  # the fixed-point homotopy tracks F and -F (λ > 0 and λ < 0), the Newton one both ways
    if both:
        u0 = torch.cat([u0, u0])
        if kind == "newton":
            sign0, fsign = torch.cat([sign0, -sign0]), torch.cat([fsign, fsign])
        else:
            sign0, fsign = torch.cat([sign0, sign0]), torch.cat([fsign, -fsign])
    n, d = u0.shape
    dev, dt_ = u0.device, u0.dtype
    u0 = _normalize(u0)
    with torch.no_grad():
        f0 = fld.many(u0) * fsign[:, None]
    g0 = f0 / f0.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    g0 = g0 - (u0 * g0).sum(-1, keepdim=True) * u0  # e = P_u0 F̂(u0): the start's tangent residual
    eye = torch.eye(d - 1, dtype=dt_, device=dev)
    # per path: chart (base point, reflector, LU of [[A, b], [τᵀ]], τ), position x = (s, t) in the chart, the
    # previous position, the direction of travel (ambient tangent part and t part), step, age of the chart
    base, hb = u0.clone(), _Householder(u0)
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
    first = [-1] * n  # accepted steps before the first crossing of t = 1
    counts = {"jacobians": 0, "evaluations": n, "rejected": 0}

    def point(rows: Tensor, xs: Tensor) -> Tensor:
        return _normalize(base[rows] + hb[rows].q(xs[:, :-1]))

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
            jac = jac * fsign[rv][:, None, None]
            counts["jacobians"] += ref.numel()
            with torch.no_grad():
                fb = fld.many(ub) * fsign[rv][:, None]
            counts["evaluations"] += ref.numel()
            hr = _Householder(ub)
            fn = fb.norm(dim=-1, keepdim=True).clamp_min(_EPS)
            fh = fb / fn
            dh = (jac - fh[:, :, None] * (fh[:, None, :] @ jac)) / fn[:, :, None]
            hv = _h(fb, tb, g0[rv], u0[rv], kind)
            dt_col = g0[rv] if kind == "newton" else fh - u0[rv]  # ∂h/∂t
            if kind != "newton":
                dh = tb[:, None, None] * dh
            a = hr.conjugate(dh)[:, 1:, 1:] - (ub * hv).sum(-1)[:, None, None] * eye
            top = torch.cat([a, hr.qt(dt_col)[:, :, None]], dim=2)
            prev = torch.cat([hr.qt(dir_u[rv]), dir_t[rv][:, None]], dim=1)
            rhs = torch.zeros(ref.numel(), d, dtype=dt_, device=dev)
            rhs[:, -1] = 1.0
            z = torch.linalg.solve(torch.cat([top, prev[:, None, :]], dim=1), rhs)
            z = z / z.norm(dim=-1, keepdim=True)
            lu[rv], piv[rv] = torch.linalg.lu_factor(torch.cat([top, z[:, None, :]], dim=1))
            base[rv], tau[rv] = ub, z
            hb[rv] = hr
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
                fc = fld.many(uc) * fsign[rows][:, None]
            counts["evaluations"] += run.numel()
            r = hb[rows].qt(_g(fc, uc, g0[rows], xc[rr, -1], u0[rows], kind))
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
            amb = hb[i:i + 1].q(step[None, :-1])[0]
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
                if not roots[i]:
                    first[i] = int(steps[i])
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
    counts["first_crossing_step"] = first
    counts["crossings"] = [len(r) for r in roots]
    return roots, end, counts


def homotopy_finder(fld: _FieldAdapter, u0: Tensor, kinds: list[str], tol: float, max_steps: int,
                    max_roots: int = 64, kind: str = "newton") -> tuple[Tensor, Tensor, Tensor, Tensor, list[str], dict]:
    """``find_equilibria(method="homotopy")``: two paths per start (both directions); rows = one per root reached
    (path order), then one per path that reached none (status 3, its start). Status 0 converged (polished to
    ``tol``), 1 a crossing whose polish failed, 3 no crossing."""
    roots, end, counts = homotopy_paths(fld, u0, tol, max_steps, max_roots, kind=kind)
    n0 = u0.shape[0]
    kinds = [f"{k}+" for k in kinds] + [f"{k}-" for k in kinds]
    u0 = torch.cat([u0, u0])
    us, rels, sts, ks = [], [], [], []
    for i, rs in enumerate(roots):
        for j, (x, rel, ok) in enumerate(rs):
            us.append(x)
            rels.append(rel)
            sts.append(0 if ok else 1)
            ks.append(f"{kinds[i]}/homotopy:{j + 1}")  # the crossing's number along its path
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
