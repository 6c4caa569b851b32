"""Public finder and classifier for any field on the sphere (see docs/critical_points.md).

Pure tensor math: it knows nothing of TransformerLens; :func:`tl_steering.critical_points` builds the model's field
and hands it here.
"""

import math
import time
from typing import Any, Literal

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from ..errors import InputError
from ..results import Provenance
from .fields import Field, _add_distinct, _FieldAdapter, _match_point, _normalize, relative_residual
from .dynamics import _flow
from .homotopy import homotopy_finder
from .landscape import landscape_phase
from .reflected import reflected_finder
from .firstorder import _fixed_point, _newton, _riemannian_descent
from .results import EquilibriaResult, PointClassification
from .solver import GAUSS_NEWTON_BELOW, lm_solve
from .spectrum import DENSE_MAX_DIM, _classify, _resolve_eigensolver, _Spectrum

Method = Literal["landscape", "lm", "riemannian", "fixed_point", "flow", "flow+lm", "reflected", "homotopy"]
Eigensolver = Literal["auto", "dense", "arpack"]
METHODS: tuple[str, ...] = ("landscape", "lm", "riemannian", "fixed_point", "flow", "flow+lm", "reflected", "homotopy")
#: outcome of a start, by status code of :func:`tl_steering.critical.solver.lm_solve`
STATUS = ("converged", "stalled", "no_decrease", "iteration_limit")


def _check_dim(dim: Any) -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 2:
        raise InputError(f"dim must be an int >= 2 (the sphere S^(d-1) needs d >= 2); got {dim!r}")
    return int(dim)


def _prepare_starts(starts: Tensor | None, dim: int, n_starts: int, seed: int, dtype: torch.dtype,
                    device: torch.device) -> tuple[Tensor, list[str]]:
    given = torch.zeros(0, dim, dtype=dtype, device=device)
    if starts is not None:
        if not isinstance(starts, Tensor):
            starts = torch.as_tensor(np.asarray(starts))
        if starts.ndim == 1:
            starts = starts[None]
        if starts.ndim != 2 or starts.shape[1] != dim:
            raise InputError(f"starts must have shape [m, {dim}] (or [{dim}]); got {list(starts.shape)}")
        given = starts.detach().to(device=device, dtype=dtype)
        norms = given.norm(dim=-1)
        if not bool(torch.isfinite(norms).all()) or bool((norms <= 0).any()):
            raise InputError("every start must be a finite non-zero vector (it is normalised to the sphere); drop "
                             "zero or NaN rows")
        given = given / norms[:, None]
    n_random = max(0, n_starts - given.shape[0])
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    rand = torch.randn(n_random, dim, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    rand = _normalize(rand)
    return torch.cat([given, rand]), ["given"] * given.shape[0] + ["random"] * n_random


def find_equilibria(
    field: Field,
    dim: int,
    n_starts: int = 64,
    starts: Float[Tensor, "m d_model"] | None = None,
    seed: int = 0,
    tol: float = 1e-10,
    dedup_angle: float = 1e-6,
    max_iter: int = 60,
    method: Method | None = None,
    deflation: bool = True,
    resolve: bool = True,
    batch_size: int = 4,
    patience: int = 8,
    deflation_power: float = 2.0,
    deflation_shift: float = 1.0,
    pre_iter: int = 200,
    eigensolver: Eigensolver = "auto",
    n_eigs: int = 6,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
    label_tol: float = 1e-6,
    rot_ratio: float = 0.1,
    edge_pairs: int = 8,
    landscape: bool = True,
    landscape_dirs: int = 2,
    landscape_solves: int = 256,
    homotopy_steps: int = 300,
    homotopy_roots: int = 64,
    homotopy_kind: str = "fixed_point",
) -> EquilibriaResult:
    """Find and classify the equilibria u* ∈ S^{d-1} of a field, F(u*) = λ u* (docs/critical_points.md).

    Default (``method=None``): ``"landscape"`` for d <= 1024 (the flow finder, then the solution-landscape phase of
    :mod:`tl_steering.critical.landscape`: deflated Newton from every point found along the real tangent
    eigenvectors nearest zero, which reaches equilibria of every Morse index), ``"lm"`` above. ``method="lm"``:
    Levenberg-Marquardt on the deflated, scale-invariant tangent residual
    with the exact dense Jacobian (:mod:`tl_steering.critical.solver`). The starts run in rounds of
    ``batch_size``; with ``deflation`` every round deflates the distinct equilibria found by the rounds before it,
    so repeated solves find new points. ``method="riemannian"`` / ``"fixed_point"`` first run up to ``pre_iter``
    iterations of Riemannian gradient descent / the projected power iteration, then the same LM. Above the dense
    limit (``eigensolver`` resolving to "arpack", d > 1024 by default) the finish is Newton with GMRES on JVPs
    (no deflation). A start has converged when ||P_u F(u)|| / ||F(u)|| <= ``tol``; converged points closer than
    ``dedup_angle`` radians are one point (u and -u are distinct) and each distinct point is classified as
    :func:`classify_point` does.

    Args:
        field: F, a torch callable mapping ``[d]`` to ``[d]`` or ``[n, d]`` to ``[n, d]`` (detected); it receives
            ``dtype`` tensors on ``device`` and must be differentiable by torch autograd / torch.func.
        dim: d.
        n_starts: number of starts; rows of ``starts`` first, then seeded Gaussian directions.
        starts: optional ``[m, d]`` start directions (normalised here), e.g. token directions.
        seed: seed of the random starts.
        tol: convergence threshold on the relative residual.
        dedup_angle: two converged points closer than this angle (radians) are one.
        max_iter: LM iterations per start.
        method: "lm", "riemannian", "fixed_point", "flow" (power iteration of both signs + edge tracking between
            basins, :mod:`tl_steering.critical.dynamics`; 2 rows per start + ``edge_pairs`` rows) or "flow+lm"
            (flow, then LM from the same starts with the flow's points deflated; the most complete on small fields) or
            "reflected" (reflected flow, every hyperbolic equilibrium an attractor: no bias toward stability;
            ``max_iter`` is its step limit per row; :mod:`tl_steering.critical.reflected`) or "landscape" (the
            default: "flow", then the landscape phase) or "homotopy" (homotopy paths from every start through every
            crossing of t = 1, :mod:`tl_steering.critical.homotopy`: stability-agnostic, but a path's first crossing
            is the stable end of its branch (docs/critical_points.md section 10); 2 paths per start).
        deflation: deflate the points found by earlier rounds.
        resolve: solve the starts that failed under deflation once more without it (they then converge to an
            already known point or to a new one; ``options["converged_deflated"]`` counts the first kind of success).
        batch_size: starts per round (one vmapped Jacobian per iteration of a round).
        patience: a start stops when its merit has not halved over this many iterations.
        deflation_power, deflation_shift: p and σ of m(u) = prod_i (||u - u_i||^-p + σ).
        pre_iter: iterations of the first-order phase of "riemannian" / "fixed_point".
        eigensolver: "dense", "arpack" or "auto" (dense for d <= 1024); also picks the dense LM or GMRES-Newton.
        n_eigs: eigenvalues per end for ARPACK.
        dtype: compute dtype (float64; a tol of 1e-10 is out of reach in float32).
        device: device (default: that of ``starts``, else CPU).
        label_tol: labels use tol = label_tol · max|eig|.
        rot_ratio: an eigenvalue is rotational when |Im| > rot_ratio · |Re|.
        edge_pairs: "flow" / "flow+lm": pairs of basins whose boundary saddle is tracked (half per sign).
        landscape: "reflected": also run the solution-landscape searches next to every point found
            (:mod:`tl_steering.critical.reflected`; 4 rows per point).
        landscape_dirs, landscape_solves: "landscape": real tangent eigenvectors per side of zero per point (both
            signs each) and the most deflated Newton rows of the phase; starts that head to a known point run last
            (``options["landscape_deferred"]``, ``["landscape_deferred_run"]``; :func:`~.landscape.explained`).
        homotopy_steps, homotopy_roots, homotopy_kind: "homotopy": accepted steps per path, crossings of t = 1 after
            which a path stops, and "fixed_point" (h = t F̂ + (1-t) u0, for F and -F; the default) or "newton".

    Returns:
        An :class:`EquilibriaResult` (empty tensors when no start converged); ``options["start_status"]`` holds the
        per-start outcome counts and ``options["iterations"]`` the LM iterations per start.

    Raises:
        InputError: dim < 2, n_starts < 1, an unknown method/eigensolver, bad starts or tolerances, a field that
            returns the wrong shape or a non-finite value at a start.
    """
    t0 = time.perf_counter()
    dim = _check_dim(dim)
    if isinstance(n_starts, bool) or not isinstance(n_starts, (int, np.integer)) or n_starts < 1:
        raise InputError(f"n_starts must be an int >= 1; got {n_starts!r}")
    solver = _resolve_eigensolver(eigensolver, dim, n_eigs)
    if method is None:  # the default finder: flow + solution landscape where the dense end game exists
        method = "landscape" if solver == "dense" else "lm"
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; use one of {METHODS} (default: 'landscape' for d <= 1024, "
                         "'lm' above)")
    for name, value in (("tol", tol), ("dedup_angle", dedup_angle), ("label_tol", label_tol)):
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 < value < 1):
            raise InputError(f"{name} must be a float in (0, 1); got {value!r}")
    if not (isinstance(rot_ratio, (int, float)) and rot_ratio >= 0):
        raise InputError(f"rot_ratio must be a float >= 0; got {rot_ratio!r}")
    for name, value, low in (("max_iter", max_iter, 0), ("batch_size", batch_size, 1), ("patience", patience, 1),
                             ("pre_iter", pre_iter, 0), ("edge_pairs", edge_pairs, 0),
                             ("landscape_dirs", landscape_dirs, 1), ("landscape_solves", landscape_solves, 0),
                             ("homotopy_steps", homotopy_steps, 1), ("homotopy_roots", homotopy_roots, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise InputError(f"{name} must be an int >= {low}; got {value!r}")
    if not (deflation_power > 0 and deflation_shift >= 0):
        raise InputError("deflation_power must be > 0 and deflation_shift >= 0")
    if not dtype.is_floating_point:
        raise InputError(f"dtype must be a real floating dtype (float64 recommended); got {dtype}")
    if device is None:
        device = starts.device if isinstance(starts, Tensor) else torch.device("cpu")
    device = torch.device(device)

    u0, kinds = _prepare_starts(starts, dim, int(n_starts), seed, dtype, device)
    n_run = u0.shape[0]
    fld = _FieldAdapter(field, dim, dtype, device)
    fld.probe(u0[:2] if n_run >= 2 else torch.cat([u0, -u0]))
    with torch.no_grad():
        f0 = fld.many(u0)
    bad = ~torch.isfinite(f0).all(-1)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise InputError(f"the field returned NaN/Inf at {len(rows)} of {n_run} starts (rows {rows[:8]}); check the "
                         "field at unit-norm inputs (e.g. evaluate the model at ρ·u, not at u)")

    if method == "riemannian":
        u0 = _riemannian_descent(fld, u0, int(pre_iter), GAUSS_NEWTON_BELOW)
    elif method == "fixed_point":
        u0 = _fixed_point(fld, u0, int(pre_iter), GAUSS_NEWTON_BELOW)

    u = u0.clone()
    rel = torch.full((n_run,), math.inf, dtype=dtype, device=device)
    status = torch.full((n_run,), 3, dtype=torch.long)
    iters = torch.zeros(n_run, dtype=torch.long)
    known = torch.zeros(0, dim, dtype=dtype, device=device)
    flow_info: dict[str, Any] = {}
    flow_rows: tuple | None = None
    if method == "reflected":
        if solver != "dense":
            raise InputError(f"method='reflected' needs dense spectra (d <= {DENSE_MAX_DIM}); use method='lm' with "
                             "eigensolver='arpack' above that")
        u, rel, iters, status, kinds, flow_info = reflected_finder(fld, u0, kinds, tol, int(max_iter),
                                                                   bool(landscape), dedup_angle)
        n_run = u.shape[0]
    if method == "homotopy":
        if solver != "dense":
            raise InputError(f"method='homotopy' needs dense Jacobians (d <= {DENSE_MAX_DIM}); use method='lm' with "
                             "eigensolver='arpack' above that")
        if homotopy_kind not in ("newton", "fixed_point"):
            raise InputError(f"homotopy_kind must be 'newton' or 'fixed_point'; got {homotopy_kind!r}")
        u, rel, iters, status, kinds, flow_info = homotopy_finder(fld, u0, kinds, tol, int(homotopy_steps),
                                                                  int(homotopy_roots), homotopy_kind)
        n_run = u.shape[0]
    if method in ("flow", "flow+lm", "landscape"):
        if solver != "dense":
            raise InputError(f"method={method!r} needs the dense end game (d <= {DENSE_MAX_DIM}); use method='lm' "
                             "with eigensolver='arpack' above that")
        uf, relf, itf, stf, kindf, flow_info = _flow(fld, u0, kinds, tol, int(max_iter), int(patience),
                                                     int(pre_iter), int(edge_pairs), dedup_angle)
        if method in ("flow", "landscape"):
            u, rel, iters, status, kinds = uf, relf, itf, stf, kindf
            n_run = u.shape[0]
        else:  # then LM from the same starts with every point of the flow deflated: it looks for other points
            flow_rows = (uf, relf, itf, stf, kindf)
            known = _add_distinct(known, uf[stf.to(uf.device) == 0], dedup_angle)
            kinds = [f"{k}/lm" for k in kinds]
    for lo in range(0, n_run if method not in ("flow", "reflected", "landscape", "homotopy") else 0, int(batch_size)):
        sl = slice(lo, min(n_run, lo + int(batch_size)))
        if solver == "dense":
            ub, rb, ib, sb = lm_solve(fld, u0[sl], known if deflation else known[:0], tol, int(max_iter),
                                      patience=int(patience), power=float(deflation_power),
                                      shift=float(deflation_shift))
        else:
            ub = torch.stack([_newton(fld, x, int(max_iter), tol, solver) for x in u0[sl]])
            with torch.no_grad():
                rb = relative_residual(ub, fld.many(ub))
            ib = torch.full((ub.shape[0],), int(max_iter), dtype=torch.long)
            sb = torch.where(rb <= tol, 0, 3)
        u[sl], rel[sl], iters[sl], status[sl] = ub.detach(), rb, ib.cpu(), sb.cpu()
        known = _add_distinct(known, ub[sb.to(ub.device) == 0].detach(), dedup_angle)
    n_deflated = int((status == 0).sum())
    failed = (status != 0).nonzero().flatten()
    if method not in ("flow", "reflected", "landscape", "homotopy") and deflation and resolve and solver == "dense" and known.shape[0] and failed.numel():
        # a deflated start that stalls has usually only known roots nearby: solve it again without deflation, so
        # that the converged count measures the solver, not how many roots were left to find
        ub, rb, ib, sb = lm_solve(fld, u0[failed.to(device)], known[:0], tol, int(max_iter),
                                  patience=int(patience))
        ok = sb.cpu() == 0
        hit = failed[ok]
        u[hit.to(device)], rel[hit.to(device)], status[hit] = ub[ok.to(device)].detach(), rb[ok.to(device)], 0
        iters[failed] += ib.cpu()
    if flow_rows is not None:  # flow rows first, then the LM rows
        uf, relf, itf, stf, kindf = flow_rows
        u, rel = torch.cat([uf.to(u.dtype), u]), torch.cat([relf, rel])
        iters, status, kinds = torch.cat([itf, iters]), torch.cat([stf, status]), kindf + kinds
        n_run = u.shape[0]
    if method == "landscape" and int(landscape_solves) > 0:
        clock = time.perf_counter()
        seeds = _add_distinct(u[:0], u[(status == 0).to(u.device)].detach(), dedup_angle)
        if seeds.shape[0]:
            ul, rl, il, sl, kl, linfo = landscape_phase(fld, seeds, tol, int(max_iter), dedup_angle,
                                                        dirs=int(landscape_dirs), max_solves=int(landscape_solves),
                                                        patience=int(patience))
            u, rel = torch.cat([u.detach(), ul.detach().to(u.dtype)]), torch.cat([rel, rl.to(rel.dtype)])
            iters, status, kinds = torch.cat([iters, il]), torch.cat([status, sl]), list(kinds) + kl
            n_run = u.shape[0]
            flow_info.update(linfo)
        flow_info.setdefault("phase_seconds", {})["landscape"] = time.perf_counter() - clock
    converged = (status == 0).nonzero().flatten().tolist()

    # deduplicate in start order; the representative is the first start that reached the point
    reps: list[int] = []
    hits: list[int] = []
    row_rep = [-1] * u.shape[0]
    for i in converged:
        j = _match_point(u[reps], u[i], dedup_angle)
        if j >= 0:
            hits[j] += 1
            row_rep[i] = j
            continue
        row_rep[i] = len(reps)
        reps.append(i)
        hits.append(1)

    clock = time.perf_counter()
    spectra: list[_Spectrum] = []
    lams: list[float] = []
    ress: list[float] = []
    jacs = fld.jacobians(u[reps].detach()) if solver == "dense" and reps else [None] * len(reps)
    for r, jac in zip(reps, jacs):
        spec, lam, rr = _classify(fld, u[r].detach(), solver, n_eigs, label_tol, rot_ratio, jac)
        spectra.append(spec)
        lams.append(lam)
        ress.append(rr)
    order = sorted(range(len(reps)), key=lambda k: -lams[k])  # stable: ties keep start order
    rank = {k: pos for pos, k in enumerate(order)}
    if "phase_seconds" in flow_info:
        flow_info["phase_seconds"]["classify"] = time.perf_counter() - clock

    k_eigs = dim - 1 if solver == "dense" else 2 * n_eigs
    n = len(reps)
    f64 = torch.float64
    points = u[[reps[k] for k in order]].detach().cpu().to(f64) if n else torch.zeros(0, dim, dtype=f64)
    eig = (torch.stack([spectra[k].eigenvalues for k in order]) if n
           else torch.zeros(0, k_eigs, dtype=torch.complex128))
    outcome = {name: int((status == code).sum()) for code, name in enumerate(STATUS)}
    options = {"n_starts": int(n_starts), "given_starts": kinds.count("given"), "seed": int(seed), "tol": tol,
               "dedup_angle": dedup_angle, "max_iter": int(max_iter), "method": method, "deflation": bool(deflation),
               "batch_size": int(batch_size), "patience": int(patience), "deflation_power": float(deflation_power),
               "deflation_shift": float(deflation_shift), "pre_iter": int(pre_iter), "eigensolver": eigensolver,
               "n_eigs": int(n_eigs), "dtype": str(dtype), "device": str(device), "label_tol": label_tol,
               "rot_ratio": rot_ratio, "field_mode": fld.mode, "dense_max_dim": DENSE_MAX_DIM,
               "start_status": outcome, "converged_deflated": n_deflated, "resolve": bool(resolve), "iterations": iters.tolist(),
               "start_residuals": [float(x) for x in rel.cpu()],
               "edge_pairs": int(edge_pairs), "landscape": bool(landscape), "landscape_dirs": int(landscape_dirs),
               "landscape_solves": int(landscape_solves), "homotopy_steps": int(homotopy_steps),
               "homotopy_roots": int(homotopy_roots), "homotopy_kind": homotopy_kind,
               "row_kind": list(kinds), "row_point": [rank[j] if j >= 0 else -1 for j in row_rep], **flow_info}
    return EquilibriaResult(
        provenance=Provenance(seed=int(seed), dtype=str(dtype).removeprefix("torch."), device=str(device),
                              extra={"protocol": "equilibria", **{k: v for k, v in options.items()
                                                                  if k not in ("iterations", "start_residuals", "row_kind", "row_point")}}),
        points=points,
        lambdas=torch.tensor([lams[k] for k in order], dtype=f64),
        residuals=torch.tensor([ress[k] for k in order], dtype=f64),
        eigenvalues=eig.cpu(),
        labels=[spectra[k].label for k in order],
        rotational=[spectra[k].rotational for k in order],
        index=[spectra[k].index for k in order],
        spectral_abscissa=torch.tensor([spectra[k].spectral_abscissa for k in order], dtype=f64),
        near_zero=[spectra[k].near_zero for k in order],
        max_im_re=torch.tensor([spectra[k].max_im_re for k in order], dtype=f64),
        rotational_fraction=torch.tensor([spectra[k].rotational_fraction for k in order], dtype=f64),
        hits=[hits[k] for k in order],
        start_index=[reps[k] for k in order],
        start_kind=[kinds[reps[k]] for k in order],
        dim=dim,
        n_starts=n_run,
        n_converged=len(converged),
        method=method,
        eigensolver=solver,
        seconds=time.perf_counter() - t0,
        options=options,
    )


def classify_point(
    field: Field,
    u: Float[Tensor, " d_model"],
    eigensolver: Eigensolver = "auto",
    n_eigs: int = 6,
    label_tol: float = 1e-6,
    rot_ratio: float = 0.1,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> PointClassification:
    """Tangent spectrum and label of the field at one point u (normalised here), see docs/critical_points.md.

    M = Qᵀ DF(u) Q - λ I_{d-1} with λ = <u, F(u)> and Q an orthonormal basis of u^⊥. The label is meaningful only
    at an equilibrium: check ``residual`` (this function does not refine u; use :func:`find_equilibria` with
    ``starts=u`` for that). Labels with tol = label_tol · max|eig|: attractor (max Re < -tol), repeller
    (min Re > tol), saddle (max Re > tol and min Re < -tol), degenerate otherwise.

    Args:
        field: F, as for :func:`find_equilibria`.
        u: the point, ``[d]``.
        eigensolver: "dense" (all d-1 eigenvalues), "arpack" (n_eigs of largest and n_eigs of smallest real part,
            from JVPs only) or "auto" (dense for d <= 1024).
        n_eigs: eigenvalues per end for ARPACK.
        label_tol: relative tolerance of the labels.
        rot_ratio: an eigenvalue is rotational when |Im| > rot_ratio · |Re|.
        dtype: compute dtype.
        device: compute device (default: that of u).
    """
    t0 = time.perf_counter()
    if not isinstance(u, Tensor):
        u = torch.as_tensor(np.asarray(u))
    if u.ndim != 1:
        raise InputError(f"u must be a single [d] vector; got shape {list(u.shape)} (loop over rows, or use "
                         "find_equilibria for many points)")
    dim = _check_dim(u.shape[0])
    solver = _resolve_eigensolver(eigensolver, dim, n_eigs)
    device = torch.device(device) if device is not None else u.device
    u = u.detach().to(device=device, dtype=dtype)
    norm = float(u.norm())
    if not math.isfinite(norm) or norm <= 0:
        raise InputError("u must be a finite non-zero vector")
    u = u / norm
    fld = _FieldAdapter(field, dim, dtype, device)
    fld.probe(torch.stack([u, -u]))
    with torch.no_grad():
        f = fld.one(u)
    if not bool(torch.isfinite(f).all()):
        raise InputError("the field returned NaN/Inf at u; check the field at unit-norm inputs")
    spec, lam, res = _classify(fld, u, solver, n_eigs, label_tol, rot_ratio)
    return PointClassification(
        provenance=Provenance(dtype=str(dtype).removeprefix("torch."), device=str(device),
                              extra={"protocol": "classify_point", "eigensolver": solver, "n_eigs": n_eigs,
                                     "label_tol": label_tol, "rot_ratio": rot_ratio,
                                     "seconds": time.perf_counter() - t0}),
        point=u.detach().cpu().to(torch.float64), lam=lam, residual=res, eigenvalues=spec.eigenvalues.cpu(),
        label=spec.label, rotational=spec.rotational, index=spec.index,
        spectral_abscissa=spec.spectral_abscissa, near_zero=spec.near_zero, max_im_re=spec.max_im_re,
        rotational_fraction=spec.rotational_fraction, eigensolver=solver,
    )


__all__ = ["METHODS", "STATUS", "classify_point", "find_equilibria"]
