"""Sphere geometry of residual vectors as pure float64 tensor functions (specification: docs/geometry.md)."""

import math

import torch
from jaxtyping import Bool, Float, Float64, Shaped
from torch import Tensor

from tl_steering.errors import InputError
from tl_steering.validation import all_finite

EPS_NORM: float = 1e-12
"""Floor of a norm in a denominator (float64), docs/geometry.md."""

DEGENERATE_REL: float = 1e-8
"""A vector whose norm is below ``DEGENERATE_REL * median norm`` is degenerate (dropped from means)."""

SINGULAR_REL: float = 1e-12
"""Singular values below ``SINGULAR_REL * sigma_max`` are dropped before the effective rank (Roy-Vetterli)."""

_TINY = torch.finfo(torch.float64).tiny


def _checked(name: str, x: Tensor, min_ndim: int = 1) -> Tensor:
    """Cast ``x`` to float64 after checking it is a non-empty, finite tensor with >= ``min_ndim`` dims."""
    if not isinstance(x, Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(x).__name__}.")
    if x.ndim < min_ndim:
        raise InputError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(x.shape)}.")
    if x.numel() == 0:
        raise InputError(f"{name} is empty (shape {tuple(x.shape)}); pass at least one vector, d_model > 0.")
    x64 = x.to(torch.float64)
    if not all_finite(x64):
        bad = int((~torch.isfinite(x64)).sum())
        raise InputError(
            f"{name} contains NaN or Inf ({bad} of {x.numel()} entries); "
            "clean or mask the activations before computing geometry.")
    return x64


def _checked_vectors(**named: Tensor) -> list[Tensor]:
    """Validate vector batches that must share ``d_model`` and broadcast over their leading dims."""
    checked = [_checked(name, x) for name, x in named.items()]
    shapes = {name: tuple(x.shape) for name, x in named.items()}
    if len({x.shape[-1] for x in checked}) > 1:
        raise InputError(f"{', '.join(shapes)} must have the same last dimension (d_model), got {shapes}.")
    try:
        torch.broadcast_shapes(*(x.shape for x in checked))
    except RuntimeError as err:
        raise InputError(f"the leading dimensions of {shapes} do not broadcast.") from err
    return checked


def _prepared_set(U: Tensor, mask: Tensor | None, center: bool = False) -> tuple[Tensor, Tensor]:
    """Validate a set of directions; return (unit rows with masked rows zeroed, float64 0/1 mask); ``center``:
    the unit rows less their mean valid row (:func:`_centered`)."""
    U64 = _checked("U", U, min_ndim=2)
    if mask is None:
        valid = torch.ones(U64.shape[:-1], dtype=torch.float64, device=U64.device)
    else:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = getattr(mask, "dtype", type(mask).__name__)
            raise InputError(f"mask must be a bool tensor, got {got}.")
        if mask.shape != U64.shape[:-1]:
            raise InputError(
                f"mask must have shape U.shape[:-1] = {tuple(U64.shape[:-1])} ([*batch, n]), "
                f"got {tuple(mask.shape)}.")
        valid = mask.to(device=U64.device, dtype=torch.float64)
    unit = _normalize(U64, EPS_NORM) * valid.unsqueeze(-1)
    return (_centered(unit, valid) if center else unit), valid


def _nan_where(x: Tensor, undefined: Tensor) -> Tensor:
    return torch.where(undefined, torch.full_like(x, math.nan), x)


def _norm(x: Tensor) -> Tensor:
    return torch.linalg.vector_norm(x, dim=-1)


def _normalize(v: Tensor, eps: float) -> Tensor:
    return v / _norm(v).clamp_min(eps).unsqueeze(-1)


def to64(x: Shaped[Tensor, "*dims"]) -> Float64[Tensor, "*dims"]:
    """Cast any tensor to float64, the precision of every geometric quantity (no checks)."""
    return x.to(torch.float64)


def norm(x: Float[Tensor, "*batch d_model"]) -> Float64[Tensor, "*batch"]:
    """Euclidean norm over ``d_model``: ``||x||_2``, shape ``[*batch]``."""
    return _norm(_checked("x", x))


def normalize(v: Float[Tensor, "*batch d_model"], eps: float = EPS_NORM) -> Float64[Tensor, "*batch d_model"]:
    """Unit direction ``v / max(||v||, eps)``; a vector shorter than ``eps`` maps to (nearly) 0, never NaN."""
    return _normalize(_checked("v", v), eps)


def _tangential_part(v: Tensor, reference: Tensor) -> Tensor:
    u = _normalize(reference, EPS_NORM)
    return v - (u * v).sum(-1, keepdim=True) * u


def radial_part(v: Float[Tensor, "*#batch d_model"], reference: Float[Tensor, "*#batch d_model"]
) -> Float64[Tensor, "*#batch d_model"]:
    """Radial part ``R_u v = <u, v> u`` with ``u = normalize(reference)``; ``v = R_u v + P_u v``."""
    v64, ref64 = _checked_vectors(v=v, reference=reference)
    u = _normalize(ref64, EPS_NORM)
    return (u * v64).sum(-1, keepdim=True) * u


def tangential_part(v: Float[Tensor, "*#batch d_model"], reference: Float[Tensor, "*#batch d_model"]
) -> Float64[Tensor, "*#batch d_model"]:
    """Tangent projection ``P_u v = v - <u, v> u`` with ``u = normalize(reference)`` (its identities:
    docs/geometry.md); a zero ``reference`` gives ``P_u v = v``."""
    v64, ref64 = _checked_vectors(v=v, reference=reference)
    return _tangential_part(v64, ref64)


def _safe_cosine(a: Tensor, b: Tensor, eps: float) -> Tensor:
    return (a * b).sum(-1) / (_norm(a).clamp_min(eps) * _norm(b).clamp_min(eps))


def safe_cosine(a: Float[Tensor, "*#batch d_model"], b: Float[Tensor, "*#batch d_model"],
                eps: float = EPS_NORM) -> Float64[Tensor, "*#batch"]:
    """Cosine ``<a, b> / (max(||a||, eps) max(||b||, eps))``; 0 (not NaN) when either vector is ~0."""
    a64, b64 = _checked_vectors(a=a, b=b)
    return _safe_cosine(a64, b64, eps)


def cosine_radial(v: Float[Tensor, "*#batch d_model"], reference: Float[Tensor, "*#batch d_model"]
) -> Float64[Tensor, "*#batch"]:
    """FFN radial coefficient ``c_rad = cos(reference, v) = <u, v> / ||v||`` (paper Eq. 19, second hand;
    docs/geometry.md)."""
    v64, ref64 = _checked_vectors(v=v, reference=reference)
    return _safe_cosine(ref64, v64, EPS_NORM)


def tangent_alignment(a: Float[Tensor, "*#batch d_model"], b: Float[Tensor, "*#batch d_model"],
                      reference: Float[Tensor, "*#batch d_model"]) -> Float64[Tensor, "*#batch"]:
    """Tangent-plane alignment ``cos(P_u a, P_u b)``, ``u = normalize(reference)``, by the safe cosine (~0, not NaN,
    for a purely radial ``a`` or ``b``)."""
    a64, b64, ref64 = _checked_vectors(a=a, b=b, reference=reference)
    return _safe_cosine(_tangential_part(a64, ref64), _tangential_part(b64, ref64), EPS_NORM)


def tangential_speed(v: Float[Tensor, "*#batch d_model"], reference: Float[Tensor, "*#batch d_model"]
) -> Float64[Tensor, "*#batch"]:
    """Angular speed ``||P_u v|| / max(||reference||, EPS_NORM)`` of an update ``v`` at ``reference``."""
    v64, ref64 = _checked_vectors(v=v, reference=reference)
    return _norm(_tangential_part(v64, ref64)) / _norm(ref64).clamp_min(EPS_NORM)


def angle(a: Float[Tensor, "*#batch d_model"], b: Float[Tensor, "*#batch d_model"],
          eps: float = EPS_NORM) -> Float64[Tensor, "*#batch"]:
    """Angle in radians between the directions of ``a`` and ``b``, ``2 atan2(||â - b̂||, ||â + b̂||)``
    (docs/geometry.md, "Angles")."""
    a64, b64 = _checked_vectors(a=a, b=b)
    na, nb = _norm(a64), _norm(b64)
    ua, ub = _normalize(a64, eps), _normalize(b64, eps)
    theta = 2.0 * torch.atan2((ua - ub).norm(dim=-1), (ua + ub).norm(dim=-1))
    degenerate = (na < eps) | (nb < eps)
    if bool(degenerate.any()):
        theta = torch.where(degenerate, torch.arccos(_safe_cosine(a64, b64, eps).clamp(-1.0, 1.0)), theta)
    return theta


def degenerate_mask(x: Float[Tensor, "*batch n d_model"], mask: Bool[Tensor, "*batch n"] | None = None,
                    rel: float = DEGENERATE_REL) -> Bool[Tensor, "*batch n"]:
    """True where a row of ``x`` is degenerate (``||x_j|| < rel`` x the median norm of the rows ``mask`` keeps, or 0);
    docs/geometry.md, "Degenerate tokens"."""
    norms = _norm(_checked("x", x, min_ndim=2))
    if mask is None:
        mask = torch.ones_like(norms, dtype=torch.bool)
    elif not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != norms.shape:
        raise InputError(f"mask must be a bool tensor of shape x.shape[:-1] = {tuple(norms.shape)}, got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}.")
    mask = mask.to(norms.device)
    median = torch.nanmedian(torch.where(mask, norms, torch.full_like(norms, math.nan)), dim=-1, keepdim=True).values
    median = torch.where(torch.isnan(median), torch.zeros_like(median), median)
    return mask & ((norms < rel * median) | (norms == 0))


def _pairwise_cosine(unit: Tensor, valid: Tensor) -> Tensor:
    count = valid.sum(-1)
    total = unit.sum(-2)
    # sum_{i != j} <u_i, u_j> = ||sum u||^2 - sum ||u_j||^2. The subtrahend is n for unit rows; summing the
    # actual squared norms keeps the identity exact if a zero row slips through unmasked (cosine 0 with all).
    off_diagonal = (total * total).sum(-1) - (unit * unit).sum((-1, -2))
    return _nan_where(off_diagonal / (count * (count - 1)).clamp_min(1.0), count < 2)


def _resultant_length(unit: Tensor, valid: Tensor) -> Tensor:
    count = valid.sum(-1)
    return _nan_where(_norm(unit.sum(-2)) / count.clamp_min(1.0), count < 1)


def _centered(unit: Tensor, valid: Tensor) -> Tensor:
    mean = unit.sum(-2, keepdim=True) / valid.sum(-1)[..., None, None].clamp_min(1.0)
    return (unit - mean) * valid.unsqueeze(-1)


def _erank(rows: Tensor) -> Tensor:
    """``exp(-sum p log p)`` with ``p = sigma / sum sigma`` of the singular values of ``rows`` after dropping ``sigma <
    1e-12 sigma_max``; LAPACK is given the tall orientation (wide matrices take it 1.5-2.8x longer)."""
    sigma = torch.linalg.svdvals(rows.mT if rows.shape[-2] < rows.shape[-1] else rows)
    sigma_max = sigma.amax(-1, keepdim=True)
    kept = torch.where(sigma >= SINGULAR_REL * sigma_max, sigma, torch.zeros_like(sigma))
    total = kept.sum(-1, keepdim=True)
    p = kept / total.clamp_min(_TINY)
    entropy = -torch.special.xlogy(p, p).sum(-1)
    return _nan_where(torch.exp(entropy), total.squeeze(-1) <= 0)


def _participation_ratio(rows: Tensor) -> Tensor:
    # sum s^2 = ||U||_F^2 and sum s^4 = ||U U^T||_F^2 = ||U^T U||_F^2: use the smaller Gram matrix.
    gram = rows @ rows.mT if rows.shape[-2] <= rows.shape[-1] else rows.mT @ rows
    sum_s2 = (rows * rows).sum((-1, -2))
    sum_s4 = (gram * gram).sum((-1, -2))
    return _nan_where(sum_s2 * sum_s2 / sum_s4.clamp_min(_TINY), sum_s4 <= 0)


def _rank_collapse(unit: Tensor, valid: Tensor) -> Tensor:
    residual = _norm(_centered(unit, valid).flatten(-2))
    return _nan_where(residual / _norm(unit.flatten(-2)).clamp_min(EPS_NORM), valid.sum(-1) < 1)


def mean_pairwise_cosine(U: Float[Tensor, "*batch n d_model"],
                         mask: Bool[Tensor, "*batch n"] | None = None) -> Float64[Tensor, "*batch"]:
    """Mean pairwise cosine of the valid rows of ``U`` (``mask``; None: all), ``[*batch]``, NaN where fewer than 2
    are valid (docs/geometry.md, "Statistics of a set of directions")."""
    return _pairwise_cosine(*_prepared_set(U, mask))


def mean_resultant_length(U: Float[Tensor, "*batch n d_model"],
                          mask: Bool[Tensor, "*batch n"] | None = None) -> Float64[Tensor, "*batch"]:
    """Mean resultant length ``R = ||(1/n) sum_j u_j||`` in [0, 1]; NaN where no row is valid."""
    return _resultant_length(*_prepared_set(U, mask))


def effective_rank(U: Float[Tensor, "*batch n d_model"], mask: Bool[Tensor, "*batch n"] | None = None,
                   center: bool = False) -> Float64[Tensor, "*batch"]:
    """Effective rank (Roy-Vetterli) of the unit rows, ``center``: less the mean valid row; NaN where every singular
    value is 0 (docs/geometry.md, "Statistics of a set of directions")."""
    return _erank(_prepared_set(U, mask, center)[0])


def participation_ratio(U: Float[Tensor, "*batch n d_model"], mask: Bool[Tensor, "*batch n"] | None = None,
                        center: bool = False) -> Float64[Tensor, "*batch"]:
    """Participation ratio ``(sum s^2)^2 / sum s^4 = ||U||_F^4 / ||U U^T||_F^2`` of the unit rows (no SVD); ``mask``
    and ``center`` as in :func:`effective_rank`; NaN where U (after centering) is 0."""
    return _participation_ratio(_prepared_set(U, mask, center)[0])


def diversity_stats(U: Float[Tensor, "*batch n d_model"],
                    mask: Bool[Tensor, "*batch n"] | None = None) -> dict[str, Float64[Tensor, "*batch"]]:
    """Every set statistic at once (uncentered), with one validation and normalization: a dict of ``[*batch]``
    tensors keyed as in docs/geometry.md, "Statistics of a set of directions"."""
    unit, valid = _prepared_set(U, mask)
    resultant = _resultant_length(unit, valid)
    return {
        "pairwise_cosine": _pairwise_cosine(unit, valid),
        "resultant_length": resultant,
        "spherical_variance": 1.0 - resultant,
        "effective_rank": _erank(unit),
        "participation_ratio": _participation_ratio(unit),
        "rank_collapse": _rank_collapse(unit, valid)}


def prefix_mean_pairwise_cosine(U: Float[Tensor, "*batch n d_model"],
                                mask: Bool[Tensor, "*batch n"] | None = None) -> Float64[Tensor, "*batch n"]:
    """:func:`mean_pairwise_cosine` of every prefix ``u_1..u_t`` (docs/geometry.md, "Prefix ("causal") versions")."""
    unit, valid = _prepared_set(U, mask)
    count = valid.cumsum(-1)
    running = unit.cumsum(-2)
    off_diagonal = (running * running).sum(-1) - (unit * unit).sum(-1).cumsum(-1)
    return _nan_where(off_diagonal / (count * (count - 1)).clamp_min(1.0), count < 2)


def prefix_mean_resultant_length(U: Float[Tensor, "*batch n d_model"],
                                 mask: Bool[Tensor, "*batch n"] | None = None) -> Float64[Tensor, "*batch n"]:
    """:func:`mean_resultant_length` of every prefix, ``R_t = ||S_t|| / n_t`` by cumulative sums, O(n d)."""
    unit, valid = _prepared_set(U, mask)
    count = valid.cumsum(-1)
    return _nan_where(_norm(unit.cumsum(-2)) / count.clamp_min(1.0), count < 1)


def prefix_effective_rank(U: Float[Tensor, "*batch n d_model"],
                          mask: Bool[Tensor, "*batch n"] | None = None) -> Float64[Tensor, "*batch n"]:
    """:func:`effective_rank` (uncentered) of every prefix, from one Householder QR ``U^T = Q R``
    (docs/geometry.md, "Prefix ("causal") versions")."""
    unit, _ = _prepared_set(U, mask)
    n, d = unit.shape[-2], unit.shape[-1]
    triangular = torch.linalg.qr(unit.mT, mode="r").R
    out = unit.new_empty(unit.shape[:-1])
    for t in range(1, n + 1):
        out[..., t - 1] = _erank(triangular[..., : min(t, d), :t])
    return out


def prefix_participation_ratio(U: Float[Tensor, "*batch n d_model"],
                               mask: Bool[Tensor, "*batch n"] | None = None) -> Float64[Tensor, "*batch n"]:
    """:func:`participation_ratio` (uncentered) of every prefix, off cumulative sums of the Gram matrix ``U U^T``
    (docs/geometry.md, "Prefix ("causal") versions"); NaN while no row is valid."""
    unit, _ = _prepared_set(U, mask)
    gram = unit @ unit.mT
    trace = torch.diagonal(gram, dim1=-2, dim2=-1).cumsum(-1)
    frobenius_sq = torch.diagonal((gram * gram).cumsum(-1).cumsum(-2), dim1=-2, dim2=-1)
    return _nan_where(trace * trace / frobenius_sq.clamp_min(_TINY), frobenius_sq <= 0)


__all__ = [
    "EPS_NORM", "DEGENERATE_REL", "SINGULAR_REL", "to64", "norm", "normalize", "radial_part",
    "tangential_part", "safe_cosine", "cosine_radial", "tangent_alignment", "tangential_speed", "angle",
    "degenerate_mask", "mean_pairwise_cosine", "mean_resultant_length", "effective_rank",
    "participation_ratio", "diversity_stats", "prefix_mean_pairwise_cosine", "prefix_mean_resultant_length",
    "prefix_effective_rank", "prefix_participation_ratio"]
