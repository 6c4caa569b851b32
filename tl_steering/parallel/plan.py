"""The one planner, :func:`plan_parallel`: plans chosen on calibration windows, reported on held-out windows
(docs/parallel.md "Planning"), measured by one oracle (:mod:`.gold`, :mod:`.refit`)."""

import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..backends.ownership import exclusive
from ..data.sharding import broadcast_from_rank0
from ..data.windows import model_tokens
from ..errors import InputError
from ..stats import block_sums, cluster_bootstrap_ci
from ..validation import as_choice, as_choices, as_int
from . import strategies as st
from .gold import PlanLoss, delta_curves
from .plan_result import ParallelPlan
from .refit import REFITS, FittedLoss, RefitLoss, carried_max_df, carried_refit
from .scores import parallel_scores
from .strategies import FISHER_SAMPLES, PLANNER, STRATEGIES

PLAN_STRATEGIES: tuple[str, ...] = tuple(STRATEGIES)
"""Every strategy :func:`plan_parallel` knows (the keys of :data:`~tl_steering.parallel.strategies.STRATEGIES`)."""
INTERVAL_LEVEL = 0.95
"""Coverage of every interval a plan reports (two-stage bootstrap over windows and token blocks)."""
N_BOOTSTRAP = 1000
"""Resamples of every interval (:func:`tl_steering.stats.cluster_bootstrap_ci`, seeded by the call's ``seed``)."""


@exclusive
def plan_parallel(model: Any, tokens: Int[Tensor, "batch pos"], k: int,
                  strategy: str | Sequence[str] = "best", held_out: Int[Tensor, "batch2 pos2"] | None = None,
                  layers: Sequence[int] | None = None, k_values: Sequence[int] | None = None,
                  refit: str = PLANNER.refit, fisher_samples: int = FISHER_SAMPLES, seed: int = 0,
                  batch_size: int = 8, world: Any = None) -> ParallelPlan:
    """Choose k layers to make parallel on calibration windows; report the loss on held-out windows: a
    :class:`ParallelPlan`, its layers, fitted correction and every figure with its 95 % interval (the arguments in
    docs/parallel.md "Planning"; "Refit", "Uncertainty and the choice")."""
    t0 = time.perf_counter()
    ctx = PlanContext(model, tokens, k, strategy, held_out, layers, k_values, refit, fisher_samples, seed,
                      batch_size, world)
    sets, costs = {}, {}
    for name in ctx.names:
        t1 = time.perf_counter()
        sets[name], costs[name] = STRATEGIES[name](ctx, ctx.ks)
        costs[name]["seconds"] = time.perf_counter() - t1
    figures = _figures(ctx, sets)
    chosen, choice = _choose(ctx, sets, figures)
    return _result(ctx, sets, costs, figures, chosen, choice, time.perf_counter() - t0)


class PlanContext:
    """One :func:`plan_parallel` call, its arguments checked: the windows, the losses (``loss``: the calibration
    oracle) and what the strategies read (``candidates``, ``score_of(name)``: :func:`parallel_scores`, once)."""

    def __init__(self, model: Any, tokens: Any, k: Any, strategy: Any, held_out: Any, layers: Any, k_values: Any,
                 refit: Any, fisher_samples: Any, seed: int, batch_size: int, world: Any):
        self.model, self.seed, self.batch_size, self.world = model, seed, batch_size, world
        self.ad, self.cal, self.corpus = model_tokens(model, tokens)
        self.held_given, n = held_out is not None, int(self.cal.shape[0])
        if self.held_given:
            self.held = model_tokens(self.ad, held_out)[1]
        elif n < 2:
            raise InputError("plan_parallel needs held-out windows: pass held_out=, or at least 2 token windows "
                             "(the first half calibrates, the second half is held out)")
        else:
            self.cal, self.held = self.cal[:n - n // 2], self.cal[n - n // 2:]
        self.sel = self.ad.layers(layers)
        self.candidates = [lay for lay in self.sel if not self.ad.is_parallel(lay)]
        already = [lay for lay in self.sel if self.ad.is_parallel(lay)]
        self.k = st.check_k(k, len(self.candidates), already)
        self.names, self.requested = _names(strategy, fisher_samples)
        as_choice(refit, "refit", REFITS)
        if k_values is None:
            k_values = [0] if strategy == "best" else [j for j in st.default_k_values(len(self.candidates))
                                                       if j <= self.k]
        self.ks = sorted({st.check_k(int(j), len(self.candidates), already) for j in k_values} | {self.k})
        self.refit_requested = refit
        self.refit, self.note, self.carry = _carried(self.ad, self.cal, refit)
        self.fisher_samples = fisher_samples if "attribution_2nd" in self.names else 0
        self.scores = None
        if self.refit == "none":
            self.loss, self.held_loss = PlanLoss(model, self.cal, batch_size, world), PlanLoss(model, self.held,
                                                                                              batch_size, world)
        else:
            self.loss = RefitLoss(model, self.cal, batch_size, world, refit=self.refit, carry=self.carry)
            self.held_loss = FittedLoss(model, self.held, batch_size, world, source=self.loss)

    def score_of(self, name: str) -> dict[int, float]:
        """``{layer: score}`` of the candidates on the calibration windows."""
        if self.scores is None:
            self.scores = broadcast_from_rank0(lambda: parallel_scores(
                self.model, self.cal, layers=self.sel, batch_size=self.batch_size,
                fisher_samples=self.fisher_samples, seed=self.seed), self.world)
        return self.scores.score_of(name)


def _names(strategy: Any, fisher_samples: Any) -> tuple[list[str], str]:
    """The strategies compared and the request recorded (``"best"`` or the one name)."""
    as_int(fisher_samples, "fisher_samples", minimum=0)
    if strategy == "best":
        names = [s for s in PLANNER.strategies if fisher_samples or s != "attribution_2nd"]
    elif len(set(names := as_choices(strategy, "strategy", PLAN_STRATEGIES))) < len(names):
        raise InputError(f"strategy {strategy!r} names a strategy twice: pass 'best', one of the strategies or a list "
                         "of distinct ones")
    if "attribution_2nd" in names and not fisher_samples:
        raise InputError("strategy attribution_2nd needs second-order scores: pass fisher_samples > 0")
    return names, ("best" if strategy == "best" or not isinstance(strategy, str) else strategy)


def _carried(ad: Any, cal: Tensor, refit: str) -> tuple[str, str, bool]:
    """``(the correction fitted, calibration_note, carry)``: with one calibration window, nothing is cross-fitted and
    the correction is the one its tokens carry (warned once)."""
    n_cal, n_fit = int(cal.shape[0]), int(cal.shape[0]) * (int(cal.shape[1]) - 1)  # fitted tokens: position 0 out
    if refit == "none" or n_cal >= 2:
        return refit, "", False
    fitted = carried_refit(refit, n_fit, ad.d_model)
    note = (f"{n_cal} calibration window ({n_fit} fitted tokens) is too small to cross-fit: plans compared on "
            f"in-sample (optimistic) calibration losses")
    if fitted == "linear":
        note += (f", each linear map's ridge raised to at most {carried_max_df(n_fit, ad.d_model):.1f} effective "
                 f"parameters per coordinate (half the tokens)")
    elif fitted != refit:
        note += f", the {fitted!r} correction fitted (what {n_fit} tokens carry) instead of {refit!r}"
    note += "; pass at least 2 calibration windows"
    warnings.warn(f"plan_parallel: {note}", UserWarning, stacklevel=5)
    return fitted, note, True


def _ci(loss: PlanLoss, cols: list[Tensor], seed: int) -> Tensor:
    """``[len(cols), 2]``: the intervals of per-block sums on ``loss``'s windows, resampled together."""
    counts = block_sums(torch.ones(loss.tokens.shape[0], loss.tokens.shape[1] - 1, dtype=torch.float64), loss.block)
    return cluster_bootstrap_ci(torch.stack(cols, -1), counts, N_BOOTSTRAP, seed, INTERVAL_LEVEL)


def _intervals(loss: PlanLoss, curves: dict[str, list[list[int]]], seed: int) -> dict[str, Tensor]:
    """``{name: [n_plans, 2]}`` float64: the intervals of every plan's dCE (:func:`_ci`)."""
    ci = _ci(loss, [loss.delta_blocks(p) for plans in curves.values() for p in plans], seed)
    return {name: part.clone() for name, part in zip(curves, ci.split([len(p) for p in curves.values()]))}


def _margins(loss: PlanLoss, plan_of: dict[str, list[int]], ref: str, seed: int) -> dict[str, list[float]]:
    """``{name: [point, low, high]}`` of ``loss``'s dCE of ``plan_of[name]`` minus that of ``plan_of[ref]``, the
    interval paired (the same windows and blocks resampled for both plans)."""
    base_blocks = loss.delta_blocks(plan_of[ref])
    ci = _ci(loss, [loss.delta_blocks(p) - base_blocks for p in plan_of.values()], seed)
    base = loss.delta(plan_of[ref])
    return {name: [loss.delta(p) - base, float(ci[i, 0]), float(ci[i, 1])] for i, (name, p) in enumerate(plan_of.items())}


def _figures(ctx: PlanContext, sets: dict[str, list[list[int]]]) -> dict[str, Any]:
    """Every strategy's dCE curves and intervals: calibration, held out, and held out uncorrected."""
    every = [[]] + [p for s in ctx.names for p in sets[s]]
    ctx.loss.prefetch(every)
    ctx.held_loss.prefetch(every)
    plain_held = ctx.held_loss if ctx.refit == "none" else PlanLoss(ctx.model, ctx.held, ctx.batch_size, ctx.world)
    plain_held.share_clean(ctx.held_loss)  # the same clean forward
    plain_cal = ctx.loss if ctx.refit == "none" else PlanLoss(ctx.model, ctx.cal, ctx.batch_size, ctx.world)
    plain_cal.share_clean(ctx.loss)
    out = {"cal": delta_curves(ctx.loss, sets), "held": delta_curves(ctx.held_loss, sets),
           "cal_iv": _intervals(ctx.loss, sets, ctx.seed), "held_iv": _intervals(ctx.held_loss, sets, ctx.seed),
           "held_unc": {}, "held_unc_iv": {}, "plain_cal": plain_cal, "plain_held": plain_held}
    if ctx.refit != "none":
        plain_held.prefetch(every)
        out["held_unc"], out["held_unc_iv"] = delta_curves(plain_held, sets), _intervals(plain_held, sets, ctx.seed)
    return out


def _choose(ctx: PlanContext, sets: dict[str, list[list[int]]], fig: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The strategy kept at k (:func:`~.strategies.choose`: the reference unless beaten beyond noise) and the
    record of the choice (reference, rule, margins)."""
    j = ctx.ks.index(ctx.k)
    selectable = [s for s in ctx.names if s != "random"] or ctx.names
    ref = PLANNER.reference if PLANNER.reference in selectable and len(selectable) > 1 else None
    at_k = {s: sets[s][j] for s in ctx.names}
    margins: dict[str, list[float]] = {}
    margins_unc: dict[str, list[float]] = {}
    if ref is not None:
        margins = _margins(ctx.loss, at_k, ref, ctx.seed)
        rule = (f"{ref} unless a strategy's calibration dCE is below it by more than the {INTERVAL_LEVEL:.0%} "
                f"interval of the paired difference (then the lowest of those)")
        if ctx.refit != "none" and not getattr(ctx.loss, "crossfit", False):  # in-sample: also without the fit
            fig["plain_cal"].prefetch(list(at_k.values()))
            margins_unc = _margins(fig["plain_cal"], at_k, ref, ctx.seed)
            rule += "; the corrections compared in-sample, so also without them"
    else:
        rule = "lowest calibration dCE" if len(selectable) > 1 else "the one strategy run"
    cal_at_k = {s: float(fig["cal"][s][j]) for s in selectable}
    chosen = st.choose(cal_at_k, selectable, ref, margins, margins_unc)
    return chosen, {"reference": ref or "", "choice_rule": rule, "margins": margins,
                    "margins_uncorrected": margins_unc}


def _corrections(ctx: PlanContext, layers: list[int], fig: dict[str, Any], chosen: str) -> dict[str, Any]:
    """The chosen plan's fitted correction (as tensors, in the order of ``layers``) and its uncorrected figures."""
    j = ctx.ks.index(ctx.k)
    f64, d = torch.float64, ctx.ad.d_model
    if ctx.refit == "none":
        g_of, b_of, w_of = {}, {}, {}
        unc = [float(fig["cal"][chosen][j]), float(fig["held"][chosen][j]), fig["cal_iv"][chosen][j].tolist(),
               fig["held_iv"][chosen][j].tolist()]
    else:
        g_of, b_of, w_of = ctx.loss.fitted(layers)
        plain_cal, plain_held = fig["plain_cal"], fig["plain_held"]
        plain_cal.prefetch([layers])
        plain_held.prefetch([layers])
        unc = [plain_cal.delta(layers), plain_held.delta(layers),
               _intervals(plain_cal, {"": [layers]}, ctx.seed)[""][0].tolist(),
               _intervals(plain_held, {"": [layers]}, ctx.seed)[""][0].tolist()]
    return {
        "gates": torch.tensor([g_of.get(lay, 1.0) for lay in layers], dtype=f64),
        "biases": torch.stack([b_of[lay].to(f64).cpu() if lay in b_of else torch.zeros(d, dtype=f64)
                               for lay in layers]) if layers else torch.zeros(0, d, dtype=f64),
        "linears": torch.stack([w_of[lay].to(f64).cpu() for lay in layers]) if layers and w_of
        else torch.zeros(0, 0, 0, dtype=f64),
        **dict(zip(("calibration_delta_ce_uncorrected", "held_out_delta_ce_uncorrected",
                    "calibration_delta_ce_uncorrected_interval", "held_out_delta_ce_uncorrected_interval"), unc))}


def _result(ctx: PlanContext, sets: dict[str, list[list[int]]], costs: dict[str, dict[str, float]],
            fig: dict[str, Any], chosen: str, choice: dict[str, Any], seconds: float) -> ParallelPlan:
    """The :class:`ParallelPlan` of a call: the chosen plan, its correction, every figure and the cost."""
    j = ctx.ks.index(ctx.k)
    layers = list(sets[chosen][j])
    corr = _corrections(ctx, layers, fig, chosen)
    plain = fig["plain_cal"].passes + fig["plain_held"].passes if ctx.refit != "none" else 0
    fresh = any(s in st.SCORE_STRATEGIES for s in ctx.names)  # one parallel_scores call on the calibration windows
    total = {"forward": float(ctx.loss.passes + ctx.held_loss.passes + (2 if fresh else 0) + plain
                              + getattr(ctx.loss, "fit_passes", 0)),
             "backward": float(1 + ctx.fisher_samples if fresh else 0), "seconds": seconds}
    crossfit = getattr(ctx.loss, "crossfit", False)
    options = {"k": ctx.k, "strategy": ctx.requested, "layers": ctx.sel, "k_values": ctx.ks, "strategies": ctx.names,
               "batch_size": ctx.batch_size, "fisher_samples": ctx.fisher_samples,
               "held_out": "given" if ctx.held_given else "second half of tokens", "refit": ctx.refit,
               "refit_crossfit": crossfit, "refit_requested": ctx.refit_requested, "reference": PLANNER.reference,
               "n_bootstrap": N_BOOTSTRAP, "refit_carry": ctx.carry}
    return ParallelPlan(
        provenance=ctx.ad.provenance(ctx.cal, corpus=ctx.corpus, seed=ctx.seed, **options),
        layers=layers, k=ctx.k, strategy=chosen, requested=ctx.requested, candidates=ctx.candidates,
        calibration_delta_ce=float(fig["cal"][chosen][j]), held_out_delta_ce=float(fig["held"][chosen][j]),
        clean_loss_calibration=ctx.loss.clean, clean_loss_held_out=ctx.held_loss.clean,
        cost=costs[chosen], total_cost=total, k_values=ctx.ks, strategies=ctx.names,
        calibration_curves=fig["cal"], held_out_curves=fig["held"], plans=sets, strategy_costs=costs,
        n_calibration=int(ctx.cal.shape[0]), n_held_out=int(ctx.held.shape[0]), options=options, refit=ctx.refit,
        held_out_curves_uncorrected=fig["held_unc"], refit_requested=ctx.refit_requested,
        calibration_fit="none" if ctx.refit == "none" else ("out-of-fold" if crossfit else "in-sample"),
        calibration_note=ctx.note, calibration_intervals=fig["cal_iv"], held_out_intervals=fig["held_iv"],
        held_out_intervals_uncorrected=fig["held_unc_iv"],
        calibration_delta_ce_interval=fig["cal_iv"][chosen][j].tolist(),
        held_out_delta_ce_interval=fig["held_iv"][chosen][j].tolist(), **choice, **corr,
        interval={"level": INTERVAL_LEVEL, "n_bootstrap": N_BOOTSTRAP, "seed": ctx.seed,
                  "block_tokens_calibration": ctx.loss.block, "block_tokens_held_out": ctx.held_loss.block,
                  "method": "two-stage percentile bootstrap: windows, then blocks of consecutive tokens in each"})


__all__ = ["INTERVAL_LEVEL", "N_BOOTSTRAP", "PLAN_STRATEGIES", "ParallelPlan", "PlanContext", "plan_parallel"]
