"""The one planner's strategies and its one default, :data:`PLANNER` (docs/parallel.md "Planning"; no torch here,
so the CLI checks its arguments fast). :data:`STRATEGIES` maps each name to ``plan(ctx, ks) -> (one sorted plan
per k of ks, cost)``, ``ctx`` a :class:`tl_steering.parallel.plan.PlanContext`; ties go to the lower layer."""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..errors import InputError

PEER_SCORES: tuple[str, ...] = ("block_influence", "angular_distance", "ffn_fusion")
"""The field's one-shot layer-choice scores (docs/defect.md "Peer scores"), computed in the forward of C."""
FISHER_SAMPLES = 8
"""Sampled-label backwards of the second-order score ``attribution_2nd`` (``plan_parallel(fisher_samples=)``)."""


class Planner(NamedTuple):
    """The planner's default: the strategies ``"best"`` compares, the reference it keeps unless beaten beyond
    noise, and the closed-form correction every compared plan is fitted with."""

    strategies: tuple[str, ...]
    reference: str
    refit: str


PLANNER = Planner(strategies=("C", "attribution_abs", "attribution_2nd"), reference="C", refit="linear")
"""The one default of every entry point: the paper's lowest-C plan (the reference) against our first- and
second-order loss scores, each plan with the cross-fitted linear correction (docs/parallel.md "Planning")."""


def check_k(k: object, n_candidates: int, parallel: Sequence[int] = ()) -> int:
    """``k`` as an int in ``[0, n_candidates]``, else :class:`InputError`. ``parallel``: the selected layers that
    are parallel blocks already (not candidates), named in the message."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise InputError(f"k must be an int (the number of sequential layers to make parallel), got {k!r}")
    if n_candidates == 0 and parallel and int(k) != 0:
        raise InputError(f"k={k!r}: every selected block ({list(parallel)}) is a parallel attention/MLP block "
                         "already (GPT-NeoX / Pythia / GPT-J style, x + A(x) + Phi(x)): there is no sequential block "
                         "to make parallel, so nothing to plan. Plan on a model with sequential blocks, or select "
                         "sequential layers with layers=.")
    if not 0 <= int(k) <= n_candidates:
        extra = f"; blocks {list(parallel)} are parallel already" if parallel else ""
        raise InputError(f"k must be an int in [0, {n_candidates}] (the number of sequential layers "
                         f"analysed{extra}), got {k!r}")
    return int(k)


def one_shot(candidates: Sequence[int], score_of: Mapping[int, float], k: int, lowest: bool = True) -> list[int]:
    """The k candidates with the lowest (``lowest=False``: highest) score, sorted by layer index (ties: the lower
    layer; NaN scores rank last)."""
    k = check_k(k, len(candidates))

    def key(lay: int) -> tuple[int, float, int]:
        v = float(score_of[lay])
        return (1, 0.0, lay) if math.isnan(v) else (0, v if lowest else -v, lay)

    return sorted(sorted(candidates, key=key)[:k])


def contiguous(candidates: Sequence[int], score_of: Mapping[int, float], k: int) -> list[int]:
    """The window of k consecutive candidates with the lowest summed score (earliest on ties; NaN sums lose): the
    ``contiguous`` curve of :func:`tl_steering.parallel_defect`."""
    k = check_k(k, len(candidates))
    if k == 0:
        return []
    sums = [sum(float(score_of[lay]) for lay in candidates[i:i + k]) for i in range(len(candidates) - k + 1)]
    finite = [s if math.isfinite(s) else math.inf for s in sums]
    start = int(np.argmin(finite))
    return list(candidates[start:start + k])


def random_sets(candidates: Sequence[int], ks: Sequence[int], n_random: int, seed: int) -> list[list[list[int]]]:
    """``n_random`` draws; each draw one uniformly random k-subset per k of ``ks`` (numpy ``default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    return [[sorted(int(v) for v in rng.choice(candidates, size=k, replace=False)) if k else [] for k in ks]
            for _ in range(n_random)]


Cost = dict[str, float]
Strategy = Callable[[Any, Sequence[int]], tuple[list[list[int]], Cost]]

SCORE_STRATEGIES: tuple[str, ...] = ("C", "attribution_abs", "attribution_2nd") + PEER_SCORES
"""The strategies that read a score of :func:`tl_steering.parallel_scores`."""


def lowest_score(name: str) -> Strategy:
    """The strategy ``name`` of a one-shot score: at each k, the k candidates of lowest score ``name``."""

    def plan(ctx: Any, ks: Sequence[int]) -> tuple[list[list[int]], Cost]:
        so = ctx.score_of(name)
        # passes over the calibration windows: one forward (the peers share C's), the attributions' backwards
        bwd = {"attribution_abs": 1.0, "attribution_2nd": 1.0 + ctx.fisher_samples}.get(name, 0.0)
        return [one_shot(ctx.candidates, so, k) for k in ks], {"forward": 1.0, "backward": bwd}

    plan.__name__ = plan.__qualname__ = name
    return plan


def sleb(ctx: Any, ks: Sequence[int]) -> tuple[list[list[int]], Cost]:
    """SLEB (Song et al. 2024, arXiv:2402.09025): add, one at a time, the candidate whose addition gives the lowest
    measured calibration loss, every remaining candidate measured at every step (nested plans)."""
    order: list[int] = []
    fwd = 0.0
    for _ in range(max(ks, default=0)):
        rest = [lay for lay in ctx.candidates if lay not in order]
        ctx.loss.prefetch([order + [lay] for lay in rest])  # split over the ranks of a process group
        vals = {lay: ctx.loss(order + [lay]) for lay in rest}
        fwd += sum(ctx.loss.cost_of(order + [lay]) for lay in rest)
        order.append(min(rest, key=lambda lay: (vals[lay], lay)))
    return [sorted(order[:k]) for k in ks], {"forward": fwd, "backward": 0.0}


def random(ctx: Any, ks: Sequence[int]) -> tuple[list[list[int]], Cost]:
    """A seeded random k-set per k (a baseline, never chosen by ``"best"``)."""
    return random_sets(ctx.candidates, ks, 1, ctx.seed)[0], {"forward": 0.0, "backward": 0.0}


STRATEGIES: dict[str, Strategy] = {
    **{name: lowest_score(name) for name in SCORE_STRATEGIES}, "sleb": sleb, "random": random}
"""Every strategy of the planner (docs/parallel.md "Planning", the table of strategies)."""


def choose(calibration: Mapping[str, float], order: Sequence[str], reference: str | None = None,
           margins: Mapping[str, Sequence[float]] | None = None,
           also: Mapping[str, Sequence[float]] | None = None) -> str:
    """The strategy ``"best"`` keeps from the calibration dCE at k of those in ``order`` (ties: the first in it;
    docs/parallel.md "Uncertainty and the choice"): the ``reference`` unless beaten beyond noise (``high < 0`` in
    ``margins[s] = [point, low, high]`` and, when given, in ``also``), then the lowest of those."""
    names = list(order)
    if not names:
        raise InputError("choose: no strategy to choose from")

    def key(s: str) -> tuple[float, int]:
        v = float(calibration[s])
        return (v if not math.isnan(v) else math.inf, names.index(s))

    if reference is None or reference not in names or len(names) == 1:
        return min(names, key=key)
    m = margins or {}
    beat = [s for s in names if s != reference and s in m and float(m[s][2]) < 0.0
            and (not also or (s in also and float(also[s][2]) < 0.0))]
    return min([reference] + beat, key=key)


def default_k_values(n_candidates: int) -> list[int]:
    """``0..L`` in steps of ``max(1, L // 8)``, plus ``L // 2`` and ``L`` (L = number of candidate layers)."""
    step = max(1, n_candidates // 8)
    return sorted(set(range(0, n_candidates + 1, step)) | {n_candidates // 2, n_candidates})


__all__ = ["FISHER_SAMPLES", "PEER_SCORES", "PLANNER", "Planner", "SCORE_STRATEGIES", "STRATEGIES", "check_k",
           "choose", "contiguous", "default_k_values", "lowest_score", "one_shot", "random_sets"]
