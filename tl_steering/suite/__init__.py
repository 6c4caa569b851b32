"""The suite: every protocol of the paper on one model, as one typed result (:func:`run_suite`, :class:`SuiteSettings`,
:class:`SuiteResult`, the map of named numbers :data:`NUMBERS`; docs/suite.md)."""

from typing import TYPE_CHECKING

from .._util.lazy import lazy_attributes

# lazy (PEP 562): the CLI reads .settings to check arguments without importing the protocols
_LAZY = {
    **{n: ".numbers" for n in ("NUMBERS", "PINNED", "PUBLISHED", "pinned_values", "published_value")},
    **{n: ".result" for n in ("Checks", "Environment", "ExecutorTiming", "ModelSummary", "PlanChoice",
                              "PlanLosses", "RunArguments", "SpeedupEstimate", "StageTiming", "SuiteResult")},
    **{n: ".progress" for n in ("Progress", "TqdmProgress")},
    "run_suite": ".run",
    **{n: ".settings" for n in ("CRITICAL_METHODS", "PLAN_CHOICE_STRATEGIES", "STAGES", "SuiteSettings", "check_windows_length",
                                "default_settings")}}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

if TYPE_CHECKING:
    from .numbers import NUMBERS, PINNED, PUBLISHED, pinned_values, published_value
    from .progress import Progress, TqdmProgress
    from .result import (Checks, Environment, ExecutorTiming, ModelSummary, PlanChoice, PlanLosses, RunArguments,
                         SpeedupEstimate, StageTiming, SuiteResult)
    from .run import run_suite
    from .settings import (CRITICAL_METHODS, PLAN_CHOICE_STRATEGIES, STAGES, SuiteSettings, check_windows_length,
                           default_settings)

__all__ = sorted(_LAZY)
