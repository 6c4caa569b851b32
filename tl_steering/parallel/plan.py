"""Parallel plans chosen on calibration windows, reported on held-out windows: :func:`plan_parallel`.

Strategies (see docs/parallel.md "Planning"; every one returns, for each k, a set of k sequential layers):

* one-shot by a score (``"C"``, ``"C1"``, ``"C_phi"``, ``"C_tan"`` [paper]; ``"attribution"``,
  ``"attribution_abs"``, ``"attribution_rms"``, ``"attribution_2nd"``, ``"attribution_fisher"``,
  ``"attribution_fisher_diag"`` [ours]; ``"block_influence"``, ``"angular_distance"``, ``"ffn_fusion"`` [the
  field's scores, :mod:`tl_steering.parallel.peers`]): the k lowest-scored layers (:func:`tl_steering.parallel_scores`);
* ``"measured"`` [ours]: the k layers of lowest measured single-layer calibration dCE (L + 1 forwards; taken
  from ``scores=`` when that result carries the gold, ``parallel_scores(..., gold=True)``);
* ``"greedy"`` [ours]: add, one at a time, the layer with the lowest ``attribution_abs`` (:data:`GREEDY_SCORE`)
  re-computed on the partly parallel model (one forward + backward per step);
* ``"greedy_measured"`` [ours, SLEB-style]: add, one at a time, the layer whose addition gives the lowest
  measured calibration loss, among the ``shortlist`` remaining layers ranked lowest by the one-shot
  :data:`SHORTLIST_SCORE` (``shortlist=None``: every remaining layer, SLEB proper: sum_{j<k} (L - j) forwards);
* ``"sleb"`` [SLEB, Song et al. 2024, arXiv:2402.09025]: ``"greedy_measured"`` with ``shortlist=None``
  whatever ``shortlist`` says (every remaining layer measured at every step);
* ``"contiguous"`` [ours]: the window of k consecutive candidate layers with the lowest measured
  calibration loss;
* ``"random"``: a seeded random k-set (a baseline, never chosen by ``"best"``).

``strategy="best"`` runs the strategies compared (default :data:`ONE_SHOT_COMPARISON` with the cross-fitted
linear correction; :data:`FULL_COMPARISON` by argument) and keeps the reference ``C`` unless a strategy's CALIBRATION
dCE at k beats it by more than the 95 % interval of the paired difference (then the lowest of those;
``reference=None``: the lowest); the held-out dCE is reported, never used to choose. Every dCE carries its interval
(two-stage bootstrap over windows and token blocks; docs/parallel.md "Uncertainty and the choice"). Greedy plans are nested (the k-plan extends the (k-1)-plan).
"""

import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..backends import adapt
from ..data.windows import token_source
from ..errors import InputError
from ..data.sharding import broadcast_from_rank0
from . import strategies as st
from .strategies import ONE_SHOT_COMPARISON
from .attribution import FISHER_VARIANTS, attribution_scores
from .gold import PlanLoss
from .peers import PEER_SCORES
from .plan_result import ParallelPlan
from .refit import FITS, REFITS, FittedLoss, RefitLoss, carried_max_df, carried_refit
from .scores import ParallelScoresResult, parallel_scores
from ..backends.ownership import exclusive
from ..stats import cluster_bootstrap_ci

SCORE_STRATEGIES: tuple[str, ...] = ("C", "C1", "C_phi", "C_tan", "attribution", "attribution_abs",
                                     "attribution_rms", "attribution_2nd", "attribution_fisher",
                                     "attribution_fisher_diag") + PEER_SCORES
"""One-shot strategies: the k layers with the lowest value of that score."""
PLAN_STRATEGIES: tuple[str, ...] = SCORE_STRATEGIES + ("measured", "greedy", "greedy_measured", "sleb",
                                                       "contiguous", "random")
"""Every strategy :func:`plan_parallel` knows."""
FULL_COMPARISON: tuple[str, ...] = ("C", "C1", "attribution", "attribution_abs", "attribution_2nd",
                                    "attribution_fisher", "measured", "greedy", "greedy_measured",
                                    "contiguous", "random") + PEER_SCORES
"""The searching comparison (``strategies=FULL_COMPARISON``; the default before issue 30): every one-shot
score, the measured / greedy / contiguous searches (hundreds of forwards) and the ``random`` baseline. ``"sleb"``
(hundreds more) is left to be asked for by name."""
DEFAULT_COMPARISON = FULL_COMPARISON  # the name before issue 30
GREEDY_SCORE = "attribution_abs"
"""The score the greedy planners re-compute. Not the signed first-order ``attribution``: on a trained model
the loss sits near a minimum, the first-order term of a large defect can even be negative (SmolLM2 layers 0
and 1: -0.24 / -0.12 nats predicted, +1.68 / +0.61 measured), so a signed greedy would pick the worst layers
first; the token-wise absolute value does not cancel and ranks damage far better (docs/defect.md). The
second-order scores are not re-computed per step (``fisher_samples`` more backwards each)."""
REFERENCE = "C"
"""The default reference of ``strategy="best"``: the paper's lowest-C plan. Another strategy is chosen only when it
beats the reference's calibration dCE by more than the interval of the paired difference (docs/parallel.md
"Uncertainty and the choice")."""
INTERVAL_LEVEL = 0.95
"""Coverage of every interval a plan reports (two-stage bootstrap over windows and token blocks)."""
SHORTLIST_SCORE = "attribution_2nd"
"""The one-shot score whose ranking gives ``greedy_measured`` its shortlist of layers to measure at each step
(the second-order loss change; docs/defect.md "Second order")."""


def _split(tokens: Tensor, held_out: Any) -> tuple[Tensor, Tensor]:
    if held_out is not None:
        return tokens, held_out
    n = tokens.shape[0]
    if n < 2:
        raise InputError("plan_parallel needs held-out windows: pass held_out=, or at least 2 token windows "
                         "(the first half calibrates, the second half is held out)")
    cut = n - n // 2
    return tokens[:cut], tokens[cut:]


@exclusive
def plan_parallel(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    k: int,
    strategy: str = "best",
    held_out: Int[Tensor, "batch2 pos2"] | None = None,
    layers: Sequence[int] | None = None,
    k_values: Sequence[int] | None = None,
    strategies: Sequence[str] | None = None,
    shortlist: int | None = 4,
    seed: int = 0,
    batch_size: int = 8,
    corpus: str | None = None,
    scores: ParallelScoresResult | None = None,
    fisher_samples: int = 8,
    world: Any = None,
    refit: str = "linear",
    refit_order: str = "sequential",
    refit_crossfit: bool | None = None,
    uncorrected_curves: bool = False,
    reference: str | None = REFERENCE,
    n_bootstrap: int = 1000,
) -> ParallelPlan:
    """Choose k layers to make parallel on calibration windows; report the loss on held-out windows.

    The default call, ``plan_parallel(model, tokens, k)``, is the best plan we measured held out (docs/parallel.md
    "Planners against the field"): the one-shot scores of :data:`ONE_SHOT_COMPARISON` compared by their
    cross-fitted calibration loss with the linear correction at k (``k_values=`` adds curve points). It costs one
    :func:`parallel_scores` call (2 forwards + 1 + ``fisher_samples`` = 9 backwards over the calibration windows)
    plus, per distinct plan of the curves, one fitting and one measuring pass over each half of the calibration
    windows, one fit on all of them and one held-out pass: 20 forwards + 9 backwards on SmolLM2 4 x 128 at k = 15
    (``total_cost`` says what a call ran). The uncorrected surrogate is ``refit="none"``; the searching comparison
    (hundreds of forwards) ``strategies=FULL_COMPARISON``.

    Args:
        model: a TransformerLens model; never modified, no hook or ``.grad`` left on it.
        tokens: calibration windows ``[batch, pos]`` (or a ``TokenWindows``). With ``held_out=None`` the first
            ``ceil(batch / 2)`` windows calibrate and the rest are held out.
        k: number of layers to make parallel, in ``[0, L]`` (L = sequential layers among ``layers``).
        strategy: ``"best"`` (run ``strategies``, keep ``reference`` unless beaten beyond noise at k) or one name of
            :data:`PLAN_STRATEGIES` (see the module docstring).
        held_out: held-out windows (never used to choose).
        layers: blocks that may be chosen (default all).
        k_values: k of the comparison curves (default: 0 and k for the default comparison, else
            :func:`default_k_values` up to k, and k).
        strategies: strategies compared by ``"best"`` (default :data:`ONE_SHOT_COMPARISON`, less the
            second-order scores with ``fisher_samples=0``).
        shortlist: candidates measured per greedy_measured step (``None``: all remaining; ``"sleb"`` always
            measures all).
        seed: seed of the ``random`` baseline and of the sampled labels of the second-order scores (every plan
            is deterministic for a seed; ties go to the lower layer).
        batch_size: sequences per forward pass.
        corpus: provenance label.
        scores: a :func:`parallel_scores` result computed on the SAME calibration windows and layers (saves
            its passes; its cost is then not counted again).
        fisher_samples: sampled-label backwards of the second-order scores (0: first-order scores only; the
            ``attribution_2nd`` / ``_fisher`` strategies then refuse).
        world: a :class:`tl_steering.data.sharding.World` (every rank calls, docs/scale_out.md): the measured plans
            (single layers, greedy_measured candidates, contiguous windows, every curve point) are split over the
            ranks, one pass per plan; the scores and the greedy re-scoring (forward + backward) run on rank 0 and
            are handed to the others, so every rank takes the same decisions; the same plan on every rank.
        refit: ``"linear"`` (default), ``"none"`` (the plain parallel surrogate), ``"gate"`` (g_l Phi(x)), ``"affine"``
            (g_l Phi(x) + b_l) or ``"linear"`` (g_l Phi(x) + b_l + a W_l, a the block's attention write, W_l a
            ridge-regularised ``[d_model, d_model]`` map; still parallel): closed-form corrections of the parallel
            FFN writes (:mod:`tl_steering.parallel.refit`) fitted on the calibration windows for every plan
            measured, so the measured strategies choose WITH the correction (greedy_measured re-fits at every candidate) and ``"best"`` compares corrected calibration
            dCE; the held-out dCE applies the calibration fit. The one-shot scores are those of the uncorrected
            surrogate. Costs nothing more with ``refit_order="sequential"`` and the calibration windows in one
            batch (the fit runs inside the measuring forward).
        refit_order: ``"sequential"`` (each layer fitted on the forward that runs the corrected layers before it)
            or ``"joint"`` (every layer from the uncorrected plan's forward; one more pass per plan).
        refit_crossfit: compare plans by their out-of-fold calibration loss (corrections fitted on one half of
            the calibration windows, measured on the other, both ways;
            :class:`~tl_steering.parallel.refit.RefitLoss`) instead of the in-sample one. Default (None): on for
            ``"linear"`` with at least 2 calibration windows (with one, in-sample: pass more windows) (whose d_model^2 entries per layer
            fit the calibration noise: in-sample, ``"best"`` picked a plan 0.09 nats BELOW the clean loss on
            calibration and 2x the lowest-C plan's loss held out on SmolLM2), off for the others. The stored
            corrections are then fitted on all the calibration windows, and ``calibration_delta_ce`` is the
            out-of-fold value.
        uncorrected_curves: with a refit, also measure every compared plan WITHOUT its correction on the
            held-out windows (:attr:`ParallelPlan.held_out_curves_uncorrected`; one held-out pass per distinct
            plan), so a table can show what the correction adds to every strategy.
        reference: the strategy ``"best"`` keeps unless another beats it (default ``"C"``, the paper's lowest-C
            plan): a competitor is chosen only when the upper end of the 95 % interval of its calibration dCE
            minus the reference's (paired, the same windows and token blocks resampled) is below zero; among
            those, and the reference, the lowest calibration dCE wins. ``None`` (or a reference not compared):
            the lowest calibration dCE, whatever the noise.
        n_bootstrap: resamples of the intervals (:func:`tl_steering.stats.cluster_bootstrap_ci`: windows, then
            blocks of ``round(T^(1/3))`` consecutive tokens inside each, T the predicted tokens per window; seeded
            by ``seed``). 0: NaN intervals, and ``"best"`` keeps the reference.

    With fewer than 2 calibration windows nothing can be cross-fitted: the plan records it
    (``calibration_fit="in-sample"``, ``calibration_note``), one warning says it, and (``refit_crossfit=None``)
    the correction is the richest the calibration tokens carry (:func:`~tl_steering.parallel.refit.carried_refit`:
    at most one parameter per two fitted numbers; one 32-token window on SmolLM2 carries ``"affine"``, not
    ``"linear"``), ``refit_requested`` keeping what was asked.

    Returns:
        A :class:`ParallelPlan`.
    """
    t0 = time.perf_counter()
    ad = adapt(model)
    tokens, corpus = token_source(tokens, corpus)
    if held_out is not None:
        held_out = token_source(held_out, None)[0]
        held_out = ad.validate_tokens(held_out)
    tokens = ad.validate_tokens(tokens)
    cal, held = _split(tokens, held_out)
    sel = ad.layers(layers)
    cand = [lay for lay in sel if not ad.is_parallel(lay)]
    already = [lay for lay in sel if ad.is_parallel(lay)]
    k = st.check_k(k, len(cand), already)
    if strategy == "best":
        names = list(strategies) if strategies is not None else [
            s for s in ONE_SHOT_COMPARISON if fisher_samples or s not in FISHER_VARIANTS]
    else:
        names = [strategy]
    unknown = [s for s in names if s not in PLAN_STRATEGIES]
    if unknown or not names:
        raise InputError(f"unknown strategy {unknown or names!r}; choose 'best' or one of {list(PLAN_STRATEGIES)}")
    if refit not in REFITS or refit_order not in FITS:
        raise InputError(f"refit must be one of {list(REFITS)} and refit_order one of {list(FITS)}; got "
                         f"{refit!r}, {refit_order!r}")
    if refit_crossfit is not None and not isinstance(refit_crossfit, bool):
        raise InputError(f"refit_crossfit must be True, False or None (on for refit='linear'), got "
                         f"{refit_crossfit!r}")
    if reference is not None and reference not in PLAN_STRATEGIES:
        raise InputError(f"reference must be None or a strategy of {list(PLAN_STRATEGIES)}, got {reference!r}")
    if isinstance(n_bootstrap, bool) or not isinstance(n_bootstrap, int) or n_bootstrap < 0:
        raise InputError(f"n_bootstrap must be an int >= 0, got {n_bootstrap!r}")
    if shortlist is not None and (isinstance(shortlist, bool) or not isinstance(shortlist, int) or shortlist < 1):
        raise InputError(f"shortlist must be a positive int or None, got {shortlist!r}")
    if k_values is None:
        k_values = [0] if strategy == "best" and strategies is None else \
            [j for j in st.default_k_values(len(cand)) if j <= k]
    ks = sorted({st.check_k(int(j), len(cand), already) for j in k_values} | {k})
    kmax = max(ks)
    refit_requested, note, carry = refit, "", False
    n_cal, n_fit = int(cal.shape[0]), int(cal.shape[0]) * (int(cal.shape[1]) - 1)  # fitted tokens: position 0 out
    if refit != "none" and n_cal < 2 and refit_crossfit is None:
        refit, carry = carried_refit(refit, n_fit, ad.d_model), True
        note = (f"{n_cal} calibration window ({n_fit} fitted tokens) is too small to cross-fit: plans compared on "
                f"in-sample (optimistic) calibration losses")
        if refit == "linear":
            note += (f", each linear map's ridge raised to at most {carried_max_df(n_fit, ad.d_model):.1f} effective "
                     f"parameters per coordinate (half the tokens)")
        elif refit != refit_requested:
            note += f", the {refit!r} correction fitted (what {n_fit} tokens carry) instead of {refit_requested!r}"
        note += "; pass at least 2 calibration windows"
        warnings.warn(f"plan_parallel: {note}", UserWarning, stacklevel=3)
    if refit == "none":
        cal_loss, held_loss = PlanLoss(model, cal, batch_size, world), PlanLoss(model, held, batch_size, world)
    else:
        cal_loss = RefitLoss(model, cal, batch_size, world, refit=refit, fit=refit_order, crossfit=refit_crossfit,
                             carry=carry)
        held_loss = FittedLoss(model, held, batch_size, world, source=cal_loss)

    costs: dict[str, dict[str, float]] = {}
    extra = {"passes": 0}  # attribution passes of the greedy steps after the first
    sets: dict[str, list[list[int]]] = {}
    need = any(s in SCORE_STRATEGIES or s.startswith("greedy") or s == "sleb" for s in names)
    given = scores is not None
    if given and (scores.layers != sel or scores.provenance.n_sequences != int(cal.shape[0])):
        raise InputError("scores= must come from parallel_scores on the same calibration windows and layers")
    # the sampled-label backwards only when a strategy uses a second-order score
    fisher_samples = fisher_samples if any(s in FISHER_VARIANTS or s == "greedy_measured" for s in names) else 0
    if need and not given:
        scores = broadcast_from_rank0(lambda: parallel_scores(model, cal, layers=sel, batch_size=batch_size,
                                                              fisher_samples=fisher_samples, seed=seed), world)
    missing = [s for s in names if s in SCORE_STRATEGIES and s not in scores.scores] if need else []
    if missing:
        raise InputError(f"strategies {missing} need second-order scores: pass fisher_samples > 0 (to "
                         f"parallel_scores when you give scores=)")
    for name in names:
        t1 = time.perf_counter()
        if name in SCORE_STRATEGIES:
            so = scores.score_of(name)
            sets[name] = [st.one_shot(cand, so, j) for j in ks]
            # C and the peers' scores come from parallel_defect's forward; the attribution scores from a backward
            n_bwd = 0.0 if name.startswith("C") or name in PEER_SCORES else \
                1.0 + (fisher_samples if name in FISHER_VARIANTS else 0.0)
            cost = {"forward": 1.0, "backward": n_bwd}
        elif name == "greedy":
            order, cost = _greedy(model, cal, sel, cand, kmax, scores.score_of(GREEDY_SCORE), batch_size, extra,
                                  world)
            sets[name] = [sorted(order[:j]) for j in ks]
        elif name in ("greedy_measured", "sleb"):
            rank_by = SHORTLIST_SCORE if SHORTLIST_SCORE in scores.scores else GREEDY_SCORE
            short = None if name == "sleb" else shortlist
            order, cost = _greedy_measured(cand, kmax, scores.score_of(rank_by), cal_loss, short)
            if short is not None:  # the ranking's own passes (1 forward, 1 + S backwards)
                cost = {"forward": cost["forward"] + 1.0,
                        "backward": 1.0 + (fisher_samples if rank_by in FISHER_VARIANTS else 0.0)}
            sets[name] = [sorted(order[:j]) for j in ks]
        elif name == "measured":  # the gold of scores= (same windows, parallel_scores(gold=True)) when given
            if scores is not None and scores.evaluated and refit == "none":
                pos = {lay: i for i, lay in enumerate(scores.layers)}
                single = {lay: float(scores.delta_ce[pos[lay]]) for lay in cand}
            else:
                cal_loss.prefetch([[]] + [[lay] for lay in cand])
                single = {lay: cal_loss([lay]) for lay in cand}
            sets[name] = [st.one_shot(cand, single, j) for j in ks]
            cost = {"forward": float(sum(cal_loss._cost((lay,)) for lay in cand) + 1), "backward": 0.0}
        elif name == "contiguous":
            n_eval = 0
            sets[name] = []
            cal_loss.prefetch([[]] + [w for j in ks for w in st.windows(cand, j)])
            for j in ks:
                wins = st.windows(cand, j)
                vals = {i: cal_loss(w) for i, w in enumerate(wins)}
                n_eval += sum(cal_loss._cost(tuple(w)) for w in wins)
                sets[name].append(wins[min(vals, key=lambda i: (vals[i], i))])
            cost = {"forward": float(n_eval), "backward": 0.0}
        else:  # random
            sets[name] = st.random_sets(cand, ks, 1, seed)[0]
            cost = {"forward": 0.0, "backward": 0.0}
        cost["seconds"] = time.perf_counter() - t1
        costs[name] = cost

    every_set = [[]] + [p for s in names for p in sets[s]]
    cal_loss.prefetch(every_set)
    held_loss.prefetch(every_set)
    cal_curves = {s: torch.tensor([cal_loss.delta(p) for p in sets[s]], dtype=torch.float64) for s in names}
    held_curves = {s: torch.tensor([held_loss.delta(p) for p in sets[s]], dtype=torch.float64) for s in names}
    plain_held = held_loss if refit == "none" else PlanLoss(model, held, batch_size, world)
    plain_held.share_clean(held_loss)  # the same clean forward
    held_unc: dict[str, Tensor] = {}
    interval_of = _Intervals(n_bootstrap, seed)
    held_unc_iv: dict[str, Tensor] = {}
    if uncorrected_curves and refit != "none":
        plain_held.prefetch(every_set)
        held_unc = {s: torch.tensor([plain_held.delta(p) for p in sets[s]], dtype=torch.float64) for s in names}
        held_unc_iv = interval_of(plain_held, {s: sets[s] for s in names})
    j = ks.index(k)
    selectable = [s for s in names if s != "random"] or names
    # intervals: every strategy's dCE at every k, and at k its calibration dCE minus the reference's, paired
    ref = reference if reference in selectable and len(selectable) > 1 else None
    cal_iv = interval_of(cal_loss, {s: sets[s] for s in names})
    held_iv = interval_of(held_loss, {s: sets[s] for s in names})
    margins: dict[str, list[float]] = {}
    margins_unc: dict[str, list[float]] = {}
    in_sample = refit != "none" and not getattr(cal_loss, "crossfit", False)
    plain_cal = PlanLoss(model, cal, batch_size, world) if refit != "none" else cal_loss
    plain_cal.share_clean(cal_loss)  # the same clean forward
    at_k = {s: sets[s][j] for s in names}
    if ref is not None:
        margins = interval_of.margins(cal_loss, at_k, ref)
        rule = (f"{ref} unless a strategy's calibration dCE is below it by more than the {INTERVAL_LEVEL:.0%} "
                f"interval of the paired difference (then the lowest of those)")
        if in_sample:  # a fitted correction compared in-sample: the win must also hold without it (nothing fitted)
            plain_cal.prefetch(list(at_k.values()))
            margins_unc = interval_of.margins(plain_cal, at_k, ref)
            rule += "; the corrections compared in-sample, so also without them"
    else:
        rule = "lowest calibration dCE" if len(selectable) > 1 else "the one strategy run"
    chosen = st.choose({s: float(cal_curves[s][j]) for s in selectable}, selectable, ref, margins, margins_unc)
    fresh = need and not given
    chosen_layers = list(sets[chosen][j])
    if refit == "none":
        gates = torch.ones(len(chosen_layers), dtype=torch.float64)
        biases = torch.zeros(len(chosen_layers), ad.d_model, dtype=torch.float64)
        linears = torch.zeros(0, 0, 0, dtype=torch.float64)
        unc_cal, unc_held = float(cal_curves[chosen][j]), float(held_curves[chosen][j])
        unc_cal_iv, unc_held_iv = cal_iv[chosen][j].tolist(), held_iv[chosen][j].tolist()
    else:
        g_of, b_of = cal_loss.corrections(chosen_layers)
        w_of = cal_loss.linear_maps(chosen_layers)
        linears = torch.stack([w_of[lay].to(torch.float64).cpu() for lay in chosen_layers]) \
            if chosen_layers and w_of else torch.zeros(0, 0, 0, dtype=torch.float64)
        gates = torch.tensor([g_of.get(lay, 1.0) for lay in chosen_layers], dtype=torch.float64)
        biases = torch.stack([b_of[lay].to(torch.float64).cpu() if lay in b_of else
                              torch.zeros(ad.d_model, dtype=torch.float64) for lay in chosen_layers]) \
            if chosen_layers else torch.zeros(0, ad.d_model, dtype=torch.float64)
        plain_cal.prefetch([chosen_layers])
        plain_held.prefetch([chosen_layers])
        unc_cal, unc_held = plain_cal.delta(chosen_layers), plain_held.delta(chosen_layers)
        unc_cal_iv = interval_of(plain_cal, {"": [chosen_layers]})[""][0].tolist()
        unc_held_iv = interval_of(plain_held, {"": [chosen_layers]})[""][0].tolist()
        extra["plain"] = plain_cal.passes + plain_held.passes
    total = {"forward": float(cal_loss.passes + held_loss.passes + (2 if fresh else 0) + extra["passes"]
                              + extra.get("plain", 0) + getattr(cal_loss, "fit_passes", 0)),
             "backward": float((1 + fisher_samples if fresh else 0) + extra["passes"]),
             "seconds": time.perf_counter() - t0}
    options = {"k": k, "strategy": strategy, "layers": sel, "k_values": ks, "strategies": names,
               "shortlist": shortlist, "batch_size": batch_size, "fisher_samples": fisher_samples,
               "held_out": "given" if held_out is not None else "second half of tokens", "refit": refit,
               "refit_order": refit_order, "refit_crossfit": getattr(cal_loss, "crossfit", False),
               "uncorrected_curves": bool(uncorrected_curves), "refit_requested": refit_requested,
               "reference": reference, "n_bootstrap": n_bootstrap, "refit_carry": carry}
    fit_kind = "none" if refit == "none" else ("out-of-fold" if getattr(cal_loss, "crossfit", False) else "in-sample")
    return ParallelPlan(
        provenance=ad.provenance(cal, corpus=corpus, seed=seed, **options),
        layers=chosen_layers, k=k, strategy=chosen, requested=strategy, candidates=cand,
        calibration_delta_ce=float(cal_curves[chosen][j]), held_out_delta_ce=float(held_curves[chosen][j]),
        clean_loss_calibration=cal_loss.clean, clean_loss_held_out=held_loss.clean,
        cost=costs[chosen], total_cost=total, k_values=ks, strategies=names, calibration_curves=cal_curves,
        held_out_curves=held_curves, plans=sets, strategy_costs=costs, n_calibration=int(cal.shape[0]),
        n_held_out=int(held.shape[0]), options=options, refit=refit, refit_order=refit_order, gates=gates,
        biases=biases, linears=linears, calibration_delta_ce_uncorrected=unc_cal,
        held_out_delta_ce_uncorrected=unc_held, held_out_curves_uncorrected=held_unc,
        refit_requested=refit_requested, calibration_fit=fit_kind, calibration_note=note, reference=ref or "",
        choice_rule=rule, margins=margins, margins_uncorrected=margins_unc, calibration_intervals=cal_iv, held_out_intervals=held_iv,
        held_out_intervals_uncorrected=held_unc_iv,
        calibration_delta_ce_interval=cal_iv[chosen][j].tolist(),
        held_out_delta_ce_interval=held_iv[chosen][j].tolist(),
        calibration_delta_ce_uncorrected_interval=unc_cal_iv, held_out_delta_ce_uncorrected_interval=unc_held_iv,
        interval={"level": INTERVAL_LEVEL, "n_bootstrap": n_bootstrap, "seed": seed,
                  "block_tokens_calibration": cal_loss.block, "block_tokens_held_out": held_loss.block,
                  "method": "two-stage percentile bootstrap: windows, then blocks of consecutive tokens in each"})


class _Intervals:
    """Intervals of dCE curves: ``self(loss, {name: [plan per k]})`` -> ``{name: [k, 2]}`` float64, every plan's
    per-block dCE sums on ``loss``'s windows resampled together (:func:`tl_steering.stats.cluster_bootstrap_ci`)."""

    def __init__(self, n_bootstrap: int, seed: int):
        self.n_bootstrap, self.seed = n_bootstrap, seed

    def __call__(self, loss: PlanLoss, curves: dict[str, list[list[int]]]) -> dict[str, Tensor]:
        cols = [loss.delta_blocks(p) for plans in curves.values() for p in plans]
        ci = cluster_bootstrap_ci(torch.stack(cols, -1), loss.block_counts(), self.n_bootstrap, self.seed,
                                  INTERVAL_LEVEL)
        out, i = {}, 0
        for name, plans in curves.items():
            out[name] = ci[i:i + len(plans)].clone()
            i += len(plans)
        return out

    def margins(self, loss: PlanLoss, plan_of: dict[str, list[int]], ref: str) -> dict[str, list[float]]:
        """``{name: [point, low, high]}`` of ``loss``'s dCE of ``plan_of[name]`` minus that of ``plan_of[ref]``,
        the interval paired (the same windows and blocks resampled for both plans)."""
        base_blocks = loss.delta_blocks(plan_of[ref])
        diffs = torch.stack([loss.delta_blocks(p) - base_blocks for p in plan_of.values()], -1)
        ci = cluster_bootstrap_ci(diffs, loss.block_counts(), self.n_bootstrap, self.seed, INTERVAL_LEVEL)
        base = loss.delta(plan_of[ref])
        return {name: [loss.delta(p) - base, float(ci[i, 0]), float(ci[i, 1])]
                for i, (name, p) in enumerate(plan_of.items())}


def _greedy(model: Any, cal: Tensor, sel: list[int], cand: list[int], kmax: int, first: dict[int, float],
            batch_size: int, extra: dict[str, int], world: Any = None) -> tuple[list[int], dict[str, float]]:
    """``"greedy"``: order of ``kmax`` layers by :data:`GREEDY_SCORE` re-computed on the partly parallel model."""
    order: list[int] = []
    fwd = bwd = 0.0
    for step in range(kmax):
        if step == 0:
            so = first
        else:
            attr, _ = broadcast_from_rank0(  # rank 0 re-scores; every rank takes the same step
                lambda: attribution_scores(model, cal, sel, base=order, batch_size=batch_size), world)
            so = {lay: float(attr[GREEDY_SCORE][sel.index(lay)]) for lay in cand}
            extra["passes"] += 1
        fwd, bwd = fwd + 1, bwd + 1
        order.append(st.rank([lay for lay in cand if lay not in order], so)[0])
    return order, {"forward": fwd, "backward": bwd}


def _greedy_measured(cand: list[int], kmax: int, ranking: dict[int, float], cal_loss: PlanLoss,
                     shortlist: int | None) -> tuple[list[int], dict[str, float]]:
    """``"greedy_measured"``: each step adds the layer of lowest measured calibration loss among the
    ``shortlist`` remaining layers ranked lowest by ``ranking`` (all remaining with ``None``)."""
    order: list[int] = []
    ranked = st.rank(cand, ranking)
    fwd = 0.0
    for _ in range(kmax):
        rest = [lay for lay in ranked if lay not in order]
        short = rest if shortlist is None else rest[:shortlist]
        cal_loss.prefetch([order + [lay] for lay in short])  # split over the ranks of a process group
        vals = {lay: cal_loss(order + [lay]) for lay in short}
        fwd += sum(cal_loss._cost(cal_loss._key(order + [lay])) for lay in short)
        order.append(min(short, key=lambda lay: (vals[lay], lay)))
    return order, {"forward": fwd, "backward": 0.0}


__all__ = ["DEFAULT_COMPARISON", "FULL_COMPARISON", "ONE_SHOT_COMPARISON", "PLAN_STRATEGIES", "ParallelPlan", "REFERENCE", "SCORE_STRATEGIES", "plan_parallel"]
