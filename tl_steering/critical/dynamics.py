"""The flow phase of the finder (docs/critical_points.md sections 2 and 6.2): the projected power iteration of F and
-F (attractors, repellers) and edge tracking between their basins (boundary saddles), each row finished by the
Levenberg-Marquardt end game of :mod:`tl_steering.critical.solver`. Its points are a sample of what the dynamics
reach, not of all equilibria."""

import time

import torch
from torch import Tensor

from ..geometry import EPS_NORM, _normalize
from .fields import _FieldAdapter, _match_point, relative_residual
from .options import DEDUP_ANGLE, FinderOptions
from .solver import lm_solve


def _map(fld: _FieldAdapter, u: Tensor, s: Tensor, shift: Tensor | None) -> Tensor:
    """One step of the (shifted) power map, u <- normalize(s·F(u) + σ u), per row."""
    f = s * fld.many_no_grad(u)
    return _normalize(f if shift is None else f + shift * u, EPS_NORM)


def power_iterate(fld: _FieldAdapter, u: Tensor, sign: Tensor, n_iter: int, switch: float,
                  shift: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Rows of ``u`` iterated by u <- normalize(sign·F(u) + shift·u) until the relative residual is < ``switch``.

    ``shift`` (σ per row, in the field's units; None: 0) makes the map the explicit Euler step of the flow
    u' = s·P_u F(u) with step 1/(sλ + σ): a flow attractor (s = +1; repeller for s = -1) with tangent eigenvalues
    μ is a stable fixed point of it once sλ + σ > max |μ|² / (2 |Re μ|), which σ = 0 misses where rotation is strong.
    Returns ``(u, rel)``: final rows and their relative residuals (inf where F is not finite)."""
    u = u.clone()
    s = sign.to(u.dtype)[:, None]
    sh = None if shift is None else shift.to(u.dtype)[:, None]
    with torch.no_grad():
        f = fld.many_no_grad(u)
        rel = relative_residual(u, f)
        active = torch.isfinite(rel) & (rel >= switch)
        for _ in range(int(n_iter)):
            idx = active.nonzero().flatten()
            if idx.numel() == 0:
                break
            step = s[idx] * f[idx]
            u[idx] = _normalize(step if sh is None else step + sh[idx] * u[idx], EPS_NORM)
            f[idx] = fld.many_no_grad(u[idx])
            rel[idx] = relative_residual(u[idx], f[idx])
            active[idx[~torch.isfinite(rel[idx]) | (rel[idx] < switch)]] = False
    return u, rel


def _side(fld: _FieldAdapter, m: Tensor, s: Tensor, ea: Tensor, eb: Tensor, horizon: int,
          shift: Tensor | None = None) -> Tensor:
    """True where the iteration from ``m`` ends nearer ``ea`` than ``eb`` (rows leave once within 0.05 of one)."""
    x = m.clone()
    decided = torch.zeros(m.shape[0], dtype=torch.bool, device=m.device)
    for _ in range(int(horizon)):
        idx = (~decided).nonzero().flatten()
        if idx.numel() == 0:
            break
        x[idx] = _map(fld, x[idx], s[idx], None if shift is None else shift[idx])
        near = torch.minimum((x[idx] - ea[idx]).norm(dim=-1), (x[idx] - eb[idx]).norm(dim=-1)) < 0.05
        decided[idx[near]] = True
    return (x - ea).norm(dim=-1) <= (x - eb).norm(dim=-1)


def edge_track(fld: _FieldAdapter, a: Tensor, b: Tensor, end_a: Tensor, end_b: Tensor, sign: Tensor,
               bisections: int = 20, horizon: int = 25, rounds: int = 3, switch: float = 5e-2,
               separation: float = 1e-2, shift: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Edge states between the basins of ``end_a`` and ``end_b`` (rows), batched over the pairs (docs/critical_points.md
    section 6.2); ``a`` / ``b``: starts whose iterations reached them, ``sign``: the map's s per pair. Rounds after the
    first bisect 2/3 as often. Returns ``(u, rel)``: the A-side point of lowest relative residual and that residual."""
    s = sign.to(a.dtype)[:, None]
    sh_all = None if shift is None else shift.to(a.dtype)[:, None]
    a, b = a.clone(), b.clone()
    best = a.clone()
    rel = torch.full((a.shape[0],), float("inf"), dtype=a.dtype, device=a.device)
    active = torch.ones(a.shape[0], dtype=torch.bool, device=a.device)
    with torch.no_grad():
        for rnd in range(int(rounds)):
            first = rnd == 0  # later rounds start from a bracket of width ~``separation``: fewer halvings
            idx = active.nonzero().flatten()
            if idx.numel() == 0:
                break
            aa, bb, ea, eb, ss = a[idx], b[idx], end_a[idx], end_b[idx], s[idx]
            sh = None if sh_all is None else sh_all[idx]
            for _ in range(int(bisections) if first else max(1, int(bisections) * 2 // 3)):
                m = _normalize(aa + bb, EPS_NORM)
                to_a = _side(fld, m, ss, ea, eb, int(horizon), sh)
                aa = torch.where(to_a[:, None], m, aa)
                bb = torch.where(to_a[:, None], bb, m)
            together = torch.ones(idx.numel(), dtype=torch.bool, device=a.device)
            bst, rl = best[idx], rel[idx]
            for _ in range(int(horizon)):
                fa = fld.many_no_grad(aa)
                ra = relative_residual(aa, fa)
                better = together & (ra < rl)
                bst = torch.where(better[:, None], aa, bst)
                rl = torch.where(better, ra, rl)
                step_a = _normalize(ss * fa if sh is None else ss * fa + sh * aa, EPS_NORM)
                step_b = _map(fld, bb, ss, sh)
                aa = torch.where(together[:, None], step_a, aa)
                bb = torch.where(together[:, None], step_b, bb)
                together = together & ((aa - bb).norm(dim=-1) < separation)
                if not bool(together.any()):
                    break
            a[idx], b[idx], best[idx], rel[idx] = aa, bb, bst, rl
            active[idx[rl < switch]] = False
    return best, rel


#: shifts σ / median ||F|| tried in turn by the flow finder for a sign whose plain power map fixes no point
SHIFTS = (1.0, 4.0)
#: a power row "reached" a point of its sign when its relative residual is below this and s·λ > 0
REACHED_BELOW = 1e-2


def _reached(fld: _FieldAdapter, u: Tensor, rel: Tensor, sign: Tensor) -> bool:
    """True when some row sits on a point of its own sign: relative residual < ``REACHED_BELOW`` and
    s·λ > 0 (λ = <u, F(u)>). A row with a small residual but s·λ < 0 sits on a point the map u <- normalize(s·F(u))
    sends to -u (a 2-cycle for a linear field, whose dominant eigenvalue for that sign is negative): it does not
    count as a fixed point of the sign, so the shifted map is tried (docs/critical_points.md, section 8.3)."""
    near = rel < REACHED_BELOW
    if not bool(near.any()):
        return False
    lam = (u[near] * fld.many_no_grad(u[near])).sum(-1)
    return bool((sign[near].to(lam.dtype) * lam > 0).any())


def _edge_pairs(ends: list[int], n_pairs: int) -> list[tuple[int, int]]:
    """Up to ``n_pairs`` pairs of rows whose fixed points differ: ``ends`` holds each row's fixed-point id (-1:
    none). The first row reaching each point represents it; pairs of points are taken by increasing distance in
    order of discovery ((1,2), (2,3), ..., then (1,3), ...), so that every point takes part before any repeats."""
    first: dict[int, int] = {}
    for row, e in enumerate(ends):
        if e >= 0 and e not in first:
            first[e] = row
    ids = list(first)
    out: list[tuple[int, int]] = []
    for gap in range(1, len(ids)):
        for i in range(len(ids) - gap):
            if len(out) >= n_pairs:
                return out
            out.append((first[ids[i]], first[ids[i + gap]]))
    return out


def _power_phase(fld: _FieldAdapter, u0: Tensor, pre_iter: int, tol: float) -> tuple:
    """Power rows of both signs from the starts (2n rows: s = +1, then s = -1); a sign none of whose rows reached
    a point of its own sign (:func:`_reached`) is rerun with the shifted map (``SHIFTS``). Returns ``(u, rel, sign,
    shift, plain)``, ``plain`` the rows the plain map of a shifted sign had left on an equilibrium (s·λ < 0)."""
    n = u0.shape[0]
    dev, dt = u0.device, u0.dtype
    sign = torch.cat([torch.ones(n, dtype=dt, device=dev), -torch.ones(n, dtype=dt, device=dev)])
    starts = torch.cat([u0, u0])
    up, relp = power_iterate(fld, starts, sign, pre_iter, tol)  # linear but cheap: no Jacobian
    shift = torch.zeros(2 * n, dtype=dt, device=dev)
    plain = []
    for half in (slice(0, n), slice(n, 2 * n)):  # a sign whose map fixes nothing: the shifted map (damped rotation)
        for factor in SHIFTS:
            if _reached(fld, up[half], relp[half], sign[half]):
                break
            if factor == SHIFTS[0]:
                near = half.start + (relp[half] < REACHED_BELOW).nonzero().flatten()
                plain.append((near, up[near].clone(), relp[near].clone()))
            shift[half] = factor * fld.many_no_grad(u0).norm(dim=-1).median()
            up[half], relp[half] = power_iterate(fld, starts[half], sign[half], pre_iter, tol, shift[half])
    return up, relp, sign, shift, plain


def _finish(fld: _FieldAdapter, u: Tensor, rel: Tensor, near: float, opts: FinderOptions
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """LM end game (no deflation) of the rows whose relative residual lies in (tol, near)."""
    status = torch.where(rel <= opts.tol, 0, 1).cpu()
    iters = torch.zeros(u.shape[0], dtype=torch.long)
    todo = ((rel > opts.tol) & (rel < near)).nonzero().flatten()
    if todo.numel():
        ub, rb, ib, sb = lm_solve(fld, u[todo], opts.tol, opts.max_iter)
        u, rel = u.clone(), rel.clone()
        u[todo], rel[todo] = ub.detach(), rb
        status[todo.cpu()], iters[todo.cpu()] = sb.cpu(), ib.cpu()
    return u, rel, iters, status


def _map_ids(u: Tensor, status: Tensor) -> tuple[list[int], Tensor]:
    """Fixed-point id per row (-1: not converged; angle <= ``DEDUP_ANGLE`` is one point) and the points."""
    ends = [-1] * u.shape[0]
    points = u[:0]
    for i in (status == 0).nonzero().flatten().tolist():
        hit = _match_point(points, u[i], DEDUP_ANGLE)
        if hit < 0:
            points = torch.cat([points, u[i][None]])
            hit = points.shape[0] - 1
        ends[i] = hit
    return ends, points


def _flow(fld: _FieldAdapter, u0: Tensor, kinds: list[str], opts: FinderOptions
          ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[str], dict]:
    """The flow finder: power phase (both signs, :func:`_power_phase`) and edge phase, each finished by LM without
    deflation. Rows: 2n power rows, then one row per edge pair, then the rows the plain map of a shifted sign had
    left on an equilibrium (``plain_rows``, kept so that no point it reached is lost); where the power phase reaches
    no point at all, n more rows: LM from the starts (the map has no fixed point there)."""
    n = u0.shape[0]
    clock = time.perf_counter()
    up, relp, sign, shift, plain = _power_phase(fld, u0, opts.pre_iter, opts.tol)
    seconds = {"power": time.perf_counter() - clock}
    clock = time.perf_counter()
    u, rel, iters, status = _finish(fld, up, relp, 1e-2, opts)
    seconds["power_finish"] = time.perf_counter() - clock
    ends, points = _map_ids(u, status)
    n_plus = opts.edge_pairs - opts.edge_pairs // 2
    plus = _edge_pairs(ends[:n], n_plus)
    minus = [(a + n, b + n) for a, b in _edge_pairs(ends[n:], opts.edge_pairs - len(plus))]
    if len(plus) < n_plus:
        plus = _edge_pairs(ends[:n], opts.edge_pairs - len(minus))
    pairs = plus + minus
    row_kinds = [f"{k}/power+" for k in kinds] + [f"{k}/power-" for k in kinds]
    info = {"power_rows": 2 * n, "power_converged": int((status == 0).sum()), "edge_rows": len(pairs),
            "fixed_points_of_map": points.shape[0], "shift": [float(shift[0]), float(shift[-1])]}
    parts = [(u, rel, iters, status)]
    if pairs:
        ia = torch.tensor([a for a, _ in pairs], device=u0.device)
        ib = torch.tensor([b for _, b in pairs], device=u0.device)
        starts = torch.cat([u0, u0])
        clock = time.perf_counter()
        ue, rele = edge_track(fld, starts[ia], starts[ib], u[ia], u[ib], sign[ia], shift=shift[ia])
        seconds["edge"] = time.perf_counter() - clock
        clock = time.perf_counter()
        parts.append(_finish(fld, ue, rele, 5e-2, opts))
        seconds["edge_finish"] = time.perf_counter() - clock
        row_kinds += [f"edge{'+' if a < n else '-'}" for a, _ in pairs]
        info["edge_converged"] = int((parts[-1][3] == 0).sum())
    rows = [i for near, _, _ in plain for i in near.tolist()]
    if rows:  # equilibria the plain map reached before its sign was shifted are kept, never discarded
        parts.append(_finish(fld, torch.cat([x for _, x, _ in plain]), torch.cat([r for _, _, r in plain]),
                             REACHED_BELOW, opts))
        row_kinds += [f"{kinds[i % n]}/power{'+' if i < n else '-'}/plain" for i in rows]
    info["plain_rows"] = len(rows)
    if points.shape[0] == 0:  # the map has no fixed point from these starts (e.g. a rotation-dominated field): LM
        clock = time.perf_counter()
        ul, rl, il, sl = lm_solve(fld, u0, opts.tol, opts.max_iter)
        seconds["lm_fallback"] = time.perf_counter() - clock
        parts.append((ul.detach(), rl, il.cpu(), sl.cpu()))
        row_kinds += [f"{k}/lm" for k in kinds]
        info["lm_rows"] = n
    info["phase_seconds"] = seconds
    u, rel, iters, status = (torch.cat([p[k] for p in parts]) for k in range(4))
    return u, rel, iters, status, row_kinds, info


__all__ = ["SHIFTS", "edge_track", "power_iterate"]
