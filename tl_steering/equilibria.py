"""Critical points of a field on the sphere: nonlinear projective equilibria and their tangent spectra.

MATH_SPEC §9. For a field F: R^d -> R^d (any torch callable), an equilibrium is a unit vector u* with

    P_{u*} F(u*) = 0,   i.e.   F(u*) = λ u*,   λ = <u*, F(u*)>,

where P_u v = v - <u, v> u is the tangent projector. Both signs of λ count, and ±u* are separate points because F
need not be odd. Near u* the projected flow du/dt = P_u F(u) is linearised by the tangent Jacobian

    J_T = P_{u*} DF(u*) P_{u*} - λ P_{u*},

written in an orthonormal tangent basis Q (d × (d-1)) as M = Qᵀ DF(u*) Q - λ I_{d-1}. Its spectrum classifies u*.

This module is pure tensor math: it knows nothing of TransformerLens. The TL adapter builds the field
(e.g. u ↦ MLP(LN2(ρ u))) and hands it here.

The field may accept a batch ``[n, d]`` or a single vector ``[d]``; the finder probes which and uses, in this order,
the batched call, ``torch.func.vmap`` of the single call, or a Python loop. It must be differentiable by torch
autograd (gradient descent) and, for the fast Jacobian paths, by forward-mode AD (``torch.func.jacfwd`` /
``torch.func.linearize``); if forward mode fails the finder falls back to reverse-mode
``torch.autograd.functional`` (slower, same numbers).
"""

import dataclasses
import inspect
import math
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from jaxtyping import Complex, Float
from torch import Tensor

from .errors import InputError
from .results import Provenance, Result, register

Field = Callable[[Tensor], Tensor]
Method = Literal["riemannian", "fixed_point"]
Eigensolver = Literal["auto", "dense", "arpack"]

#: In ``eigensolver="auto"`` the dense Jacobian is used up to this dimension, ARPACK above it.
DENSE_MAX_DIM = 1024
#: Gradient descent (or the fixed-point iteration) hands over to Newton below this relative residual.
NEWTON_SWITCH = 1e-3
#: Points whose relative residual is still above this after the first phase are not given Newton steps.
NEWTON_MAX_START = 5e-2
LABELS = ("attractor", "repeller", "saddle", "degenerate")

_EPS = 1e-300  # guards 0/0 only; the residual of a point where ||F|| underflows is reported as inf


# ----------------------------------------------------------------------------------------------------------
# small geometry helpers (pure tensor functions)


def tangent_part(u: Float[Tensor, "*batch d"], v: Float[Tensor, "*batch d"]) -> Float[Tensor, "*batch d"]:
    """P_u v = v - <u, v> u for unit u (MATH_SPEC §2)."""
    return v - (u * v).sum(-1, keepdim=True) * u


def relative_residual(u: Float[Tensor, "*batch d"], f: Float[Tensor, "*batch d"]) -> Float[Tensor, " *batch"]:
    """||P_u F(u)|| / ||F(u)||: the sine of the angle between u and F(u); 0 exactly at an equilibrium."""
    fn = f.norm(dim=-1)
    res = tangent_part(u, f).norm(dim=-1) / fn.clamp_min(_EPS)
    return torch.where(torch.isfinite(res) & (fn > 0), res, torch.full_like(res, math.inf))


def _normalize(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


class _Householder:
    """The reflector H = I - β w wᵀ with H u = ∓e_1; its columns 2..d are an orthonormal basis Q of u^⊥.

    This Q is the one a QR of [u, I] gives up to an orthogonal change of basis of the tangent space (the spectrum
    of M = Qᵀ DF Q - λ I does not depend on that choice), and it is applied in O(d) without forming a d × d matrix,
    which the matrix-free (ARPACK / GMRES) paths need.
    """

    def __init__(self, u: Tensor) -> None:
        w = u.clone()
        w[0] = w[0] + (1.0 if float(u[0]) >= 0 else -1.0)
        self.w = w
        self.beta = 2.0 / float(w @ w)

    def apply(self, x: Tensor) -> Tensor:
        return x - self.beta * (self.w @ x) * self.w

    def q(self, s: Tensor) -> Tensor:
        """Q s: tangent coordinates (d-1) -> tangent vector (d)."""
        return self.apply(torch.cat([s.new_zeros(1), s]))

    def qt(self, v: Tensor) -> Tensor:
        """Qᵀ v: vector (d) -> tangent coordinates (d-1)."""
        return self.apply(v)[1:]

    def conjugate(self, a: Tensor) -> Tensor:
        """H A H for a d × d matrix A, in O(d²)."""
        w, b = self.w, self.beta
        aw = a @ w
        wa = w @ a
        waw = w @ aw
        return a - b * torch.outer(w, wa) - b * torch.outer(aw, w) + (b * b * waw) * torch.outer(w, w)


def tangent_basis(u: Float[Tensor, " d"]) -> Float[Tensor, "d d_minus_1"]:
    """An orthonormal basis of the tangent space at unit u, as columns (the last d-1 columns of a Householder
    reflector that maps u to ∓e_1)."""
    h = _Householder(_normalize(u))
    eye = torch.eye(u.shape[0], dtype=u.dtype, device=u.device)
    return (eye - h.beta * torch.outer(h.w, h.w))[:, 1:]


# ----------------------------------------------------------------------------------------------------------
# the field, made callable on one point and on a batch


class _FieldAdapter:
    """Wraps the user's callable so that ``one([d])``, ``many([n, d])``, ``jacobian(u)`` and ``linearize(u)`` all
    work, whichever calling convention the callable follows."""

    def __init__(self, field: Field, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        if not callable(field):
            raise InputError(f"field must be a callable mapping a [d] or [n, d] tensor to the same shape; got a "
                             f"{type(field).__name__}")
        self.field = field
        self.dim = dim
        self.dtype = dtype
        self.device = device
        self.mode: Literal["batched", "vmap", "loop"] = "loop"
        self._jac_mode: Literal["forward", "reverse"] | None = None
        self._jvp_mode: Literal["forward", "reverse"] | None = None

    # -- probing -------------------------------------------------------------------------------------------
    def _check(self, out: Any, shape: tuple[int, ...], what: str) -> Tensor:
        if not isinstance(out, Tensor):
            raise InputError(f"field returned a {type(out).__name__} for {what}; it must return a torch tensor of "
                             f"shape {list(shape)}")
        if tuple(out.shape) != shape:
            raise InputError(f"field returned shape {list(out.shape)} for {what}; it must map a [d] vector to [d] "
                             f"(or an [n, d] batch to [n, d]) with d = {self.dim}. Reshape the output inside the "
                             "callable, e.g. `lambda u: mlp(u[None])[0]`.")
        return out.to(self.dtype)

    def probe(self, u: Tensor) -> None:
        """Decide the calling convention from two probe points (rows of ``u``, shape [2, d])."""
        d = self.dim
        single: list[Tensor] | None = None
        single_err: Exception | None = None
        try:
            single = [self._check(self.field(u[i]), (d,), "a [d] input") for i in range(u.shape[0])]
        except InputError as exc:
            single_err = exc
        except Exception as exc:  # noqa: BLE001 - the user's callable may raise anything
            single_err = exc
        batched: Tensor | None = None
        batched_err: Exception | None = None
        try:
            batched = self._check(self.field(u), tuple(u.shape), "an [n, d] input")
        except Exception as exc:  # noqa: BLE001
            batched_err = exc
        if single is None and batched is None:
            if isinstance(single_err, InputError):
                raise single_err
            raise InputError(f"calling the field on a float64 [{d}] vector failed ({single_err!r}) and on an "
                             f"[n, {d}] batch too ({batched_err!r}); the field must accept float64 tensors on "
                             f"{self.device} (cast inside the callable if the model runs in another dtype)"
                             ) from single_err
        if batched is not None and single is not None:
            if _agree(batched, torch.stack(single)):
                self.mode = "batched"
                return
        elif batched is not None:
            self.mode = "batched"
            return
        # single works; the batched call failed or mixed rows: try vmap, else loop
        assert single is not None
        try:
            vm = torch.func.vmap(self.field)(u)
            if isinstance(vm, Tensor) and tuple(vm.shape) == tuple(u.shape) and _agree(vm.to(self.dtype),
                                                                                          torch.stack(single)):
                self.mode = "vmap"
                return
        except Exception:  # noqa: BLE001 - not vmappable (e.g. .item(), numpy inside)
            pass
        self.mode = "loop"

    # -- evaluation ----------------------------------------------------------------------------------------
    def one(self, u: Tensor) -> Tensor:
        if self.mode == "batched":
            return self.field(u[None])[0].to(self.dtype)
        return self.field(u).to(self.dtype)

    def many(self, u: Tensor) -> Tensor:
        if u.shape[0] == 0:
            return u.clone()
        if self.mode == "batched":
            return self.field(u).to(self.dtype)
        if self.mode == "vmap":
            return torch.func.vmap(self.field)(u).to(self.dtype)
        return torch.stack([self.field(x) for x in u]).to(self.dtype)

    def jacobian(self, u: Tensor) -> Tensor:
        """DF(u), d × d (row i = output i)."""
        if self._jac_mode in (None, "forward"):
            try:
                jac = torch.func.jacfwd(self.one)(u)
                self._jac_mode = "forward"
                return jac.to(self.dtype)
            except Exception:  # noqa: BLE001 - forward AD or vmap unsupported by the field
                if self._jac_mode == "forward":
                    raise
                self._jac_mode = "reverse"
        return torch.autograd.functional.jacobian(self.one, u, vectorize=False).to(self.dtype)

    def linearize(self, u: Tensor) -> Callable[[Tensor], Tensor]:
        """v ↦ DF(u) v, reusing the linearisation across calls (for ARPACK / GMRES)."""
        if self._jvp_mode in (None, "forward"):
            try:
                with warnings.catch_warnings():  # torch.fx const-folding chatter, harmless
                    warnings.simplefilter("ignore", UserWarning)
                    _, jvp_fn = torch.func.linearize(self.one, u)
                    jvp_fn(torch.zeros_like(u))
                self._jvp_mode = "forward"
                return lambda v: jvp_fn(v).to(self.dtype)
            except Exception:  # noqa: BLE001
                if self._jvp_mode == "forward":
                    raise
                self._jvp_mode = "reverse"
        return lambda v: torch.autograd.functional.jvp(self.one, u, v)[1].to(self.dtype)


def _agree(a: Tensor, b: Tensor) -> bool:
    scale = float(b.abs().max()) if b.numel() else 0.0
    return bool(torch.isfinite(a).all()) and bool(torch.allclose(a, b, rtol=1e-9, atol=1e-12 * (1.0 + scale)))


# ----------------------------------------------------------------------------------------------------------
# spectrum and labels


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


def _label_spectrum(eigs: Tensor, label_tol: float, rot_ratio: float) -> _Spectrum:
    """Labels of MATH_SPEC §9 with tol = label_tol · max|eig|.

    attractor: max Re < -tol; repeller: min Re > tol; saddle: max Re > tol and min Re < -tol; ``degenerate``
    (non-hyperbolic, our addition) otherwise, i.e. when near-zero modes leave the sign pattern undecided.
    An eigenvalue is rotational when |Im| > max(rot_ratio·|Re|, tol).
    """
    eigs = eigs.to(torch.complex128)
    order = torch.argsort(eigs.real, descending=True, stable=True)
    eigs = eigs[order]
    finite = torch.isfinite(eigs.real) & torch.isfinite(eigs.imag)
    e = eigs[finite]
    if e.numel() == 0:
        return _Spectrum(eigs, "degenerate", False, 0, math.nan, 0, math.nan, math.nan)
    re, im = e.real, e.imag
    tol = label_tol * float(e.abs().max())
    max_re, min_re = float(re.max()), float(re.min())
    if max_re < -tol:
        label = "attractor"
    elif min_re > tol:
        label = "repeller"
    elif max_re > tol and min_re < -tol:
        label = "saddle"
    else:
        label = "degenerate"
    rot = im.abs() > torch.clamp(rot_ratio * re.abs(), min=tol)
    ratio = torch.where(im.abs() > tol, im.abs() / re.abs(), torch.zeros_like(re))
    return _Spectrum(
        eigenvalues=eigs,
        label=label,
        rotational=bool(rot.any()),
        index=int((re > tol).sum()),
        spectral_abscissa=max_re,
        near_zero=int((re.abs() <= tol).sum()),
        max_im_re=float(ratio.max()),
        rotational_fraction=float(rot.double().mean()),
    )


def _tangent_matrix(fld: _FieldAdapter, u: Tensor, lam: float) -> Tensor:
    """M = Qᵀ DF(u) Q - λ I (dense, (d-1) × (d-1))."""
    h = _Householder(u)
    m = h.conjugate(fld.jacobian(u))[1:, 1:]
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


def _classify(fld: _FieldAdapter, u: Tensor, solver: str, n_eigs: int, label_tol: float,
              rot_ratio: float) -> tuple[_Spectrum, float, float]:
    with torch.no_grad():
        f = fld.one(u)
    lam = float(u @ f)
    res = float(relative_residual(u, f))
    if solver == "dense":
        m = _tangent_matrix(fld, u, lam).detach()
        eigs = torch.linalg.eigvals(m.cpu().to(torch.float64))
    else:
        eigs = _arpack_extremes(_tangent_operator(fld, u, lam), n_eigs)
    return _label_spectrum(eigs, label_tol, rot_ratio), lam, res


# ----------------------------------------------------------------------------------------------------------
# solvers


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


# ----------------------------------------------------------------------------------------------------------
# results


def _empty(*shape: int, dtype: torch.dtype = torch.float64) -> Callable[[], Tensor]:
    return lambda: torch.zeros(*shape, dtype=dtype)


@register
@dataclasses.dataclass
class PointClassification(Result):
    """Tangent spectrum and label of one point (see :func:`classify_point`).

    Attributes:
        point: the unit vector u (float64).
        lam: λ = <u, F(u)>.
        residual: ||P_u F(u)|| / ||F(u)||; the spectrum describes an equilibrium only when this is small.
        eigenvalues: eigenvalues of M = Qᵀ DF(u) Q - λ I, sorted by real part, descending. All d-1 of them
            (dense), or the n_eigs of largest real part followed by the n_eigs of smallest real part (arpack).
        label: "attractor" | "repeller" | "saddle" | "degenerate".
        rotational: any eigenvalue with |Im| > rot_ratio·|Re| (among the computed ones for arpack).
        index: number of eigenvalues with Re > tol (for arpack: among the 2·n_eigs computed, a lower bound).
        spectral_abscissa: max Re.
        near_zero: number of eigenvalues with |Re| <= tol (among the computed ones).
        max_im_re: largest |Im|/|Re| over the non-real eigenvalues (0 if all are real, inf for a pure-imaginary pair).
        rotational_fraction: fraction of the computed eigenvalues that are rotational.
        eigensolver: "dense" or "arpack".
    """

    point: Float[Tensor, " d_model"] = dataclasses.field(default_factory=_empty(0))
    lam: float = math.nan
    residual: float = math.nan
    eigenvalues: Complex[Tensor, " k"] = dataclasses.field(default_factory=_empty(0, dtype=torch.complex128))
    label: str = "degenerate"
    rotational: bool = False
    index: int = 0
    spectral_abscissa: float = math.nan
    near_zero: int = 0
    max_im_re: float = math.nan
    rotational_fraction: float = math.nan
    eigensolver: str = "dense"

    kind = "point_classification"

    def summary(self) -> dict[str, Any]:
        return {"label": self.label, "lambda": self.lam, "residual": self.residual, "index": self.index,
                "spectral_abscissa": self.spectral_abscissa, "rotational": self.rotational,
                "near_zero": self.near_zero, "max_im_re": self.max_im_re, "eigensolver": self.eigensolver}


@register
@dataclasses.dataclass
class EquilibriaResult(Result):
    """Distinct equilibria found on S^{d-1}, sorted by λ (descending), with their tangent spectra.

    Attributes:
        points: unit equilibria u*, float64 ``[n, d]``.
        lambdas: λ = <u*, F(u*)> ``[n]``.
        residuals: ||P_u F(u)|| / ||F(u)|| at each point ``[n]`` (all < tol).
        eigenvalues: complex128 ``[n, k]``, eigenvalues of M = Qᵀ DF Q - λ I sorted by real part (descending);
            k = d - 1 for the dense solver; for ARPACK k = 2·n_eigs: the n_eigs of largest real part (descending)
            then the n_eigs of smallest real part (ascending).
        labels: "attractor" | "repeller" | "saddle" per point, or "degenerate" when near-zero modes leave the sign
            pattern undecided (non-hyperbolic; not in the paper's vocabulary).
        rotational: per point, any eigenvalue with |Im| > rot_ratio·|Re| (among the computed ones).
        index: per point, the number of eigenvalues with Re > tol (unstable directions); for ARPACK only the
            2·n_eigs computed ones are counted, so it is a lower bound there.
        spectral_abscissa: max Re per point.
        near_zero: per point, the number of eigenvalues with |Re| <= tol (among the computed ones).
        max_im_re: per point, max |Im|/|Re| over the non-real eigenvalues.
        rotational_fraction: per point, the fraction of computed eigenvalues that are rotational.
        hits: per point, how many starts converged to it.
        start_index: per point, the first start (row of the start matrix) that converged to it.
        start_kind: per point, "given" or "random": the kind of that start.
        dim: d.
        n_starts: number of starts run.
        n_converged: number of starts that converged (before deduplication).
        method: "riemannian" or "fixed_point".
        eigensolver: "dense" or "arpack" (resolved from "auto").
        seconds: wall time.
        options: every option of the call.
    """

    points: Float[Tensor, "n d_model"] = dataclasses.field(default_factory=_empty(0, 0))
    lambdas: Float[Tensor, " n"] = dataclasses.field(default_factory=_empty(0))
    residuals: Float[Tensor, " n"] = dataclasses.field(default_factory=_empty(0))
    eigenvalues: Complex[Tensor, "n k"] = dataclasses.field(default_factory=_empty(0, 0, dtype=torch.complex128))
    labels: list[str] = dataclasses.field(default_factory=list)
    rotational: list[bool] = dataclasses.field(default_factory=list)
    index: list[int] = dataclasses.field(default_factory=list)
    spectral_abscissa: Float[Tensor, " n"] = dataclasses.field(default_factory=_empty(0))
    near_zero: list[int] = dataclasses.field(default_factory=list)
    max_im_re: Float[Tensor, " n"] = dataclasses.field(default_factory=_empty(0))
    rotational_fraction: Float[Tensor, " n"] = dataclasses.field(default_factory=_empty(0))
    hits: list[int] = dataclasses.field(default_factory=list)
    start_index: list[int] = dataclasses.field(default_factory=list)
    start_kind: list[str] = dataclasses.field(default_factory=list)
    dim: int = 0
    n_starts: int = 0
    n_converged: int = 0
    method: str = "riemannian"
    eigensolver: str = "dense"
    seconds: float = 0.0
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    kind = "equilibria"

    def __post_init__(self) -> None:
        n = int(self.points.shape[0])
        per_point = {"lambdas": self.lambdas, "residuals": self.residuals, "eigenvalues": self.eigenvalues,
                     "labels": self.labels, "rotational": self.rotational, "index": self.index,
                     "spectral_abscissa": self.spectral_abscissa, "near_zero": self.near_zero,
                     "max_im_re": self.max_im_re, "rotational_fraction": self.rotational_fraction,
                     "hits": self.hits, "start_index": self.start_index, "start_kind": self.start_kind}
        for name, value in per_point.items():
            if len(value) != n:
                raise InputError(f"EquilibriaResult.{name} has {len(value)} entries for {n} points; build it "
                                 "with find_equilibria")
        bad = set(self.labels) - set(LABELS)
        if bad:
            raise InputError(f"unknown labels {sorted(bad)}; expected some of {LABELS}")

    @property
    def n_points(self) -> int:
        return int(self.points.shape[0])

    def counts(self) -> dict[str, int]:
        """Number of points per label, plus ``rotational`` (points with at least one rotational mode)."""
        out = {name: self.labels.count(name) for name in LABELS}
        out["rotational"] = int(sum(self.rotational))
        return out

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dim": self.dim, "n_starts": self.n_starts, "n_converged": self.n_converged,
                               "n_points": self.n_points, "method": self.method, "eigensolver": self.eigensolver,
                               "seconds": self.seconds, **self.counts()}
        if self.n_points:
            out["lambda_max"] = float(self.lambdas.max())
            out["lambda_min"] = float(self.lambdas.min())
            out["max_residual"] = float(self.residuals.max())
            out["median_spectral_abscissa"] = float(self.spectral_abscissa.median())
            out["mean_index"] = float(np.mean(self.index))
        return out

    def plot(self, title: str | None = None):
        """Tangent eigenvalues of every point in the complex plane, one colour per label (plotly Figure)."""
        import plotly.graph_objects as go

        colors = {"attractor": "#2ca02c", "repeller": "#d62728", "saddle": "#1f77b4", "degenerate": "#7f7f7f"}
        fig = go.Figure()
        for label in LABELS:
            rows = [i for i, lab in enumerate(self.labels) if lab == label]
            if not rows:
                continue
            ev = self.eigenvalues[rows]
            pid = torch.tensor(rows).repeat_interleave(ev.shape[1])
            lam = self.lambdas[rows].repeat_interleave(ev.shape[1])
            ev = ev.reshape(-1)
            keep = torch.isfinite(ev.real) & torch.isfinite(ev.imag)
            fig.add_trace(go.Scatter(
                x=ev.real[keep].tolist(), y=ev.imag[keep].tolist(), mode="markers", name=label,
                marker={"color": colors[label], "size": 6, "opacity": 0.7},
                text=[f"point {int(p)}, λ={float(v):.4g}" for p, v in zip(pid[keep], lam[keep])],
                hovertemplate="%{text}<br>Re=%{x:.4g}<br>Im=%{y:.4g}<extra>" + label + "</extra>",
            ))
        fig.add_vline(x=0.0, line={"color": "black", "width": 1, "dash": "dot"})
        fig.update_layout(
            title=title or f"Tangent spectra of {self.n_points} equilibria (d={self.dim}, {self.eigensolver})",
            xaxis_title="Re(eig of Qᵀ DF Q − λI)", yaxis_title="Im", template="plotly_white")
        return fig

    def plot_counts(self, title: str | None = None):
        """Bar chart of :meth:`counts` (plotly Figure)."""
        import plotly.graph_objects as go

        counts = self.counts()
        fig = go.Figure(go.Bar(x=list(counts), y=list(counts.values()),
                               marker_color=["#2ca02c", "#d62728", "#1f77b4", "#7f7f7f", "#9467bd"]))
        fig.update_layout(title=title or f"Equilibria by type ({self.n_points} points, {self.n_starts} starts)",
                          yaxis_title="points", template="plotly_white")
        return fig


# ----------------------------------------------------------------------------------------------------------
# public entry points


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
    tol: float = 1e-8,
    dedup_tol: float = 1e-6,
    max_iter: int = 500,
    newton_steps: int = 8,
    method: Method = "riemannian",
    eigensolver: Eigensolver = "auto",
    n_eigs: int = 6,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
    label_tol: float = 1e-6,
    rot_ratio: float = 0.1,
) -> EquilibriaResult:
    """Find and classify the equilibria u* ∈ S^{d-1} of a field: F(u*) = λ u* (MATH_SPEC §9, finder [I]).

    Phase 1 brings every start near an equilibrium:

    * ``method="riemannian"`` (default): minimise g(u) = ½ ||P_u F(u)||² / ||F(u)||² (scale invariant; every
      equilibrium is a global minimum g = 0, so saddles of the flow are found as readily as attractors) by
      Riemannian gradient descent: Euclidean gradient by autograd, projected by P_u, retraction by
      normalisation, Armijo backtracking per start, batched over starts.
    * ``method="fixed_point"``: the projected fixed-point iteration u ← sign(λ) normalize(F(u)), a nonlinear power
      iteration. Cheap, but it only converges to points that are stable for that map, so it is biased toward
      "dominant" equilibria and misses saddles; do not use it as the only finder.

    Phase 1 stops at residual < 1e-3 or after ``max_iter`` iterations. Phase 2 runs up to ``newton_steps``
    Riemannian Newton steps on V(u) = P_u F(u) with the tangent Jacobian J_T = P DF P - λP in the tangent basis
    (dense DF, or GMRES on JVPs when the eigensolver is ARPACK). A start has converged when
    ||P_u F(u)|| / ||F(u)|| < ``tol``. Converged points with <u_a, u_b> > 1 - ``dedup_tol`` are merged (±u stay
    distinct) and each distinct point is classified as :func:`classify_point` does.

    Args:
        field: F, a torch callable mapping a ``[d]`` vector to ``[d]``, or an ``[n, d]`` batch to ``[n, d]``
            (detected; single-vector fields are vmapped, or looped if vmap fails). It receives ``dtype`` tensors
            on ``device`` and must be differentiable by autograd.
        dim: d.
        n_starts: number of starts; if ``starts`` has fewer rows, the rest are seeded Gaussian directions.
            If it has more, all given rows are used.
        starts: optional ``[m, d]`` start directions (normalised here), e.g. actual token directions.
        seed: seed of the ``torch.Generator`` that draws the random starts (bit-identical reruns).
        tol: convergence threshold on the relative residual.
        dedup_tol: two points are one when <u_a, u_b> > 1 - dedup_tol.
        max_iter: iterations of phase 1.
        newton_steps: Newton steps of phase 2 (0 disables it).
        method: ``"riemannian"`` or ``"fixed_point"``.
        eigensolver: ``"dense"`` (``torch.func.jacfwd`` + ``torch.linalg.eigvals``, all d-1 eigenvalues),
            ``"arpack"`` (``scipy.sparse.linalg.eigs`` on a JVP LinearOperator, the n_eigs of largest and the
            n_eigs of smallest real part), or ``"auto"`` (dense for d <= 1024).
        n_eigs: eigenvalues per end of the spectrum for ARPACK.
        dtype: compute dtype (float64 by default; tol = 1e-8 is out of reach in float32).
        device: device of the computation (default: that of ``starts``, else CPU).
        label_tol: labels use tol = label_tol · max|eig|.
        rot_ratio: an eigenvalue is rotational when |Im| > rot_ratio · |Re|.

    Returns:
        An :class:`EquilibriaResult`; empty tensors (``[0, d]`` points) when no start converged.

    Raises:
        InputError: dim < 2, n_starts < 1, unknown method/eigensolver, bad starts, a field that returns the wrong
            shape or a non-finite value at a start.
    """
    t0 = time.perf_counter()
    dim = _check_dim(dim)
    if isinstance(n_starts, bool) or not isinstance(n_starts, (int, np.integer)) or n_starts < 1:
        raise InputError(f"n_starts must be an int >= 1; got {n_starts!r}")
    if method not in ("riemannian", "fixed_point"):
        raise InputError(f"unknown method {method!r}; use 'riemannian' (finds saddles too) or 'fixed_point'")
    solver = _resolve_eigensolver(eigensolver, dim, n_eigs)
    for name, value in (("tol", tol), ("dedup_tol", dedup_tol), ("label_tol", label_tol)):
        if not (isinstance(value, (int, float)) and 0 < value < 1):
            raise InputError(f"{name} must be a float in (0, 1); got {value!r}")
    if not (isinstance(rot_ratio, (int, float)) and rot_ratio >= 0):
        raise InputError(f"rot_ratio must be a float >= 0; got {rot_ratio!r}")
    for name, value in (("max_iter", max_iter), ("newton_steps", newton_steps)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise InputError(f"{name} must be an int >= 0; got {value!r}")
    if not dtype.is_floating_point:
        raise InputError(f"dtype must be a real floating dtype (float64 recommended); got {dtype}")
    if device is None:
        device = starts.device if isinstance(starts, Tensor) else torch.device("cpu")
    device = torch.device(device)

    u0, kinds = _prepare_starts(starts, dim, int(n_starts), seed, dtype, device)
    n_run = u0.shape[0]
    fld = _FieldAdapter(field, dim, dtype, device)
    probe = u0[:2] if n_run >= 2 else torch.cat([u0, -u0])
    fld.probe(probe)
    with torch.no_grad():
        f0 = fld.many(u0)
    bad = ~torch.isfinite(f0).all(-1)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise InputError(f"the field returned NaN/Inf at {len(rows)} of {n_run} starts (rows {rows[:8]}); check the "
                         "field at unit-norm inputs (e.g. evaluate the model at ρ·u, not at u)")

    switch = NEWTON_SWITCH if newton_steps else tol  # without Newton, phase 1 must reach tol itself
    if method == "riemannian":
        u = _riemannian_descent(fld, u0, int(max_iter), switch)
    else:
        u = _fixed_point(fld, u0, int(max_iter), switch)

    with torch.no_grad():
        res = relative_residual(u, fld.many(u))
    rows_out = []
    for i in range(n_run):
        ui = u[i]
        if newton_steps and float(res[i]) >= 1e-3 * tol and float(res[i]) < NEWTON_MAX_START:
            ui = _newton(fld, ui, int(newton_steps), tol, solver)
        rows_out.append(ui)
    u = torch.stack(rows_out) if rows_out else u
    with torch.no_grad():
        f = fld.many(u)
    res = relative_residual(u, f)
    converged = (res < tol).nonzero().flatten().tolist()

    # deduplicate in start order; the representative is the first start that reached the point
    reps: list[int] = []
    hits: list[int] = []
    for i in converged:
        for j, r in enumerate(reps):
            if float(u[i] @ u[r]) > 1.0 - dedup_tol:
                hits[j] += 1
                break
        else:
            reps.append(i)
            hits.append(1)

    spectra: list[_Spectrum] = []
    lams: list[float] = []
    ress: list[float] = []
    for r in reps:
        spec, lam, rr = _classify(fld, u[r].detach(), solver, n_eigs, label_tol, rot_ratio)
        spectra.append(spec)
        lams.append(lam)
        ress.append(rr)
    order = sorted(range(len(reps)), key=lambda k: -lams[k])  # stable: ties keep start order

    k_eigs = dim - 1 if solver == "dense" else 2 * n_eigs
    n = len(reps)
    points = u[[reps[k] for k in order]].detach().cpu().to(torch.float64) if n else torch.zeros(0, dim,
                                                                                                dtype=torch.float64)
    eig = (torch.stack([spectra[k].eigenvalues for k in order]) if n
           else torch.zeros(0, k_eigs, dtype=torch.complex128))
    options = {"n_starts": int(n_starts), "given_starts": kinds.count("given"), "seed": int(seed), "tol": tol,
               "dedup_tol": dedup_tol, "max_iter": int(max_iter), "newton_steps": int(newton_steps),
               "method": method, "eigensolver": eigensolver, "n_eigs": int(n_eigs), "dtype": str(dtype),
               "device": str(device), "label_tol": label_tol, "rot_ratio": rot_ratio, "field_mode": fld.mode,
               "newton_switch": NEWTON_SWITCH, "dense_max_dim": DENSE_MAX_DIM}
    f64 = torch.float64
    return EquilibriaResult(
        provenance=Provenance(seed=int(seed), dtype=str(dtype).removeprefix("torch."), device=str(device),
                              extra={"protocol": "equilibria", **options}),
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
    """Tangent spectrum and label of the field at one point u (normalised here), MATH_SPEC §9.

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


__all__ = [
    "DENSE_MAX_DIM",
    "EquilibriaResult",
    "PointClassification",
    "classify_point",
    "find_equilibria",
    "relative_residual",
    "tangent_basis",
    "tangent_part",
]
