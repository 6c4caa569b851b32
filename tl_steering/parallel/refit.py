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
from ..stats import Moments, check_exclude_positions
from .gold import PlanLoss

#: ``loss_fn(plan, write)``: mean CE on the fitting windows with ``plan`` parallel, FFN writes from ``write``
LossFn = Callable[[Sequence[int], Any], float]

Refit = Literal["none", "gate", "affine", "linear"]
REFITS: tuple[str, ...] = ("none", "gate", "affine", "linear")


def refit_parameters(refit: str, d_model: int) -> int:
    """Fitted numbers per layer of a correction: 0 (``"none"``), 1 (``"gate"``: g), d + 1 (``"affine"``: g, b),
    d^2 + d + 1 (``"linear"``: g, b, W)."""
    _check(refit)
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


def _check(refit: str) -> None:
    if refit not in REFITS:
        raise InputError(f"refit must be one of {list(REFITS)}, got {refit!r}")


class _Stop(Exception):
    """Ends a fitting forward after the last layer it needs (hooks are removed by ``run_with_hooks``)."""


def fit_corrections(
    model: Any,
    tokens: Tensor,
    layers: Sequence[int],
    refit: Refit = "affine",
    batch_size: int = 8,
    exclude_positions: Sequence[int] = (0,),
    linears: dict[int, Tensor] | None = None,
    carry: bool = False,
) -> tuple[dict[int, float], dict[int, Tensor], int]:
    """Fit the corrections of the parallel plan ``layers`` on ``tokens``, each layer on the forward that runs the
    corrected layers before it (docs/parallel.md "Refit").

    Returns ``(gates, biases, passes)``: ``{layer: g}``, ``{layer: b}`` (float64 ``[d_model]``; empty for
    ``"none"``/``"gate"``) for :func:`tl_steering.hooks.parallel_blocks`, and the forwards run (an early-stopped
    one counts as one). ``linears``: a dict that receives ``{layer: W}`` (float64 ``[d_model, d_model]``) of
    ``refit="linear"`` (``parallel_blocks(..., linears=)``); required for that refit. ``carry``: cap each linear
    map's effective degrees of freedom at :func:`carried_max_df` of its fitted tokens (the ridge raised as needed:
    the fit a few tokens carry, :func:`carried_refit`).
    """
    _, g, b, passes = _fit(model, tokens, layers, refit, batch_size, exclude_positions, None, linears, carry)
    return g, b, passes


def corrected_loss(
    model: Any,
    tokens: Tensor,
    layers: Sequence[int],
    refit: Refit = "affine",
    batch_size: int = 8,
    exclude_positions: Sequence[int] = (0,),
    loss_fn: LossFn | None = None,
    linears: dict[int, Tensor] | None = None,
    carry: bool = False,
) -> tuple[float, dict[int, float], dict[int, Tensor], int]:
    """Fit on ``tokens`` and return ``(mean CE of the corrected plan on the same tokens, gates, biases, passes)``
    (one pass in all on one batch: the fit rides in the measuring forward). ``loss_fn(plan, write)``: the mean CE
    on ``tokens`` with ``plan`` parallel and its FFN writes given by ``write`` (as
    :func:`tl_steering.hooks.parallel_hooks`); default a hooked forward per batch (:class:`RefitLoss` passes its
    prefix-sharing ``PlanLoss.mean_ce``). ``linears``, ``carry``: as in :func:`fit_corrections`."""
    if loss_fn is None:  # a whole hooked forward per batch
        loss_fn = PlanLoss(model, tokens, batch_size, share_prefix=False).mean_ce
    return _fit(model, tokens, layers, refit, batch_size, exclude_positions, loss_fn, linears, carry)


class _Fitter:
    """The fitted corrections of one plan, layer by layer: :meth:`fit` solves a layer's moments, :meth:`write`
    applies the corrections fitted so far (``write(layer, sequential, parallel, attn)`` of ``parallel_hooks``)."""

    def __init__(self, ad: Any, refit: str, carry: bool, linears: dict[int, Tensor]):
        self.ad, self.refit, self.carry = ad, refit, carry
        self.gates: dict[int, float] = {}
        self.biases: dict[int, Tensor] = {}
        self.linears = linears

    def moments(self) -> Moments:
        return Moments(self.ad.d_model, self.ad.device, linear=self.refit == "linear")

    def fit(self, layer: int, m: Moments) -> None:
        if self.refit == "linear":
            g, b, w = m.solve_linear(max_df=carried_max_df(m.n, self.ad.d_model) if self.carry else None)
            self.linears[layer] = w.cpu()
        else:
            g, b = m.solve(self.refit)
        self.gates[layer] = g
        if self.refit in ("affine", "linear"):
            self.biases[layer] = b.cpu()

    def write(self, layer: int, act: Tensor, par: Tensor, attn: Tensor) -> Tensor:
        return corrected_ffn_write(par, self.gates[layer], self.biases.get(layer), self.linears.get(layer), attn,
                                   act.dtype)


def _fit(model: Any, tokens: Tensor, layers: Sequence[int], refit: str, batch_size: int,
         exclude_positions: Sequence[int], loss_fn: LossFn | None, linears_out: dict[int, Tensor] | None,
         carry: bool) -> tuple[float, dict[int, float], dict[int, Tensor], int]:
    """The sequential fit of :func:`fit_corrections` (``loss_fn`` None) or :func:`corrected_loss`."""
    _check(refit)
    if refit == "linear" and linears_out is None:
        raise InputError('refit="linear" fits a [d_model, d_model] map per layer: pass a dict as linears= to '
                         "receive them (or use RefitLoss / plan_parallel, which keep them)")
    ad = adapt(model)
    excl = check_exclude_positions(exclude_positions)
    plan = [lay for lay in sorted(set(int(x) for x in layers)) if not ad.is_parallel(lay)]
    lins: dict[int, Tensor] = linears_out if linears_out is not None else {}
    lins.clear()
    fitter = _Fitter(ad, refit, carry, lins)
    if refit == "none" or not plan:
        loss = loss_fn(plan, None) if loss_fn is not None else math.nan
        return loss, fitter.gates, fitter.biases, int(loss_fn is not None)
    rows = batch_slices(tokens.shape[0], batch_size)
    if len(rows) == 1:  # one forward: each hook fits its layer on the batch and applies it at once
        def write(layer: int, act: Tensor, par: Tensor, attn: Tensor) -> Tensor:
            m = fitter.moments()
            m.add(act, par, excl, attn)
            fitter.fit(layer, m)
            return fitter.write(layer, act, par, attn)

        if loss_fn is not None:
            return loss_fn(plan, write), fitter.gates, fitter.biases, 1
        _run_stopped(ad, tokens, [slice(None)], parallel_hooks(model, plan, write), plan[-1])
        return math.nan, fitter.gates, fitter.biases, 1
    for j, layer in enumerate(plan):  # one early-stopped forward per layer, the layers before it corrected
        m = fitter.moments()

        def write(lay: int, act: Tensor, par: Tensor, attn: Tensor, m: Moments = m, target: int = layer) -> Tensor:
            if lay == target:
                m.add(act, par, excl, attn)
                raise _Stop
            return fitter.write(lay, act, par, attn)

        _run_stopped(ad, tokens, rows, parallel_hooks(model, plan[:j + 1], write), None)
        fitter.fit(layer, m)
    if loss_fn is None:
        return math.nan, fitter.gates, fitter.biases, len(plan)
    loss = loss_fn(plan, corrected_write(ad, plan, fitter.gates, fitter.biases, "refit", lins))
    return loss, fitter.gates, fitter.biases, len(plan) + 1


def _run_stopped(ad: Any, tokens: Tensor, rows: list[slice], hooks: list, last: int | None) -> None:
    """Run ``hooks`` over the ``rows`` of ``tokens`` until a hook raises :class:`_Stop` (with ``last``: after that
    layer's ``resid_post``)."""
    if last is not None:
        def stop(act: Tensor, hook: Any) -> None:
            raise _Stop

        hooks = hooks + [(ad.hook_name(last, "resid_post"), stop)]
    for sl in rows:
        try:
            ad.run_with_hooks(tokens[sl], hooks, return_type=None)
        except _Stop:
            pass


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
                 share_prefix: bool = True, crossfit: bool | None = None, carry: bool = False):
        super().__init__(model, tokens, batch_size, world, share_prefix)
        _check(refit)
        self.refit = refit
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
            self._folds = [RefitLoss(model, tokens[:h], batch_size, None, refit, share_prefix, crossfit=False,
                                     carry=carry),
                           RefitLoss(model, tokens[h:], batch_size, None, refit, share_prefix, crossfit=False,
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

        _, g, b, _ = corrected_loss(self.model, self.tokens, list(key), self.refit, self.batch_size, loss_fn=loss_fn, linears=w, carry=self.carry)
        self.fitted[key] = (g, b, w)
        return out["blocks"]

    def _cost(self, key: tuple[int, ...]) -> int:
        plan = [lay for lay in key if not self.ad.is_parallel(lay)]
        if self.refit == "none" or not plan:
            return 1
        if self._folds is not None:  # per half: its fitting passes, then one measuring pass
            one_batch = all(f.tokens.shape[0] <= self.batch_size for f in self._folds)
            return (1 if one_batch else len(plan)) + 1
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
            g, b, passes = fit_corrections(self.model, self.tokens, list(key), self.refit, self.batch_size, linears=w, carry=self.carry)
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


__all__ = ["CARRY", "FittedLoss", "REFITS", "Refit", "RefitLoss", "carried_max_df", "carried_refit", "corrected_loss",
           "fit_corrections", "refit_parameters"]
