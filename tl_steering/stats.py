"""Statistics shared by every protocol and probe: position masks, log-spaced position bins, masked means and
the bootstrap over sequences (see docs/statistics.md), exact binomial intervals. Pure functions, no model."""

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .errors import InputError
from .validation import as_positions


def check_exclude_positions(exclude_positions: Any) -> tuple[int, ...]:
    """``exclude_positions`` as a sorted tuple of distinct ints (negative indices count from the end; None: none);
    :func:`tl_steering.validation.as_positions` does the checking."""
    return () if exclude_positions is None else as_positions(exclude_positions, "exclude_positions")


def position_mask(n_pos: int, exclude_positions: Sequence[int], device: torch.device | str = "cpu"
                  ) -> Bool[Tensor, " pos"]:
    """True at the positions that enter statistics (``exclude_positions`` are False; negatives count from
    the end; indices outside the sequence are ignored). Raises InputError when no position is left."""
    mask = torch.ones(n_pos, dtype=torch.bool, device=device)
    for p in exclude_positions:
        if -n_pos <= p < n_pos:
            mask[p] = False
    if not bool(mask.any()):
        raise InputError(f"exclude_positions={tuple(exclude_positions)} leaves no position of a length-{n_pos} "
                         "sequence; exclude fewer positions or pass longer sequences")
    return mask


def position_bin_edges(n_pos: int) -> list[int]:
    """Edges ``[0, 1, 2, 4, ..., 2^k]`` of the log-spaced position bins, ``2^k >= n_pos`` the first such power
    (docs/statistics.md, "Position bins")."""
    edges = [0, 1]
    while edges[-1] < n_pos:
        edges.append(edges[-1] * 2)
    return edges


def position_bin_index(positions: Int[Tensor, "*shape"]) -> Int[Tensor, "*shape"]:
    """The bin of each position under :func:`position_bin_edges`: 0 for position 0, else ``floor(log2 p) + 1``
    (the bit length of p; exact in float64 for every position below 2^52)."""
    p = positions.to(torch.int64)
    out = torch.zeros_like(p)
    pos = p > 0
    out[pos] = torch.floor(torch.log2(p[pos].to(torch.float64))).to(torch.int64) + 1
    return out


def position_bins(n_pos: int) -> tuple[list[int], Int[Tensor, " pos"]]:
    """The bins of :func:`position_bin_edges` without bin 0: ``(edges [1, 2, 4, ..., 2^k], index)``, index -1 for
    position 0 (docs/statistics.md, "Position bins")."""
    edges = position_bin_edges(max(n_pos, 2))[1:]
    index = position_bin_index(torch.arange(n_pos)) - 1
    return edges, index


def bin_labels(edges: Sequence[int], n_pos: int) -> list[str]:
    """``"[lo,hi)"`` per bin, the last upper edge cut at ``n_pos``."""
    return [f"[{lo},{min(hi, n_pos)})" for lo, hi in zip(edges[:-1], edges[1:])]


def masked_mean(values: Float[Tensor, "*b p"], mask: Bool[Tensor, "*b p"], dim: int = -1) -> Tensor:
    """Mean of ``values`` over ``mask`` along ``dim`` (NaN where nothing is valid)."""
    w = mask.to(values.dtype)
    total = torch.where(mask, values, torch.zeros_like(values)).sum(dim)
    count = w.sum(dim)
    return torch.where(count > 0, total / count.clamp_min(1.0), torch.full_like(total, math.nan))


def finite_mean(x: Tensor) -> float:
    """Mean of the finite entries (NaN when there are none)."""
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else math.nan


def bootstrap_ci(per_sequence: Float[Tensor, "seq *rest"], statistic: Callable[[Tensor], Tensor] | None = None,
                 n_bootstrap: int = 1000, seed: int = 0, level: float = 0.95) -> Float[Tensor, "*out 2"]:
    """Percentile bootstrap CI ``[*out, 2]`` (float64) over the rows (sequences) of ``per_sequence`` of ``statistic``
    (default ``nanmean`` over sequences); docs/statistics.md, "Bootstrap confidence intervals"."""
    stat = statistic or (lambda s: torch.nanmean(s, dim=0))
    x = per_sequence.detach().to("cpu", torch.float64)
    point = stat(x)
    if n_bootstrap == 0 or x.shape[0] < 2:
        return torch.stack([torch.full_like(point, math.nan)] * 2, dim=-1)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, x.shape[0], (n_bootstrap, x.shape[0]), generator=g)
    samples = torch.stack([stat(x[i]) for i in idx])
    alpha = (1.0 - level) / 2.0
    q = torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64)
    flat = samples.reshape(n_bootstrap, -1)
    out = torch.nanquantile(flat, q, dim=0).T  # [cols, 2]
    return out.reshape(*point.shape, 2)


def block_length(n_tokens: int) -> int:
    """Tokens per block of the block bootstrap over ``n_tokens`` tokens: ``round(n^(1/3))``, at least 1
    (docs/statistics.md, "Bootstrap confidence intervals")."""
    return max(1, int(round(max(int(n_tokens), 1) ** (1.0 / 3.0))))


def block_sums(per_token: Float[Tensor, "window token *m"], length: int) -> Float[Tensor, "window block *m"]:
    """Sums of consecutive, non-overlapping blocks of ``length`` tokens along dim 1 (the last block shorter when
    ``length`` does not divide the token count), in float64."""
    if length < 1:
        raise InputError(f"block length must be >= 1, got {length}")
    x = per_token.to(torch.float64)
    n = x.shape[1]
    nb = -(-n // length)
    pad = nb * length - n
    if pad:
        x = torch.cat([x, x.new_zeros((x.shape[0], pad, *x.shape[2:]))], dim=1)
    return x.reshape(x.shape[0], nb, length, *x.shape[2:]).sum(2)


def cluster_bootstrap_ci(sums: Float[Tensor, "window block *m"], counts: Float[Tensor, "window block"],
                         n_bootstrap: int = 1000, seed: int = 0, level: float = 0.95) -> Float[Tensor, "*m 2"]:
    """Percentile interval ``[*m, 2]`` of ``sum(sums) / sum(counts)`` (``sums`` ``[window, block, *m]``, ``counts``
    ``[window, block]``) under the two-stage block bootstrap of docs/statistics.md, "Bootstrap confidence intervals"."""
    s = sums.detach().to("cpu", torch.float64)
    c = counts.detach().to("cpu", torch.float64)
    w, b = int(c.shape[0]), int(c.shape[1])
    m_shape = tuple(s.shape[2:])
    flat = s.reshape(w * b, -1)
    if n_bootstrap == 0 or w * b < 2:
        return torch.full((*m_shape, 2), math.nan, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    out = []
    chunk = max(1, min(n_bootstrap, (1 << 20) // max(w * b, 1)))
    done = 0
    while done < n_bootstrap:
        r = min(chunk, n_bootstrap - done)
        wi = torch.randint(0, w, (r, w), generator=g)
        bi = torch.randint(0, b, (r, w, b), generator=g)
        cell = (wi.unsqueeze(-1) * b + bi).reshape(r, w * b)
        weight = torch.zeros(r, w * b, dtype=torch.float64).scatter_add_(
            1, cell, torch.ones(r, w * b, dtype=torch.float64))
        out.append((weight @ flat) / (weight @ c.reshape(-1)).unsqueeze(-1))
        done += r
    samples = torch.cat(out)
    alpha = (1.0 - level) / 2.0
    q = torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64)
    return torch.nanquantile(samples, q, dim=0).T.reshape(*m_shape, 2)


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float, float]:
    """``(median, low, high, coverage)`` of the finite ``values``: the median with its distribution-free
    order-statistic interval (docs/statistics.md, "Timing"); all NaN without a finite value."""
    x = sorted(float(v) for v in values if math.isfinite(float(v)))
    n = len(x)
    if n == 0:
        return math.nan, math.nan, math.nan, math.nan
    median = x[n // 2] if n % 2 else 0.5 * (x[n // 2 - 1] + x[n // 2])

    def coverage(j: int) -> float:  # of [x_(j), x_(n+1-j)], j >= 1
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(j)) / 2.0**n

    j = 1
    while j + 1 <= (n + 1) // 2 and coverage(j + 1) >= level:
        j += 1
    return median, x[j - 1], x[n - j], max(0.0, coverage(j))


def chao1(abundances: Sequence[int], level: float = 0.95) -> dict[str, float]:
    """Chao1 richness of a population sampled with replacement, from how often each observed class was drawn, with
    its interval (docs/statistics.md, "Richness (Chao1)")."""
    counts = [int(a) for a in abundances if int(a) > 0]
    s_obs, n = len(counts), sum(counts)
    f1, f2 = counts.count(1), counts.count(2)
    out = {"observed": float(s_obs), "draws": float(n), "f1": float(f1), "f2": float(f2), "level": level}
    if s_obs == 0:
        return {**out, "estimate": 0.0, "ci_low": 0.0, "ci_high": 0.0}
    from scipy.special import ndtri

    z = float(ndtri(0.5 + level / 2))  # the normal quantile (scipy.special imports in a third of scipy.stats's time)
    unseen = f1 * (f1 - 1) / (2.0 * (f2 + 1))
    if unseen > 0:
        var = (unseen + f1 * (2 * f1 - 1) ** 2 / (4.0 * (f2 + 1) ** 2)
               + f1 * f1 * f2 * (f1 - 1) ** 2 / (4.0 * (f2 + 1) ** 4))
        k = math.exp(z * math.sqrt(math.log(1.0 + var / unseen ** 2)))
        low, high = s_obs + unseen / k, s_obs + unseen * k
    else:
        p = math.exp(-n / s_obs)
        half = z * math.sqrt(s_obs * p / (1.0 - p))
        low, high = max(float(s_obs), s_obs / (1.0 - p) - half), s_obs / (1.0 - p) + half
    return {**out, "estimate": s_obs + unseen, "ci_low": low, "ci_high": high}


#: ridge of the ``"linear"`` correction in units of the mean eigenvalue of the attention writes' covariance, tr(C_aa) / d
LINEAR_RIDGE = 1.0


class Moments:
    """Float64 least-squares moments of the closed-form correction of one layer's write (docs/parallel.md,
    "Refit"; docs/gates.md): Σ<Y, P>, Σ||P||², ΣP, ΣY and the token count n; with
    ``linear``, also Σ a^T a, Σ a^T Y, Σ a^T P (``[d, d]``) and Σa of the attention write a, or while
    n <= d / 2 the rows (a, Y, P) themselves (:meth:`solve_linear` then solves in the n-dim token space)."""

    def __init__(self, d_model: int, device: Any = "cpu", linear: bool = False):
        z = {"dtype": torch.float64, "device": device}
        self.yp = torch.zeros((), **z)
        self.pp = torch.zeros((), **z)
        self.sp = torch.zeros(d_model, **z)
        self.sy = torch.zeros(d_model, **z)
        self.n = 0
        self.linear = linear
        if linear:
            self.aa, self.ay, self.ap = (torch.zeros(d_model, d_model, **z) for _ in range(3))
            self.sa = torch.zeros(d_model, **z)
        self._rows: list[tuple[Tensor, Tensor, Tensor]] | None = [] if linear else None  # while n <= d / 2

    def add(self, y: Tensor, p: Tensor, exclude_positions: Sequence[int] = (0,), a: Tensor | None = None) -> None:
        """Add the tokens of ``y`` (sequential write), ``p`` (parallel write) and, for a ``linear`` fit, ``a``
        (the attention write), each ``[batch, pos, d]``."""
        mask = position_mask(y.shape[-2], exclude_positions, y.device)
        y64 = y.detach()[:, mask].to(torch.float64).reshape(-1, y.shape[-1])
        p64 = p.detach()[:, mask].to(torch.float64).reshape(-1, p.shape[-1])
        self.yp += (y64 * p64).sum()
        self.pp += (p64 * p64).sum()
        self.sp += p64.sum(0)
        self.sy += y64.sum(0)
        self.n += y64.shape[0]
        if self.linear:
            if a is None:
                raise InputError("a linear fit needs the attention write a (Moments.add(..., a=attn_out))")
            a64 = a.detach()[:, mask].to(torch.float64).reshape(-1, a.shape[-1])
            self.sa += a64.sum(0)
            if self._rows is not None:
                self._rows.append((a64, y64, p64))
                if 2 * self.n <= self.sp.shape[0]:
                    return
            for a_, y_, p_ in self._rows or [(a64, y64, p64)]:  # past d / 2 rows: the [d, d] moments
                self.aa += a_.T @ a_
                self.ay += a_.T @ y_
                self.ap += a_.T @ p_
            self._rows = None

    def solve(self, refit: str) -> tuple[float, Tensor]:
        """The fitted ``(g, b)`` (``b`` float64 ``[d_model]``, zero unless ``refit`` is ``"affine"`` or
        ``"linear"``; for ``"linear"`` see :meth:`solve_linear`)."""
        if refit == "linear":
            return self.solve_linear()[:2]
        return solve_correction(self.yp, self.pp, self.sp, self.sy, self.n, refit)

    def solve_linear(self, ridge: float = LINEAR_RIDGE, max_df: float | None = None) -> tuple[float, Tensor, Tensor]:
        """``(g, b, W)`` of ``refit="linear"`` (docs/parallel.md, "Refit"); W = 0 where the attention write does not
        vary or no token was added. ``max_df``: raise the ridge until :func:`ridge_df` of C_aa is at most it."""
        if not self.linear:
            raise InputError("these moments were collected without the attention write: Moments(..., linear=True)")
        d = self.sp.shape[0]
        g, _ = solve_correction(self.yp, self.pp, self.sp, self.sy, self.n, "affine")
        w = torch.zeros(d, d, dtype=torch.float64, device=self.sp.device)
        if self.n == 0:
            return 1.0, torch.zeros_like(self.sp), w
        n = self.n
        sr = self.sy - g * self.sp  # Σ R
        if self._rows:  # C_aa = A_cᵀ A_c, C_aR = A_cᵀ R_c of the centred rows: W = A_cᵀ (A_c A_cᵀ + λI)⁻¹ R_c
            a, y, p = (torch.cat(t) for t in zip(*self._rows))
            a, r = a - self.sa / n, y - g * p - sr / n
            c_aa, c_ar, tr = a @ a.T, r, float((a * a).sum())  # [n, n]: the same nonzero spectrum as C_aa
        else:
            c_aa = self.aa - torch.outer(self.sa, self.sa) / n
            c_ar = (self.ay - g * self.ap) - torch.outer(self.sa, sr) / n
            tr = float(torch.trace(c_aa))
        if tr > 0 and math.isfinite(tr):
            lam = ridge * tr / d
            if max_df is not None:  # ridge_df counts zero eigenvalues as 0: either spectrum gives it
                lam = ridge_for_df(torch.linalg.eigvalsh(c_aa), max_df, lam)
            eye = torch.eye(len(c_aa), dtype=c_aa.dtype, device=c_aa.device)
            w = torch.linalg.solve(c_aa + lam * eye, c_ar)
            w = a.T @ w if self._rows else w
        return g, (sr - self.sa @ w) / n, w


def ridge_df(eigenvalues: Tensor, lam: float) -> float:
    """Effective degrees of freedom of a ridge regression, Σ_i s_i / (s_i + λ) (negative roundoff eigenvalues
    count as 0)."""
    s = eigenvalues.to(torch.float64).clamp_min(0.0)
    return float((s / (s + lam)).sum()) if lam > 0 else float((s > 0).sum())


def ridge_for_df(eigenvalues: Tensor, max_df: float, lam: float) -> float:
    """The smallest ridge ``>= lam`` whose :func:`ridge_df` is at most ``max_df`` (bisection in log λ; df falls
    as λ grows)."""
    if ridge_df(eigenvalues, lam) <= max_df:
        return lam
    top = float(eigenvalues.max())
    lo, hi = math.log(lam), math.log(max(lam, top) * max(1.0, ridge_df(eigenvalues, lam) / max(max_df, 1e-12))
                                      * 4.0 + 1e-300)
    while ridge_df(eigenvalues, math.exp(hi)) > max_df:
        hi += math.log(4.0)
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if ridge_df(eigenvalues, math.exp(mid)) > max_df:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)


def solve_correction(yp: Tensor | float, pp: Tensor | float, sp: Tensor, sy: Tensor, n: int, refit: str
                     ) -> tuple[float, Tensor]:
    """Least-squares ``g, b`` minimising Σ||g P + b - Y||² (``"affine"``), Σ||g P - Y||² (``"gate"``, b = 0) or
    the identity (``"none"``), from the moments; a degenerate design (no token, P zero or constant) keeps g = 1
    and fits b alone."""
    sp64, sy64 = sp.to(torch.float64), sy.to(torch.float64)
    zero = torch.zeros_like(sp64)
    if refit == "none" or n == 0:
        return 1.0, zero
    yp, pp = float(yp), float(pp)
    if refit == "gate":
        return (yp / pp if pp > 0 else 1.0), zero
    if refit != "affine":
        raise InputError(f"the correction must be 'none', 'gate', 'affine' or 'linear', got {refit!r}")
    den = pp - float(sp64 @ sp64) / n
    num = yp - float(sy64 @ sp64) / n
    g = num / den if den > 1e-12 * max(pp, 1e-300) else 1.0
    return g, (sy64 - g * sp64) / n


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval of a binomial proportion k/n, from the Beta quantiles; (nan, nan) when
    n = 0."""
    if n <= 0:
        return math.nan, math.nan
    from scipy.special import betaincinv

    k, n, tail = int(k), int(n), (1.0 - level) / 2
    return (0.0 if k == 0 else float(betaincinv(k, n - k + 1, tail)),
            1.0 if k == n else float(betaincinv(k + 1, n - k, 1.0 - tail)))


def proportion_verdict(k: int, n: int, level: float = 0.95, count_key: str = "k") -> dict[str, Any]:
    """k of n against 1/2 with the exact interval: supported / rejected / undecided / no equilibria."""
    low, high = clopper_pearson(k, n, level)
    verdict = ("no equilibria" if n == 0 else "supported" if low > 0.5 else "rejected" if high < 0.5 else "undecided")
    return {count_key: int(k), "n": int(n), "fraction": k / n if n else math.nan, "ci_low": low, "ci_high": high,
            "level": level, "verdict": verdict}


__all__ = [
    "LINEAR_RIDGE", "Moments", "ridge_df", "ridge_for_df", "solve_correction", "clopper_pearson",
    "proportion_verdict", "bin_labels", "block_length", "block_sums", "chao1", "bootstrap_ci",
    "cluster_bootstrap_ci", "check_exclude_positions", "finite_mean", "masked_mean", "median_interval",
    "position_bin_edges", "position_bin_index", "position_bins", "position_mask"]
