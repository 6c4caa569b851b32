"""Parallel blocks: the sequential-to-parallel defect (:mod:`.defect`, docs/defect.md), which blocks to make
parallel (:mod:`.plan`, the one planner; :mod:`.strategies`, its registry and default :data:`PLANNER`; :mod:`.gold`,
the measured loss of a plan; :mod:`.refit`, the closed-form corrections; :mod:`.scores`, every per-layer score;
docs/parallel.md "Planning") and making them parallel for real (:func:`parallelize`, docs/parallel.md)."""

from typing import TYPE_CHECKING

from .._util.lazy import lazy_attributes

# lazy (PEP 562): the suite's settings (read by the CLI before it imports torch) import .strategies
_LAZY = {
    **{n: ".apply" for n in ("parallel_layers", "parallelize", "unfused")},
    **{n: ".defect" for n in ("DefectResult", "parallel_defect")},
    **{n: ".gold" for n in ("PlanLoss", "delta_curves", "gold")},
    **{n: ".plan" for n in ("ParallelPlan", "plan_parallel")},
    **{n: ".refit" for n in ("REFITS", "fit_corrections", "refit")},
    **{n: ".scores" for n in ("ParallelScoresResult", "parallel_scores")},
    **{n: ".strategies" for n in ("PLANNER", "STRATEGIES", "strategies")}}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

if TYPE_CHECKING:
    from . import gold, refit, strategies  # noqa: F401
    from .apply import parallel_layers, parallelize, unfused  # noqa: F401
    from .defect import DefectResult, parallel_defect  # noqa: F401
    from .gold import PlanLoss, delta_curves  # noqa: F401
    from .plan import ParallelPlan, plan_parallel  # noqa: F401
    from .refit import REFITS, fit_corrections  # noqa: F401
    from .scores import ParallelScoresResult, parallel_scores  # noqa: F401
    from .strategies import PLANNER, STRATEGIES  # noqa: F401

__all__ = sorted(_LAZY)
