"""Pure layer-choice strategies: which k layers to make parallel, given per-layer scores (no model here).

Every function takes the candidate layers (the sequential blocks that can be made parallel) and returns a
sorted list of layer indices. Ties are broken by the lower layer index; NaN scores rank last. See
docs/defect.md ("Layer choices") and docs/parallel.md ("Planning").
"""

import math
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import InputError

ONE_SHOT_COMPARISON: tuple[str, ...] = ("C", "attribution_abs", "attribution_2nd")
"""The default comparison of ``strategy="best"``: the cheap one-shot scores (one parallel_scores call: 2 forwards
+ 1 + ``fisher_samples`` backwards) then a few corrected forwards per plan and curve point. The signed
``attribution`` is left out (still available by name): it was the worst plan at every k on both models (held out
+4.53 nats on SmolLM2 at k = 15, +9.86 / +1.60 corrected on Gemma-3-270M at k = 9) and was never chosen. With the
cross-fitted linear correction (the default ``refit="linear"``) it is the best plan we measured held out on SmolLM2 and
Gemma-3-270M (docs/parallel.md "Planners against the field"); the measured / greedy searches choose among hundreds
of plans on the calibration windows' loss and, with a few calibration windows, pick plans that fit their noise.
The suite's ``plan_choice`` stage compares these and :data:`PEER_SCORES` by default (this module imports no
torch, so the CLI checks its arguments fast)."""
PEER_SCORES: tuple[str, ...] = ("block_influence", "angular_distance", "ffn_fusion")
"""The field's one-shot layer-choice scores (:mod:`tl_steering.parallel.peers`: ShortGPT's block influence, Gromov
et al.'s angular distance, FFN Fusion's dependency), from the same forward as C."""


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


def rank(candidates: Sequence[int], score_of: Mapping[int, float], lowest: bool = True) -> list[int]:
    """Candidates ordered by score (ascending if ``lowest``), ties by layer index, NaN last."""

    def key(lay: int) -> tuple[int, float, int]:
        v = float(score_of[lay])
        return (1, 0.0, lay) if math.isnan(v) else (0, v if lowest else -v, lay)

    return sorted(candidates, key=key)


def one_shot(candidates: Sequence[int], score_of: Mapping[int, float], k: int, lowest: bool = True) -> list[int]:
    """The k candidates with the lowest (``lowest=False``: highest) score, sorted by layer index."""
    k = check_k(k, len(candidates))
    return sorted(rank(candidates, score_of, lowest)[:k])


def contiguous(candidates: Sequence[int], score_of: Mapping[int, float], k: int) -> list[int]:
    """The window of k consecutive candidates with the lowest summed score (earliest on ties; NaN sums lose)."""
    k = check_k(k, len(candidates))
    if k == 0:
        return []
    sums = [sum(float(score_of[lay]) for lay in candidates[i:i + k]) for i in range(len(candidates) - k + 1)]
    finite = [s if math.isfinite(s) else math.inf for s in sums]
    start = int(np.argmin(finite))
    return list(candidates[start:start + k])


def windows(candidates: Sequence[int], k: int) -> list[list[int]]:
    """Every window of k consecutive candidates (in order of its first layer)."""
    k = check_k(k, len(candidates))
    if k == 0:
        return [[]]
    return [list(candidates[i:i + k]) for i in range(len(candidates) - k + 1)]


def random_sets(candidates: Sequence[int], ks: Sequence[int], n_random: int, seed: int) -> list[list[list[int]]]:
    """``n_random`` draws; each draw one uniformly random k-subset per k of ``ks`` (numpy ``default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    return [[sorted(int(v) for v in rng.choice(candidates, size=k, replace=False)) if k else [] for k in ks]
            for _ in range(n_random)]


def choose(calibration: Mapping[str, float], order: Sequence[str], reference: str | None = None,
           margins: Mapping[str, Sequence[float]] | None = None,
           also: Mapping[str, Sequence[float]] | None = None) -> str:
    """The strategy ``"best"`` keeps, from the calibration dCE at k of the strategies in ``order`` (ties: the first
    in ``order``).

    Without ``reference`` (or with one not in ``order``): the lowest calibration dCE. With one: the reference,
    unless some strategies beat it beyond noise, i.e. the upper end of the interval of their calibration dCE minus
    the reference's (``margins[s] = [point, low, high]``) is below zero; then the lowest of those. A NaN interval
    never beats the reference. A plan that fits the calibration windows' noise (a search over many plans, or an
    in-sample correction) lowers its point estimate but not its paired interval's upper end below zero unless the
    gain is larger than the noise of the tokens it was measured on. ``also``: margins of a second measurement that
    must be beaten too (given: a strategy missing from it never beats the reference); the planner passes the
    uncorrected margins when corrections were compared in-sample, a win a fit cannot make up."""
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


__all__ = ["ONE_SHOT_COMPARISON", "PEER_SCORES", "check_k", "choose", "contiguous", "default_k_values", "one_shot", "random_sets", "rank", "windows"]
