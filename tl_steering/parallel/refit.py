"""Closed-form corrections of the parallel FFN writes, fitted on calibration windows (``refit=``; docs/parallel.md,
"Refit")."""

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from ..backends import adapt
from ..backends.fused import corrected_ffn_write
from ..errors import InputError
from ..hooks import corrected_write, parallel_hooks
from ..data.sharding import batch_slices
from ..stats import check_exclude_positions, position_mask
from .gold import PlanLoss

#: ``loss_fn(plan, write)``: mean CE on the fitting windows with ``plan`` parallel, FFN writes from ``write``
LossFn = Callable[[Sequence[int], Any], float]

Refit = Literal["none", "gate", "affine", "linear"]
Fit = Literal["sequential", "joint"]
REFITS: tuple[str, ...] = ("none", "gate", "affine", "linear")
#: ridge of ``refit="linear"`` in units of the mean eigenvalue of the attention writes' covariance, tr(C_aa) / d
LINEAR_RIDGE = 1.0
FITS: tuple[str, ...] = ("sequential", "joint")


def refit_parameters(refit: str, d_model: int) -> int:
    """Fitted numbers per layer of a correction: 0 (``"none"``), 1 (``"gate"``: g), d + 1 (``"affine"``: g, b),
    d^2 + d + 1 (``"linear"``: g, b, W)."""
    _check(refit, "sequential")
    return {"none": 0, "gate": 1, "affine": d_model + 1, "linear": d_model * d_model + d_model + 1}[refit]


CARRY = 0.5
"""Effective parameters per output coordinate a correction compared in-sample may have, as a fraction of its fitted
tokens (:func:`carried_refit`)."""


def carried_max_df(n_tokens: int, d_model: int) -> float:
    """The largest effective degrees of freedom of the linear map per output coordinate that ``n_tokens`` carry:
    ``CARRY x n - 1 - 1/d`` (the intercept b and the shared gate g take the rest), at least 0."""
    return max(0.0, CARRY * int(n_tokens) - 1.0 - 1.0 / int(d_model))


def carried_refit(refit: str, n_tokens: int, d_model: int) -> str:
    """The richest correction, no richer than ``refit`` (order none < gate < affine < linear), that ``n_tokens``
    fitting tokens carry when it can only be judged in-sample (no cross-fit): at most ``CARRY`` = 1/2 effective
    parameter per fitted token and output coordinate (the write's coordinates are fitted alike). An ordinary
    least-squares fit of p parameters to N numbers leaves an in-sample residual σ²(1 - p/N) against σ²(1 + p/N) on
    new data: at p ≤ N/2 the fit absorbs at most half of the noise; beyond it the in-sample figure mostly measures
    how much noise was absorbed. Per coordinate the gate costs 1/d, the affine correction 1 + 1/d (b and g), the
    linear one 1 + 1/d + df, df the ridge's effective degrees of freedom, which a carried fit caps at
    :func:`carried_max_df` by raising the ridge (``fit_corrections(..., carry=True)``): so ``"linear"`` is carried
    wherever ``"affine"`` is (3 tokens and more), with a stronger ridge on few tokens. One 32-token window on
    SmolLM2 (31 fitted tokens, d = 576): ``"linear"`` with df <= 14.5 (19-25 at the default ridge)."""
    order = list(REFITS)
    for cand in reversed(order[:order.index(refit) + 1]):
        per_coordinate = {"none": 0.0, "gate": 1.0 / d_model, "affine": 1.0 + 1.0 / d_model,
                          "linear": 1.0 + 1.0 / d_model}[cand]  # linear: df >= 0 more, capped by carried_max_df
        if per_coordinate <= CARRY * int(n_tokens):
            return cand
    return "none"


class Moments:
    """Float64 least-squares moments of one layer: Σ<Y, P>, Σ||P||², ΣP, ΣY and the token count n; with
    ``linear``, also Σ a^T a, Σ a^T Y, Σ a^T P (``[d, d]``) and Σa of the attention write a."""

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
            self.aa += a64.T @ a64
            self.ay += a64.T @ y64
            self.ap += a64.T @ p64
            self.sa += a64.sum(0)

    def solve(self, refit: str) -> tuple[float, Tensor]:
        """The fitted ``(g, b)`` (``b`` float64 ``[d_model]``, zero unless ``refit`` is ``"affine"`` or
        ``"linear"``; for ``"linear"`` see :meth:`solve_linear`)."""
        if refit == "linear":
            g, b, _ = self.solve_linear()
            return g, b
        return solve_correction(self.yp, self.pp, self.sp, self.sy, self.n, refit)

    def solve_linear(self, ridge: float = LINEAR_RIDGE, max_df: float | None = None) -> tuple[float, Tensor, Tensor]:
        """``(g, b, W)`` of ``refit="linear"`` (module docstring): g of the affine fit, W the ridge regression of
        its residual on the centred attention write, b the intercept. W = 0 where the attention write does not
        vary (C_aa = 0) or no token was added. ``max_df``: raise the ridge until the fit's effective degrees of
        freedom per output coordinate, df(λ) = Σ_i s_i / (s_i + λ) over the eigenvalues s_i of C_aa, are at most
        ``max_df`` (:func:`ridge_for_df`)."""
        if not self.linear:
            raise InputError("these moments were collected without the attention write: Moments(..., linear=True)")
        d = self.sp.shape[0]
        g, _ = solve_correction(self.yp, self.pp, self.sp, self.sy, self.n, "affine")
        w = torch.zeros(d, d, dtype=torch.float64, device=self.sp.device)
        if self.n == 0:
            return 1.0, torch.zeros_like(self.sp), w
        n = self.n
        sr = self.sy - g * self.sp  # Σ R
        c_aa = self.aa - torch.outer(self.sa, self.sa) / n
        c_ar = (self.ay - g * self.ap) - torch.outer(self.sa, sr) / n
        tr = float(torch.trace(c_aa))
        if tr > 0 and math.isfinite(tr):
            lam = ridge * tr / d
            if max_df is not None:
                lam = ridge_for_df(torch.linalg.eigvalsh(c_aa), max_df, lam)
            w = torch.linalg.solve(c_aa + lam * torch.eye(d, dtype=torch.float64, device=c_aa.device), c_ar)
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
    the identity (``"none"``), from the moments (see the module docstring). A degenerate design (no token,
    Phi(x) zero or constant) keeps g = 1 and fits b alone."""
    sp64, sy64 = sp.to(torch.float64), sy.to(torch.float64)
    zero = torch.zeros_like(sp64)
    if refit == "none" or n == 0:
        return 1.0, zero
    yp, pp = float(yp), float(pp)
    if refit == "gate":
        return (yp / pp if pp > 0 else 1.0), zero
    if refit != "affine":
        raise InputError(f"refit must be one of {list(REFITS)}, got {refit!r}")
    den = pp - float(sp64 @ sp64) / n
    num = yp - float(sy64 @ sp64) / n
    g = num / den if den > 1e-12 * max(pp, 1e-300) else 1.0
    return g, (sy64 - g * sp64) / n


def _check(refit: str, fit: str) -> None:
    if refit not in REFITS:
        raise InputError(f"refit must be one of {list(REFITS)}, got {refit!r}")
    if fit not in FITS:
        raise InputError(f"fit must be one of {list(FITS)}, got {fit!r}")


class _Stop(Exception):
    """Ends a fitting forward after the last layer it needs (hooks are removed by ``run_with_hooks``)."""


def fit_corrections(
    model: Any,
    tokens: Tensor,
    layers: Sequence[int],
    refit: Refit = "affine",
    fit: Fit = "sequential",
    batch_size: int = 8,
    exclude_positions: Sequence[int] = (0,),
    linears: dict[int, Tensor] | None = None,
    carry: bool = False,
) -> tuple[dict[int, float], dict[int, Tensor], int]:
    """Fit the corrections of the parallel plan ``layers`` on ``tokens`` (see the module docstring).

    Returns ``(gates, biases, passes)``: ``{layer: g}``, ``{layer: b}`` (float64 ``[d_model]``; empty for
    ``"none"``/``"gate"``) for :func:`tl_steering.hooks.parallel_blocks`, and the forwards run (an early-stopped
    one counts as one). ``linears``: a dict that receives ``{layer: W}`` (float64 ``[d_model, d_model]``) of
    ``refit="linear"`` (``parallel_blocks(..., linears=)``); required for that refit. ``carry``: cap each linear
    map's effective degrees of freedom at :func:`carried_max_df` of its fitted tokens (the ridge raised as needed:
    the fit a few tokens carry, :func:`carried_refit`).
    """
    _, g, b, _, passes = _fit(model, tokens, layers, refit, fit, batch_size, exclude_positions, want_loss=False,
                              linears_out=linears, carry=carry)
    return g, b, passes


def corrected_loss(
    model: Any,
    tokens: Tensor,
    layers: Sequence[int],
    refit: Refit = "affine",
    fit: Fit = "sequential",
    batch_size: int = 8,
    exclude_positions: Sequence[int] = (0,),
    loss_fn: LossFn | None = None,
    linears: dict[int, Tensor] | None = None,
    carry: bool = False,
) -> tuple[float, dict[int, float], dict[int, Tensor], int]:
    """Fit on ``tokens`` and return ``(mean CE of the corrected plan on the same tokens, gates, biases, passes)``
    (one pass in all for ``fit="sequential"`` on one batch). ``loss_fn(plan, write)``: the mean CE on ``tokens``
    with ``plan`` parallel and its FFN writes given by ``write`` (as :func:`tl_steering.hooks.parallel_hooks`);
    default a hooked forward per batch (:class:`RefitLoss` passes its prefix-sharing ``PlanLoss.mean_ce``).
    ``linears``, ``carry``: as in :func:`fit_corrections`."""
    loss, g, b, _, passes = _fit(model, tokens, layers, refit, fit, batch_size, exclude_positions, want_loss=True,
                                 loss_fn=loss_fn, linears_out=linears, carry=carry)
    return loss, g, b, passes


def _fit(model: Any, tokens: Tensor, layers: Sequence[int], refit: str, fit: str, batch_size: int,
         exclude_positions: Sequence[int], want_loss: bool, loss_fn: LossFn | None = None,
         linears_out: dict[int, Tensor] | None = None, carry: bool = False
         ) -> tuple[float, dict[int, float], dict[int, Tensor], dict[int, Tensor], int]:
    _check(refit, fit)
    if refit == "linear" and linears_out is None:
        raise InputError('refit="linear" fits a [d_model, d_model] map per layer: pass a dict as linears= to '
                         "receive them (or use RefitLoss / plan_parallel, which keep them)")
    ad = adapt(model)
    if loss_fn is None:  # a whole hooked forward per batch
        loss_fn = PlanLoss(model, tokens, batch_size, share_prefix=False).mean_ce
    excl = check_exclude_positions(exclude_positions)
    plan = [lay for lay in sorted(set(int(x) for x in layers)) if not ad.is_parallel(lay)]
    gates: dict[int, float] = {}
    biases: dict[int, Tensor] = {}
    lins: dict[int, Tensor] = linears_out if linears_out is not None else {}
    lins.clear()
    if refit == "none" or not plan:
        loss = loss_fn(plan, None) if want_loss else math.nan
        return loss, gates, biases, lins, int(want_loss)
    keep_bias = refit in ("affine", "linear")
    linear = refit == "linear"

    def moments() -> Moments:
        return Moments(ad.d_model, ad.device, linear=linear)

    def store(layer: int, m: Moments) -> None:
        if linear:
            g, b, w = m.solve_linear(max_df=carried_max_df(m.n, ad.d_model) if carry else None)
            lins[layer] = w.cpu()
        else:
            g, b = m.solve(refit)
        gates[layer] = g
        if keep_bias:
            biases[layer] = b.cpu()

    def corrected(layer: int, par: Tensor, act: Tensor, attn: Tensor) -> Tensor:
        return corrected_ffn_write(par, gates[layer], biases.get(layer), lins.get(layer), attn, act.dtype)

    rows = batch_slices(tokens.shape[0], batch_size)
    passes = 0
    if fit == "sequential" and len(rows) == 1:  # one forward: each hook fits its layer on the batch, applies it
        def write(layer: int, act: Tensor, par: Tensor, attn: Tensor) -> Tensor:
            m = moments()
            m.add(act, par, excl, attn)
            store(layer, m)
            return corrected(layer, par, act, attn)

        if want_loss:
            loss = loss_fn(plan, write)
        else:
            hooks = parallel_hooks(model, plan, write)
            loss = math.nan
            last = plan[-1]

            def stop(act: Tensor, hook: Any) -> None:
                raise _Stop

            try:
                ad.run_with_hooks(tokens, hooks + [(ad.hook_name(last, "resid_post"), stop)], return_type=None)
            except _Stop:
                pass
        return loss, gates, biases, lins, 1
    if fit == "sequential":
        for j, layer in enumerate(plan):
            m = moments()

            def write(lay: int, act: Tensor, par: Tensor, attn: Tensor, m: Moments = m, target: int = layer
                      ) -> Tensor:
                if lay == target:
                    m.add(act, par, excl, attn)
                    raise _Stop
                return corrected(lay, par, act, attn)

            hooks = parallel_hooks(model, plan[:j + 1], write)
            for sl in rows:
                try:
                    ad.run_with_hooks(tokens[sl], hooks, return_type=None)
                except _Stop:
                    pass
            passes += 1
            store(layer, m)
    else:  # joint: every layer from one forward of the uncorrected plan
        ms = {lay: moments() for lay in plan}

        def write(lay: int, act: Tensor, par: Tensor, attn: Tensor) -> Tensor:
            ms[lay].add(act, par, excl, attn)
            if lay == plan[-1]:
                raise _Stop
            return par.to(act.dtype)

        hooks = parallel_hooks(model, plan, write)
        for sl in rows:
            try:
                ad.run_with_hooks(tokens[sl], hooks, return_type=None)
            except _Stop:
                pass
        passes += 1
        for lay in plan:
            store(lay, ms[lay])
    loss = math.nan
    if want_loss:
        loss = loss_fn(plan, corrected_write(ad, plan, gates, biases, "refit", lins))
        passes += 1
    return loss, gates, biases, lins, passes


class RefitLoss(PlanLoss):
    """:class:`~tl_steering.parallel.gold.PlanLoss` of the corrected plans: ``loss(layers)`` fits the
    corrections of that plan on these windows and returns the corrected mean CE (memoised; :attr:`passes`
    counts every forward, fitting included). :meth:`corrections` gives the fitted ``(gates, biases)``, fitted on
    all the windows.

    ``crossfit`` (default: on for ``refit="linear"`` only, given at least 2 windows): the loss of a plan is measured out of fold: the windows
    are split in two halves, the corrections fitted on each half are applied to the other, and the two halves'
    CE are averaged (token-weighted). An in-sample loss rewards a correction that fits the calibration windows'
    noise: a ``[d_model, d_model]`` map per layer fitted on a few hundred tokens can push a plan's calibration
    loss below the clean model's while its held-out loss grows, and a planner that compares in-sample losses
    picks exactly those plans. Cost: one fitting pass more per plan (the fits do not ride in the measuring
    forward)."""

    def __init__(self, model: Any, tokens: Tensor, batch_size: int = 8, world: Any = None, refit: str = "affine",
                 fit: str = "sequential", share_prefix: bool = True, crossfit: bool | None = None,
                 carry: bool = False):
        super().__init__(model, tokens, batch_size, world, share_prefix)
        _check(refit, fit)
        self.refit, self.fit = refit, fit
        #: fit the correction these windows carry (:func:`fit_corrections`'s ``carry``)
        self.carry = bool(carry)
        self.fitted: dict[tuple[int, ...], tuple[dict[int, float], dict[int, Tensor], dict[int, Tensor]]] = {}
        # default: on for "linear" when there are two windows to split (one window: in-sample, as the others)
        self.crossfit = (refit == "linear" and int(tokens.shape[0]) >= 2) if crossfit is None else bool(crossfit)
        #: passes of the fits on all the windows that no measurement ran (the stored corrections of a cross-fitted
        #: loss, or of a plan measured on another rank)
        self.fit_passes = 0
        self._folds: list[RefitLoss] | None = None
        if self.crossfit and refit != "none":
            n = int(tokens.shape[0])
            if n < 2:
                raise InputError("a cross-fitted refit needs at least 2 calibration windows (it fits on one half "
                                 "and measures on the other): pass more windows, or crossfit=False")
            h = (n + 1) // 2
            self._folds = [RefitLoss(model, tokens[:h], batch_size, None, refit, fit, share_prefix, crossfit=False,
                                     carry=carry),
                           RefitLoss(model, tokens[h:], batch_size, None, refit, fit, share_prefix, crossfit=False,
                                     carry=carry)]

    def _measure(self, key: tuple[int, ...]) -> Tensor:
        plan = [lay for lay in key if not self.ad.is_parallel(lay)]
        if self._folds is not None and plan:
            first, second = self._folds
            # the fits of each half applied to the other half; the blocks in window order (first half, second)
            g1, b1, w1 = first._fitted(key)
            g2, b2, w2 = second._fitted(key)
            on_second = second.ce_blocks(key, corrected_write(self.ad, list(key), g1, b1, "RefitLoss", w1))
            on_first = first.ce_blocks(key, corrected_write(self.ad, list(key), g2, b2, "RefitLoss", w2))
            return torch.cat([on_first, on_second])
        w: dict[int, Tensor] = {}
        out: dict[str, Tensor] = {}

        def loss_fn(layers: Sequence[int], write: Any) -> float:
            out["blocks"] = self.ce_blocks(layers, write)
            return self.mean_of(out["blocks"])

        _, g, b, _ = corrected_loss(self.model, self.tokens, list(key), self.refit, self.fit,
                                    self.batch_size, loss_fn=loss_fn, linears=w, carry=self.carry)
        self.fitted[key] = (g, b, w)
        return out["blocks"]

    def _cost(self, key: tuple[int, ...]) -> int:
        plan = [lay for lay in key if not self.ad.is_parallel(lay)]
        if self.refit == "none" or not plan:
            return 1
        if self._folds is not None:  # per half: its fitting passes, then one measuring pass
            one_batch = all(f.tokens.shape[0] <= self.batch_size for f in self._folds)
            return (1 if one_batch or self.fit == "joint" else len(plan)) + 1
        if self.fit == "joint":
            return 2
        return 1 if self.tokens.shape[0] <= self.batch_size else len(plan) + 1

    def corrections(self, layers: Sequence[int]) -> tuple[dict[int, float], dict[int, Tensor]]:
        """``(gates, biases)`` fitted for the plan ``layers`` (see :meth:`linear_maps` for ``refit="linear"``)."""
        g, b, _ = self._fitted(layers)
        return g, b

    def linear_maps(self, layers: Sequence[int]) -> dict[int, Tensor]:
        """``{layer: W}`` of ``refit="linear"`` for the plan ``layers`` (empty for the other refits)."""
        return self._fitted(layers)[2]

    def _fitted(self, layers: Sequence[int]) -> tuple[dict[int, float], dict[int, Tensor], dict[int, Tensor]]:
        key = self._key(layers)
        if key not in self.fitted:  # measured on another rank: refit here (deterministic)
            w: dict[int, Tensor] = {}
            g, b, passes = fit_corrections(self.model, self.tokens, list(key), self.refit, self.fit,
                                           self.batch_size, linears=w, carry=self.carry)
            self.fit_passes += passes
            self.fitted[key] = (g, b, w)
        return self.fitted[key]


class FittedLoss(PlanLoss):
    """Mean CE of the corrected plans on other (held-out) windows, with the corrections ``source`` (a
    :class:`RefitLoss` on the calibration windows) fitted for each plan: nothing is fitted on these windows."""

    def __init__(self, model: Any, tokens: Tensor, batch_size: int = 8, world: Any = None, *, source: RefitLoss,
                 share_prefix: bool = True):
        super().__init__(model, tokens, batch_size, world, share_prefix)
        self.source = source

    def _measure(self, key: tuple[int, ...]) -> Tensor:
        gates, biases, lins = self.source._fitted(key)
        return self.ce_blocks(key, corrected_write(self.ad, list(key), gates, biases, "FittedLoss", lins))


__all__ = ["FITS", "FittedLoss", "Fit", "LINEAR_RIDGE", "Moments", "REFITS", "Refit", "RefitLoss", "CARRY", "carried_max_df", "carried_refit",
           "corrected_loss", "fit_corrections", "refit_parameters", "ridge_df", "ridge_for_df",
           "solve_correction"]
