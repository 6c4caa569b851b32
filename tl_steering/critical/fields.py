"""The field on the sphere as the finder sees it: calling conventions, tangent projection, residual, tangent basis.

A field is any torch callable F: R^d -> R^d that accepts a batch ``[n, d]`` or a single vector ``[d]``; the
adapter probes which and uses, in this order, the batched call, ``torch.func.vmap`` of the single call, or a
Python loop. See docs/critical_points.md."""

import math
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from ..backends import autodiff
from ..errors import InputError
from ..geometry import _tangential_part, angle

Field = Callable[[Tensor], Tensor]

_EPS = 1e-300  # guards 0/0 only; the residual of a point where ||F|| underflows is reported as inf


# ----------------------------------------------------------------------------------------------------------
# the relative residual (the convergence measure of every phase)


def relative_residual(u: Float[Tensor, "*batch d"], f: Float[Tensor, "*batch d"]) -> Float[Tensor, " *batch"]:
    """||P_u F(u)|| / ||F(u)||: the sine of the angle between u and F(u); 0 exactly at an equilibrium, inf where F
    vanishes or is not finite."""
    fn = f.norm(dim=-1)
    res = _tangential_part(f, u).norm(dim=-1) / fn.clamp_min(_EPS)
    return torch.where(torch.isfinite(res) & (fn > 0), res, torch.full_like(res, math.inf))


class _Householder:
    """The reflector H = I - β w wᵀ with H u = ∓e_1; its columns 2..d are an orthonormal basis Q of u^⊥.

    This Q is the one a QR of [u, I] gives up to an orthogonal change of basis of the tangent space (the spectrum
    of M = Qᵀ DF Q - λ I does not depend on that choice), and it is applied in O(d) without forming a d × d matrix,
    which the matrix-free (ARPACK) path needs. ``u`` is one unit vector ``[d]``."""

    def __init__(self, u: Tensor) -> None:
        w = u.clone()
        w[0] = w[0] + (1.0 if float(u[0]) >= 0 else -1.0)
        self.w = w
        self.beta = 2.0 / float(w @ w)

    def apply(self, x: Tensor) -> Tensor:
        return x - self.beta * (self.w @ x) * self.w

    def q(self, s: Tensor) -> Tensor:
        """Q s: tangent coordinates (d-1) -> tangent vector (d)."""
        return self.apply(torch.cat([s.new_zeros(*s.shape[:-1], 1), s], dim=-1))

    def qt(self, v: Tensor) -> Tensor:
        """Qᵀ v: vector (d) -> tangent coordinates (d-1)."""
        return self.apply(v)[..., 1:]

    def conjugate(self, a: Tensor) -> Tensor:
        """H A H for a d × d matrix A, in O(d²)."""
        w, b = self.w, self.beta
        aw = a @ w
        wa = w @ a
        waw = w @ aw
        return a - b * torch.outer(w, wa) - b * torch.outer(aw, w) + (b * b * waw) * torch.outer(w, w)


# ----------------------------------------------------------------------------------------------------------
# the field, made callable on one point and on a batch


class _FieldAdapter:
    """Wraps the user's callable so that ``one([d])``, ``many([n, d])``, ``jacobians(u)`` and ``linearize(u)`` all
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
        self._jvp_mode: Literal["forward", "reverse"] | None = None
        #: per point (its bytes): DF there and the eigenvalues of its tangent matrix, each computed once
        self.point_cache: dict[bytes, dict[str, Any]] = {}
        #: dense Jacobians of F evaluated so far
        self.n_jacobians = 0

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
        except Exception as exc:  # noqa: BLE001 - the user's callable may raise anything (InputError included)
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
            vm = autodiff.vmap(self.field)(u)
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
            return autodiff.vmap(self.field)(u).to(self.dtype)
        return torch.stack([self.field(x) for x in u]).to(self.dtype)

    def many_no_grad(self, u: Tensor) -> Tensor:
        """F at rows without autograd: the field's own ``evaluate_no_grad`` where it has one (e.g. the model
        fields of :func:`tl_steering.critical.critical_field`), else :meth:`many` under ``torch.no_grad``."""
        fast = getattr(self.field, "evaluate_no_grad", None)
        if self.mode == "batched" and callable(fast) and u.shape[0]:
            return fast(u).to(self.dtype)
        with torch.no_grad():
            return self.many(u)

    def jacobians(self, u: Tensor, chunk: int = 8, dtype: torch.dtype | None = None) -> Tensor:
        """DF at each row of ``u`` ([n, d, d] in ``dtype``, default the adapter's): the field's ``jacobian_no_grad``
        where it answers (e.g. the FFN fields of :func:`tl_steering.critical.critical_field`), else one vmapped
        reverse-mode call per ``chunk`` rows, else torch.autograd per row (a field torch.func cannot vmap)."""
        self.n_jacobians += u.shape[0]
        fast = getattr(self.field, "jacobian_no_grad", None) if self.mode == "batched" else None
        out, dtype = [], dtype or self.dtype
        for part in u.split(chunk):
            jac = fast(part, dtype) if callable(fast) else None
            if jac is None:
                try:
                    jac = autodiff.vmap(autodiff.jacrev(self.one))(part)
                except Exception:  # noqa: BLE001 - a field torch.func cannot vmap
                    jac = torch.stack([torch.autograd.functional.jacobian(self.one, x) for x in part])
            out.append(jac.to(dtype).detach())
        return (out[0] if len(out) == 1 else torch.cat(out)) if out else u.new_zeros(0, self.dim, self.dim)

    def point_jacobians(self, points: Tensor) -> list[Tensor]:
        """DF at each row of ``points``, computed once per point (cached in :attr:`point_cache`; rows missing from
        the cache in one batch)."""
        entries = [self.point_cache.setdefault(key(x), {}) for x in points]
        missing = [i for i, e in enumerate(entries) if "jac" not in e]
        if missing:
            for i, jac in zip(missing, self.jacobians(points[missing])):
                entries[i]["jac"] = jac
        return [e["jac"] for e in entries]

    def linearize(self, u: Tensor) -> Callable[[Tensor], Tensor]:
        """v ↦ DF(u) v, reusing the linearisation across calls (for ARPACK / GMRES)."""
        if self._jvp_mode in (None, "forward"):
            try:
                with warnings.catch_warnings():  # torch.fx const-folding chatter, harmless
                    warnings.simplefilter("ignore", UserWarning)
                    _, jvp_fn = autodiff.linearize(self.one, u)
                    jvp_fn(torch.zeros_like(u))
                self._jvp_mode = "forward"
                return lambda v: jvp_fn(v).to(self.dtype)
            except Exception:  # noqa: BLE001
                if self._jvp_mode == "forward":
                    raise
                self._jvp_mode = "reverse"
        return lambda v: torch.autograd.functional.jvp(self.one, u, v)[1].to(self.dtype)


def key(x: Tensor) -> bytes:
    """A point's exact identity (its float64 bytes), the key of :attr:`_FieldAdapter.point_cache`."""
    return x.detach().to("cpu", torch.float64).numpy().tobytes()


def _agree(a: Tensor, b: Tensor) -> bool:
    scale = float(b.abs().max()) if b.numel() else 0.0
    return bool(torch.isfinite(a).all()) and bool(torch.allclose(a, b, rtol=1e-9, atol=1e-12 * (1.0 + scale)))


def _match_point(known: Tensor, x: Tensor, dedup_angle: float) -> int:
    """Row of ``known`` nearest to ``x`` when it lies within ``dedup_angle`` radians (the same point), else -1."""
    if known.shape[0] == 0:
        return -1
    ang = angle(known, x[None].expand_as(known))
    j = int(ang.argmin())
    return j if float(ang[j]) <= dedup_angle else -1


def _add_distinct(known: Tensor, xs: Tensor, dedup_angle: float) -> Tensor:
    """``known`` with every row of ``xs`` that is not already one of its points appended (in order)."""
    for x in xs:
        if _match_point(known, x, dedup_angle) < 0:
            known = torch.cat([known, x[None]])
    return known


