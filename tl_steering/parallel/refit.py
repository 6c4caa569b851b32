"""Closed-form corrections of the parallel FFN writes, fitted on calibration windows (``refit=``; docs/parallel.md,
"Refit" and "Uncertainty and the choice")."""

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..backends import adapt
from ..backends.fused import corrected_ffn_write
from ..data.sharding import batch_slices
from ..errors import InputError
from ..hooks import corrected_write, parallel_hooks
from ..stats import Moments
from ..validation import as_choice
from .gold import PlanLoss

REFITS: tuple[str, ...] = ("none", "gate", "affine", "linear")
CARRY = 0.5
"""Effective parameters per output coordinate a correction compared in-sample may have, per fitted token."""
_EXCLUDED = (0,)  # the positions no correction is fitted on (docs/parallel.md "Refit")


def carried_max_df(n_tokens: int, d_model: int) -> float:
    """The largest effective degrees of freedom of the linear map per output coordinate that ``n_tokens`` carry:
    ``CARRY x n - 1 - 1/d`` (the intercept b and the shared gate g take the rest), at least 0."""
    return max(0.0, CARRY * int(n_tokens) - 1.0 - 1.0 / int(d_model))


def carried_refit(refit: str, n_tokens: int, d_model: int) -> str:
    """The richest correction, no richer than ``refit``, that ``n_tokens`` fitted tokens carry in-sample (at most
    :data:`CARRY` per token and coordinate; docs/parallel.md "Uncertainty and the choice")."""
    for cand in reversed(REFITS[:REFITS.index(refit) + 1]):
        per_coordinate = {"none": 0.0, "gate": 1.0 / d_model}.get(cand, 1.0 + 1.0 / d_model)
        if per_coordinate <= CARRY * int(n_tokens):
            return cand
    return "none"


class _Stop(Exception):
    """Ends a fitting forward after the last layer it needs (hooks are removed by ``run_with_hooks``)."""


def _stop(act: Tensor, hook: Any) -> None:
    raise _Stop


def fit_corrections(model: Any, tokens: Tensor, layers: Sequence[int], refit: str = "affine", batch_size: int = 8,
                    linears: dict[int, Tensor] | None = None, carry: bool = False
                    ) -> tuple[dict[int, float], dict[int, Tensor], int]:
    """``(gates, biases, passes)``: the corrections of the parallel plan ``layers`` fitted on ``tokens``, each layer on
    the forward that runs the corrected layers before it, and the forwards run (docs/parallel.md "Refit");
    ``linears``, required for ``refit="linear"``, receives the maps; ``carry``: the ridge of :func:`carried_max_df`."""
    _, g, b, passes = _fit(model, tokens, layers, refit, batch_size, None, linears, carry)
    return g, b, passes


class _Fitter:
    """The fitted corrections of one plan, layer by layer: :meth:`fit` solves a layer's moments, :meth:`write`
    applies the corrections fitted so far (``write(layer, sequential, parallel, attn)`` of ``parallel_hooks``)."""

    def __init__(self, ad: Any, refit: str, carry: bool, linears: dict[int, Tensor]):
        self.ad, self.refit, self.carry, self.linears = ad, refit, carry, linears
        self.gates: dict[int, float] = {}
        self.biases: dict[int, Tensor] = {}

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
         measure: Callable[[list[int], Any], Any] | None,
         linears_out: dict[int, Tensor] | None, carry: bool) -> tuple[Any, dict[int, float], dict[int, Tensor], int]:
    """The sequential fit; with ``measure(plan, write)`` (``PlanLoss.ce_blocks``) also what it measures on the
    corrected plan, on one batch in the fitting forward itself."""
    as_choice(refit, "refit", REFITS)
    if refit == "linear" and linears_out is None:
        raise InputError('refit="linear" fits a [d_model, d_model] map per layer: pass a dict as linears= to '
                         "receive them (or use RefitLoss / plan_parallel, which keep them)")
    ad = adapt(model)
    plan = [lay for lay in sorted(set(int(x) for x in layers)) if not ad.is_parallel(lay)]
    lins: dict[int, Tensor] = linears_out if linears_out is not None else {}
    lins.clear()
    fitter = _Fitter(ad, refit, carry, lins)
    if refit == "none" or not plan:
        return (measure(plan, None) if measure else None), fitter.gates, fitter.biases, int(measure is not None)
    rows = batch_slices(tokens.shape[0], batch_size)
    if len(rows) == 1:  # one forward: each hook fits its layer on the batch and applies it at once
        def write(layer: int, act: Tensor, par: Tensor, attn: Tensor) -> Tensor:
            m = fitter.moments()
            m.add(act, par, _EXCLUDED, attn)
            fitter.fit(layer, m)
            return fitter.write(layer, act, par, attn)

        # without a measure: one forward, stopped after the plan's last layer
        stop = [(ad.hook_name(plan[-1], "resid_post"), _stop)]
        run = measure or (lambda p, w: _run_stopped(ad, tokens, [slice(None)], parallel_hooks(model, p, w) + stop))
        return run(plan, write), fitter.gates, fitter.biases, 1
    for j, layer in enumerate(plan):  # one early-stopped forward per layer, the layers before it corrected
        m = fitter.moments()

        def write(lay: int, act: Tensor, par: Tensor, attn: Tensor, m: Moments = m, target: int = layer) -> Tensor:
            if lay == target:
                m.add(act, par, _EXCLUDED, attn)
                raise _Stop
            return fitter.write(lay, act, par, attn)

        _run_stopped(ad, tokens, rows, parallel_hooks(model, plan[:j + 1], write))
        fitter.fit(layer, m)
    if measure is None:
        return None, fitter.gates, fitter.biases, len(plan)
    out = measure(plan, corrected_write(ad, plan, fitter.gates, fitter.biases, "refit", lins))
    return out, fitter.gates, fitter.biases, len(plan) + 1


def _run_stopped(ad: Any, tokens: Tensor, rows: list[slice], hooks: list) -> None:
    """Run ``hooks`` over each of the ``rows`` of ``tokens`` until a hook raises :class:`_Stop`."""
    for sl in rows:
        try:
            ad.run_with_hooks(tokens[sl], hooks, return_type=None)
        except _Stop:
            pass


class RefitLoss(PlanLoss):
    """:class:`~tl_steering.parallel.gold.PlanLoss` of the corrected plans, each fitted on these windows (:attr:`passes`
    counts the fits); ``crossfit`` (default: for ``refit="linear"`` on 2+ windows): each half's fit measured on the
    other half (docs/parallel.md "Refit")."""

    shared = False  # a plan's block sums depend on its fit too

    def __init__(self, model: Any, tokens: Tensor, batch_size: int = 8, world: Any = None, refit: str = "affine",
                 share_prefix: bool = True, crossfit: bool | None = None, carry: bool = False):
        super().__init__(model, tokens, batch_size, world, share_prefix)
        self.refit, self.carry = as_choice(refit, "refit", REFITS), bool(carry)
        self._fits: dict[tuple[int, ...], tuple[dict[int, float], dict[int, Tensor], dict[int, Tensor]]] = {}
        self.crossfit = (refit == "linear" and int(tokens.shape[0]) >= 2) if crossfit is None else bool(crossfit)
        #: passes of the fits on all the windows that no measurement ran (cross-fitted, or measured on another rank)
        self.fit_passes = 0
        self._folds: list[RefitLoss] | None = None
        if self.crossfit and refit != "none":
            n = int(tokens.shape[0])
            if n < 2:
                raise InputError("a cross-fitted refit needs at least 2 calibration windows (it fits on one half "
                                 "and measures on the other): pass more windows, or crossfit=False")
            halves = (slice(0, (n + 1) // 2), slice((n + 1) // 2, n))
            self._folds = [RefitLoss(model, tokens[rows], batch_size, None, refit, share_prefix, False, carry)
                           for rows in halves]
            for fold, rows in zip(self._folds, halves):  # a fold's clean prefix: its rows of this one's
                fold.prefix_of = (self, rows)

    def _measure(self, key: tuple[int, ...]) -> Tensor:
        if self._folds is not None and any(not self.ad.is_parallel(lay) for lay in key):
            first, second = self._folds  # the fits of each half applied to the other; blocks in window order
            (g1, b1, w1), (g2, b2, w2) = first.fitted(key), second.fitted(key)
            on_second = second.ce_blocks(key, corrected_write(self.ad, list(key), g1, b1, "RefitLoss", w1))
            on_first = first.ce_blocks(key, corrected_write(self.ad, list(key), g2, b2, "RefitLoss", w2))
            return torch.cat([on_first, on_second])
        w: dict[int, Tensor] = {}
        blocks, g, b, _ = _fit(self.model, self.tokens, list(key), self.refit, self.batch_size, self.ce_blocks,
                               w, self.carry)
        self._fits[key] = (g, b, w)
        return blocks

    def cost_of(self, layers: Sequence[int]) -> int:
        plan = [lay for lay in self._key(layers) if not self.ad.is_parallel(lay)]
        if self.refit == "none" or not plan:
            return 1
        if self._folds is not None:  # per half: its fitting passes, then one measuring pass
            return (1 if all(f.tokens.shape[0] <= self.batch_size for f in self._folds) else len(plan)) + 1
        return 1 if self.tokens.shape[0] <= self.batch_size else len(plan) + 1

    def fitted(self, layers: Sequence[int]) -> tuple[dict[int, float], dict[int, Tensor], dict[int, Tensor]]:
        """``(gates, biases, linears)`` fitted for the plan ``layers`` on all these windows (``linears`` empty unless
        ``refit="linear"``)."""
        key = self._key(layers)
        if key not in self._fits:  # cross-fitted, or measured on another rank: fit here (deterministic)
            w: dict[int, Tensor] = {}
            g, b, passes = fit_corrections(self.model, self.tokens, list(key), self.refit, self.batch_size,
                                           linears=w, carry=self.carry)
            self.fit_passes += passes
            self._fits[key] = (g, b, w)
        return self._fits[key]


class FittedLoss(PlanLoss):
    """Mean CE of the corrected plans on other (held-out) windows, with the corrections ``source`` (a
    :class:`RefitLoss` on the calibration windows) fitted for each plan: nothing is fitted on these windows."""

    shared = False

    def __init__(self, model: Any, tokens: Tensor, batch_size: int = 8, world: Any = None, *, source: RefitLoss,
                 share_prefix: bool = True):
        super().__init__(model, tokens, batch_size, world, share_prefix)
        self.source = source

    def _measure(self, key: tuple[int, ...]) -> Tensor:
        gates, biases, lins = self.source.fitted(key)
        return self.ce_blocks(key, corrected_write(self.ad, list(key), gates, biases, "FittedLoss", lins))


__all__ = ["CARRY", "FittedLoss", "REFITS", "RefitLoss", "carried_max_df", "carried_refit", "fit_corrections"]
