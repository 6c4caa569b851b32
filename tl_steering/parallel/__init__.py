"""Parallel blocks: which blocks to make parallel (planning, see docs/defect.md and docs/parallel.md "Planning"),
and making them parallel for real (:func:`parallelize`, docs/parallel.md).

* :mod:`.apply` - :func:`parallelize`, the public API of the parallel executor (block surgery in
  :mod:`tl_steering.backends.executor`);
* :mod:`.defect` - :func:`parallel_defect`, the paper's sequential-to-parallel defect C_l (protocol 4,
  docs/defect.md) and its plan curves;
* :mod:`.strategies` - the planner's registry of strategies and its one default, :data:`PLANNER` (no torch);
* :mod:`.gold` - the measured loss of a plan (the one oracle) and the one curve builder;
* :mod:`.speedup` - opt-in sub-module timing and the speedup estimate;
* :mod:`.attribution` - the first-order loss-change score of every layer from one forward + one backward;
* :mod:`.scores` - :func:`parallel_scores`, every per-layer score in one typed result;
* :mod:`.plan` - :func:`plan_parallel`, the one planner: chosen on calibration windows, reported on held-out ones;
* :mod:`.refit` - closed-form corrections g_l Phi(x) (+ b_l) of the parallel FFN writes (``refit=``).
"""

from typing import TYPE_CHECKING

from .._util.lazy import lazy_attributes

# lazy (PEP 562): the suite's settings (read by the CLI before it imports torch) import .strategies
_LAZY = {
    **{n: ".apply" for n in ("parallel_layers", "parallelize", "unfused")},
    **{n: ".attribution" for n in ("ATTRIBUTION_VARIANTS", "attribution_scores")},
    **{n: ".defect" for n in ("BRACKET_TERMS", "CURVE_STRATEGIES", "DEFECT_RMS_TERMS", "DEFECT_VARIANTS", "DefectResult",
                              "parallel_defect")},
    **{n: ".gold" for n in ("PlanLoss", "delta_curves", "gold")},
    **{n: ".plan" for n in ("PLAN_STRATEGIES", "ParallelPlan", "plan_parallel")},
    **{n: ".refit" for n in ("REFITS", "fit_corrections", "refit")},
    **{n: ".scores" for n in ("ParallelScoresResult", "parallel_scores")},
    **{n: ".speedup" for n in ("SPEEDUP_LABEL", "estimate_speedup", "speedup")},
    **{n: ".strategies" for n in ("PLANNER", "STRATEGIES", "default_k_values", "strategies")},
}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

if TYPE_CHECKING:
    from . import gold, refit, speedup, strategies  # noqa: F401
    from .apply import parallel_layers, parallelize, unfused  # noqa: F401
    from .attribution import ATTRIBUTION_VARIANTS, attribution_scores  # noqa: F401
    from .defect import (BRACKET_TERMS, CURVE_STRATEGIES, DEFECT_RMS_TERMS, DEFECT_VARIANTS, DefectResult,  # noqa: F401
                         parallel_defect)
    from .gold import PlanLoss, delta_curves  # noqa: F401
    from .plan import PLAN_STRATEGIES, ParallelPlan, plan_parallel  # noqa: F401
    from .refit import REFITS, fit_corrections  # noqa: F401
    from .scores import ParallelScoresResult, parallel_scores  # noqa: F401
    from .speedup import SPEEDUP_LABEL, estimate_speedup  # noqa: F401
    from .strategies import PLANNER, STRATEGIES, default_k_values  # noqa: F401

__all__ = sorted(_LAZY)
