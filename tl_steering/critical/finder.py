"""Public finder and classifier for any field on the sphere (see docs/critical_points.md).

Pure tensor math: it knows nothing of TransformerLens; :func:`tl_steering.critical_points` builds the model's field
and hands it here. There is one finder (:data:`~tl_steering.critical.options.DEFAULT_FINDER`): the flow phase of
:mod:`tl_steering.critical.dynamics` (power iteration of F and -F, edge tracking between basins, Levenberg-Marquardt
end game), then the solution-landscape phase of :mod:`tl_steering.critical.landscape`."""

import math
import time
from typing import Any, Literal

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from ..errors import InputError
from ..geometry import EPS_NORM, _normalize
from ..results import Provenance
from .dynamics import _flow
from .fields import Field, _add_distinct, _FieldAdapter, _match_point
from .landscape import landscape_phase
from .options import DEDUP_ANGLE, DEFAULT_FINDER, DEFAULT_N_STARTS, FinderOptions, finder_options
from .results import EquilibriaResult, PointClassification
from .solver import lm_solve
from .spectrum import _classify, _resolve_eigensolver, _Spectrum

Eigensolver = Literal["auto", "dense", "arpack"]
#: outcome of a row, by status code of :func:`tl_steering.critical.solver.lm_solve`
STATUS = ("converged", "stalled", "no_decrease", "iteration_limit")
#: per-row options that the provenance leaves out (they stay in ``options``)
ROW_KEYS = ("iterations", "start_residuals", "row_kind", "row_point")


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
    return torch.cat([given, _normalize(rand, EPS_NORM)]), ["given"] * given.shape[0] + ["random"] * n_random


def _adapter(field: Field, u0: Tensor, dim: int) -> _FieldAdapter:
    """The field adapter, probed on the starts and checked finite at every one."""
    fld = _FieldAdapter(field, dim, u0.dtype, u0.device)
    fld.probe(u0[:2] if u0.shape[0] >= 2 else torch.cat([u0, -u0]))
    with torch.no_grad():
        f0 = fld.many(u0)
    bad = ~torch.isfinite(f0).all(-1)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise InputError(f"the field returned NaN/Inf at {len(rows)} of {u0.shape[0]} starts (rows {rows[:8]}); "
                         "check the field at unit-norm inputs (e.g. evaluate the model at ρ·u, not at u)")
    return fld


def _setup(dim: Any, n_starts: Any, eigensolver: str, opts: FinderOptions, dtype: torch.dtype,
           device: Any, starts: Any) -> tuple[int, str, torch.device]:
    dim = _check_dim(dim)
    if isinstance(n_starts, bool) or not isinstance(n_starts, (int, np.integer)) or n_starts < 1:
        raise InputError(f"n_starts must be an int >= 1; got {n_starts!r}")
    solver = _resolve_eigensolver(eigensolver, dim, opts.n_eigs)
    if not dtype.is_floating_point:
        raise InputError(f"dtype must be a real floating dtype (float64 recommended); got {dtype}")
    if device is None:
        device = starts.device if isinstance(starts, Tensor) else torch.device("cpu")
    return dim, solver, torch.device(device)


def find_equilibria(field: Field, dim: int, n_starts: int = DEFAULT_N_STARTS,
                    starts: Float[Tensor, "m d_model"] | None = None, seed: int = 0,
                    options: FinderOptions | dict[str, Any] | None = None, eigensolver: Eigensolver = "auto",
                    dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> EquilibriaResult:
    """Find and classify the equilibria u* ∈ S^{d-1} of a field, F(u*) = λ u* (docs/critical_points.md).

    The one finder (:data:`~tl_steering.critical.options.DEFAULT_FINDER`, docs/critical_points.md "The one way in",
    sections 2, 6.2 and 9): the flow phase (power iteration of ±F, edge tracking, LM end game), then the
    solution-landscape phase (skipped with ARPACK spectra); converged points within ``DEDUP_ANGLE`` are one point,
    each classified as :func:`classify_point` does.

    Args:
        field: F, a torch callable mapping ``[d]`` to ``[d]`` or ``[n, d]`` to ``[n, d]`` (detected); it receives
            ``dtype`` tensors on ``device`` and must be differentiable by torch autograd / torch.func.
        dim: d.
        n_starts: number of starts; rows of ``starts`` first, then seeded Gaussian directions.
        starts: optional ``[m, d]`` start directions (normalised here), e.g. token directions.
        seed: seed of the random starts.
        options: :class:`~tl_steering.critical.options.FinderOptions` (or a dict of some of its fields; None:
            :data:`~tl_steering.critical.options.DEFAULT_OPTIONS`).
        eigensolver: "dense", "arpack" or "auto" (dense for d <= 1024) for the tangent spectra.
        dtype: compute dtype (float64; a tol of 1e-10 is out of reach in float32).
        device: device (default: that of ``starts``, else CPU).

    Returns:
        An :class:`EquilibriaResult` (empty tensors when no row converged); ``options["start_status"]`` holds the
        per-row outcome counts, ``options["row_kind"]`` / ``["row_point"]`` each row's phase and point.

    Raises:
        InputError: dim < 2, n_starts < 1, unknown options or eigensolver, bad starts or tolerances, a field that
            returns the wrong shape or a non-finite value at a start."""
    t0 = time.perf_counter()
    opts = finder_options(options)
    dim, solver, device = _setup(dim, n_starts, eigensolver, opts, dtype, device, starts)
    u0, kinds = _prepare_starts(starts, dim, int(n_starts), seed, dtype, device)
    fld = _adapter(field, u0, dim)
    n_given = kinds.count("given")
    u, rel, iters, status, kinds, info = _flow(fld, u0, kinds, opts)
    if solver == "dense" and opts.landscape_solves > 0:
        clock = time.perf_counter()
        seeds = _add_distinct(u[:0], u[(status == 0).to(u.device)].detach(), DEDUP_ANGLE)
        if seeds.shape[0]:
            ul, rl, il, sl, kl, linfo = landscape_phase(fld, seeds, opts)
            u, rel = torch.cat([u.detach(), ul.detach().to(u.dtype)]), torch.cat([rel, rl.to(rel.dtype)])
            iters, status, kinds = torch.cat([iters, il]), torch.cat([status, sl]), list(kinds) + kl
            info.update(linfo)
        info["phase_seconds"]["landscape"] = time.perf_counter() - clock
    info["jacobians"] = fld.n_jacobians
    run = {"n_starts": int(n_starts), "given_starts": n_given, "seed": int(seed), "method": DEFAULT_FINDER,
           "eigensolver": eigensolver, "dtype": str(dtype), "device": str(device), **opts.as_dict()}
    return _result(fld, u.detach(), rel, iters, status, kinds, {**run, **info}, solver, opts, t0)


def _dedup(u: Tensor, status: Tensor) -> tuple[list[int], list[int], list[int]]:
    """Distinct converged rows in row order: (representative row per point, hits per point, point per row or -1);
    the representative is the first row that reached the point."""
    reps: list[int] = []
    hits: list[int] = []
    row_rep = [-1] * u.shape[0]
    for i in (status == 0).nonzero().flatten().tolist():
        j = _match_point(u[reps], u[i], DEDUP_ANGLE)
        if j < 0:
            j = len(reps)
            reps.append(i)
            hits.append(0)
        hits[j] += 1
        row_rep[i] = j
    return reps, hits, row_rep


def _result(fld: _FieldAdapter, u: Tensor, rel: Tensor, iters: Tensor, status: Tensor, kinds: list[str],
            options: dict[str, Any], solver: str, opts: FinderOptions, t0: float) -> EquilibriaResult:
    """Deduplicate the converged rows, classify each distinct point, and build the result (sorted by λ)."""
    reps, hits, row_rep = _dedup(u, status)
    clock = time.perf_counter()
    if solver == "dense" and reps:
        fld.point_jacobians(u[reps])  # the ones the landscape has not computed, in one batch
    classified = [_classify(fld, u[r], solver, opts.n_eigs) for r in reps]
    spectra: list[_Spectrum] = [c[0] for c in classified]
    lams = [c[1] for c in classified]
    order = sorted(range(len(reps)), key=lambda k: -lams[k])  # stable: ties keep row order
    rank = {k: pos for pos, k in enumerate(order)}
    options.setdefault("phase_seconds", {})["classify"] = time.perf_counter() - clock
    dim, f64, n = fld.dim, torch.float64, len(reps)
    k_eigs = dim - 1 if solver == "dense" else 2 * opts.n_eigs
    options.update(field_mode=fld.mode, start_status={name: int((status == code).sum()) for code, name in
                                                      enumerate(STATUS)},
                   iterations=iters.tolist(), start_residuals=[float(x) for x in rel.cpu()], row_kind=list(kinds),
                   row_point=[rank[j] if j >= 0 else -1 for j in row_rep])
    spec = [spectra[k] for k in order]
    return EquilibriaResult(
        provenance=Provenance(seed=int(options.get("seed", 0)), dtype=str(u.dtype).removeprefix("torch."),
                              device=str(u.device), extra={"protocol": "equilibria", **{
                                  k: v for k, v in options.items() if k not in ROW_KEYS}}),
        points=u[[reps[k] for k in order]].cpu().to(f64) if n else torch.zeros(0, dim, dtype=f64),
        lambdas=torch.tensor([lams[k] for k in order], dtype=f64),
        residuals=torch.tensor([classified[k][2] for k in order], dtype=f64),
        eigenvalues=(torch.stack([s.eigenvalues for s in spec]) if n
                     else torch.zeros(0, k_eigs, dtype=torch.complex128)).cpu(),
        labels=[s.label for s in spec], rotational=[s.rotational for s in spec], index=[s.index for s in spec],
        spectral_abscissa=torch.tensor([s.spectral_abscissa for s in spec], dtype=f64),
        near_zero=[s.near_zero for s in spec],
        max_im_re=torch.tensor([s.max_im_re for s in spec], dtype=f64),
        rotational_fraction=torch.tensor([s.rotational_fraction for s in spec], dtype=f64),
        hits=[hits[k] for k in order], start_index=[reps[k] for k in order],
        start_kind=[kinds[reps[k]] for k in order], dim=dim, n_starts=u.shape[0], n_converged=int((status == 0).sum()),
        method=str(options["method"]), eigensolver=solver, seconds=time.perf_counter() - t0, options=options)


def polish_points(field: Field, points: Float[Tensor, "m d_model"], options: FinderOptions | dict | None = None,
                  eigensolver: Eigensolver = "auto", dtype: torch.dtype = torch.float64) -> EquilibriaResult:
    """The finder's end game alone: Levenberg-Marquardt from each row of ``points`` (no power, edge or landscape
    phase), then the same deduplication and classification; ``method`` "polish". Used to follow known equilibria
    to a changed field (the radius sensitivity of :func:`tl_steering.critical_points`)."""
    t0 = time.perf_counter()
    opts = finder_options(options)
    dim, solver, device = _setup(points.shape[-1], max(1, points.shape[0]), eigensolver, opts, dtype, None, points)
    u0, kinds = _prepare_starts(points, dim, points.shape[0], 0, dtype, device)
    fld = _adapter(field, u0, dim)
    u, rel, iters, status = lm_solve(fld, u0, opts.tol, opts.max_iter)
    run = {"n_starts": int(u0.shape[0]), "given_starts": int(u0.shape[0]), "seed": 0, "method": "polish",
           "eigensolver": eigensolver, "dtype": str(dtype), "device": str(device), **opts.as_dict()}
    return _result(fld, u.detach(), rel, iters.cpu(), status.cpu(), kinds, run, solver, opts, t0)


def classify_point(field: Field, u: Float[Tensor, " d_model"], eigensolver: Eigensolver = "auto", n_eigs: int = 6,
                   dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> PointClassification:
    """Tangent spectrum and label of the field at one point u (normalised here), see docs/critical_points.md.

    M = Qᵀ DF(u) Q - λ I_{d-1} with λ = <u, F(u)> and Q an orthonormal basis of u^⊥. The label is meaningful only
    at an equilibrium: check ``residual`` (this function does not refine u; :func:`polish_points` does). Labels with tol = ``LABEL_TOL`` · max|eig|: attractor (max Re < -tol), repeller
    (min Re > tol), saddle (max Re > tol and min Re < -tol), degenerate otherwise.

    Args:
        field: F, as for :func:`find_equilibria`.
        u: the point, ``[d]``.
        eigensolver: "dense" (all d-1 eigenvalues), "arpack" (n_eigs of largest and n_eigs of smallest real part,
            from JVPs only) or "auto" (dense for d <= 1024).
        n_eigs: eigenvalues per end for ARPACK.
        dtype: compute dtype.
        device: compute device (default: that of u)."""
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
    spec, lam, res = _classify(fld, u, solver, n_eigs)
    return PointClassification(
        provenance=Provenance(dtype=str(dtype).removeprefix("torch."), device=str(device),
                              extra={"protocol": "classify_point", "eigensolver": solver, "n_eigs": n_eigs,
                                     "seconds": time.perf_counter() - t0}),
        point=u.detach().cpu().to(torch.float64), lam=lam, residual=res, eigenvalues=spec.eigenvalues.cpu(),
        label=spec.label, rotational=spec.rotational, index=spec.index,
        spectral_abscissa=spec.spectral_abscissa, near_zero=spec.near_zero, max_im_re=spec.max_im_re,
        rotational_fraction=spec.rotational_fraction, eigensolver=solver)


__all__ = ["STATUS", "classify_point", "find_equilibria", "polish_points"]
