"""Parallel blocks: which blocks to make parallel (planning, see docs/defect.md and docs/parallel.md "Planning"),
and making them parallel for real (:func:`parallelize`, docs/parallel.md).

* :mod:`.apply` - :func:`parallelize`, the public API of the parallel executor (block surgery in
  :mod:`tl_steering.backends.executor`);
* :mod:`.defect` - :func:`parallel_defect`, the paper's sequential-to-parallel defect C_l (protocol 4,
  docs/defect.md) and its plan curves;
* :mod:`.strategies` - pure layer-choice strategies (no model);
* :mod:`.gold` - the measured loss of a plan (the gold standard);
* :mod:`.speedup` - opt-in sub-module timing and the speedup estimate;
* :mod:`.attribution` - the first-order loss-change score of every layer from one forward + one backward;
* :mod:`.scores` - :func:`parallel_scores`, every per-layer score in one typed result;
* :mod:`.plan` - :func:`plan_parallel`, planners chosen on calibration windows, reported on held-out ones;
* :mod:`.refit` - closed-form corrections g_l Phi(x) (+ b_l) of the parallel FFN writes (``refit=``).
"""

from . import gold, refit, speedup, strategies
from .apply import parallel_layers, parallelize, unfused
from .attribution import ATTRIBUTION_VARIANTS, attribution_scores
from .defect import (BRACKET_TERMS, CURVE_STRATEGIES, DEFECT_RMS_TERMS, DEFECT_VARIANTS, DefectResult,
                     parallel_defect)
from .gold import PlanLoss
from .plan import ONE_SHOT_COMPARISON, PLAN_STRATEGIES, ParallelPlan, plan_parallel
from .refit import REFITS, fit_corrections
from .scores import ParallelScoresResult, parallel_scores
from .speedup import SPEEDUP_LABEL, estimate_speedup
from .strategies import default_k_values

__all__ = [
    "ATTRIBUTION_VARIANTS",
    "BRACKET_TERMS",
    "CURVE_STRATEGIES",
    "DEFECT_RMS_TERMS",
    "DEFECT_VARIANTS",
    "DefectResult",
    "ONE_SHOT_COMPARISON",
    "PLAN_STRATEGIES",
    "ParallelPlan",
    "ParallelScoresResult",
    "PlanLoss",
    "REFITS",
    "SPEEDUP_LABEL",
    "attribution_scores",
    "default_k_values",
    "estimate_speedup",
    "fit_corrections",
    "gold",
    "parallel_defect",
    "parallel_layers",
    "parallel_scores",
    "parallelize",
    "plan_parallel",
    "refit",
    "speedup",
    "strategies",
    "unfused",
]
