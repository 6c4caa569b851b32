"""Every knob of a suite run (:class:`SuiteSettings`) and the default sizes for a model of a given depth.

The settings are recorded in the :class:`~tl_steering.suite.result.SuiteResult` (and so in ``results.json``).
See docs/suite.md (stages, fields, the published-number map)."""

import dataclasses
from typing import ClassVar

from ..errors import InputError
from ..parallel.strategies import FISHER_SAMPLES, PLANNER
from ..critical.options import DEFAULT_FINDER, METHODS
from ..results import register
from .._util.checks import as_int, check_windows_length

#: The stages of :func:`~tl_steering.suite.run_suite`, in the order they run (what each reads: docs/suite.md, "Stages")
STAGES: tuple[str, ...] = ("checks", "deficit", "ablation", "diversity", "defect", "plan_choice", "parallel", "gates",
                           "critical", "prefix")

#: The strategies the ``plan_choice`` stage compares by default: the planner's (``parallel.strategies.PLANNER``)
PLAN_CHOICE_STRATEGIES: tuple[str, ...] = PLANNER.strategies

#: the finders the critical stage can run: the one finder of tl_steering.critical (docs/critical_points.md)
CRITICAL_METHODS: tuple[str, ...] = METHODS
_MAY_BE_ZERO = ("n_bootstrap", "plan_k", "gate_steps", "plan_choice_fisher_samples")


@register
@dataclasses.dataclass
class SuiteSettings:
    """Every knob of :func:`~tl_steering.suite.run_suite`.

    Defaults are sized for about 10 minutes on 2 CPU cores with SmolLM2-135M (:func:`default_settings` sizes
    them for a model's depth; ``quick`` for about 2 minutes).

    Each field: docs/suite.md, "Settings"."""

    kind: ClassVar[str] = "suite_settings"
    # fields that older files lack (they load with the defaults; parallel_timing_windows with 2, the batch size
    # their executor timed)
    added_fields: ClassVar[tuple[str, ...]] = ("plan_strategy", "plan_choice_strategies", "plan_choice_refit",
                                               "plan_choice_fisher_samples", "plan_choice_k_values",
                                               "parallel_timing_windows")

    stages: list[str] = dataclasses.field(default_factory=lambda: list(STAGES))
    quick: bool = False
    windows: int = 8
    length: int = 128
    n_bootstrap: int = 1000
    ablation_variants: list[str] = dataclasses.field(default_factory=lambda: ["tangential", "radial", "zero"])
    diversity_ablations: list[str] = dataclasses.field(default_factory=lambda: ["tangential", "radial"])
    diversity_gains: list[float] = dataclasses.field(default_factory=lambda: [0.5, 1.0, 1.5, 2.0])
    defect_k_values: list[int] | None = None
    defect_n_random: int = 3
    defect_brackets: bool = True
    defect_timing: bool = True
    timing_repeats: int = 5
    defect_evaluate: bool = True
    defect_gold_layers: list[int] | None = None
    defect_gold_k_values: list[int] | None = None
    plan_k: int = 0
    plan_strategy: str = PLANNER.reference
    plan_choice_strategies: list[str] = dataclasses.field(default_factory=lambda: list(PLAN_CHOICE_STRATEGIES))
    plan_choice_refit: str = PLANNER.refit
    plan_choice_fisher_samples: int = FISHER_SAMPLES
    plan_choice_k_values: list[int] | None = None
    parallel_repeats: int = 7
    parallel_timing_windows: int = 2
    gate_method: str = "closed_form"
    gate_steps: int = 0
    critical_layers: list[int] = dataclasses.field(default_factory=list)
    critical_n_starts: int = 8
    critical_methods: list[str] = dataclasses.field(default_factory=lambda: [DEFAULT_FINDER])
    critical_max_windows: int | None = None
    prefix_layer: int = 0
    prefix_positions: list[int] = dataclasses.field(default_factory=list)
    prefix_eps: float = 1e-2
    batch_size: int = 8

    def check(self) -> None:
        """Raise :class:`InputError` on settings run_suite cannot honour (before any forward)."""
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown:
            raise InputError(f"SuiteSettings.stages: unknown stages {unknown}; known: {list(STAGES)}")
        for need in ("parallel", "gates"):
            if need in self.stages and "defect" not in self.stages:
                raise InputError(f"SuiteSettings.stages: {need!r} runs on the defect plan: add 'defect'")
        from ..parallel.plan import PLAN_STRATEGIES
        from ..parallel.refit import REFITS

        if self.plan_strategy not in ("best",) + PLAN_STRATEGIES:
            raise InputError(f"SuiteSettings.plan_strategy must be 'best' or a strategy of {list(PLAN_STRATEGIES)}, "
                             f"got {self.plan_strategy!r}")

        if not isinstance(self.plan_choice_strategies, list) or any(
                s not in PLAN_STRATEGIES for s in self.plan_choice_strategies):
            raise InputError(f"SuiteSettings.plan_choice_strategies must be a list of strategies of "
                             f"{list(PLAN_STRATEGIES)} (empty: no plan_choice stage), got {self.plan_choice_strategies!r}")
        if self.plan_choice_refit not in REFITS:
            raise InputError(f"SuiteSettings.plan_choice_refit must be one of {list(REFITS)}, got "
                             f"{self.plan_choice_refit!r}")
        bad = [m for m in self.critical_methods if m not in CRITICAL_METHODS]
        if bad or len(self.critical_methods) != 1:
            raise InputError(
                f"SuiteSettings.critical_methods must name one finder of {list(CRITICAL_METHODS)} (the critical "
                f"section holds one result), got {self.critical_methods!r}")
        for name in ("batch_size", "parallel_repeats", "parallel_timing_windows", "timing_repeats",
                     "critical_n_starts", "n_bootstrap", "plan_k", "gate_steps", "plan_choice_fisher_samples"):
            as_int(getattr(self, name), f"SuiteSettings.{name}", minimum=0 if name in _MAY_BE_ZERO else 1)


def default_settings(n_layers: int, quick: bool = False, windows: int | None = None,
                     length: int | None = None) -> SuiteSettings:
    """The report's settings for a model with ``n_layers`` blocks (all sized relative to the depth)."""
    check_windows_length(windows, length)
    windows = windows if windows is not None else (4 if quick else 8)
    length = length if length is not None else (64 if quick else 128)
    L = n_layers
    half = L // 2
    if quick:
        ks = None  # no gold-standard curves in quick mode: the plan's loss comes from the surrogate hooks
        crit = [half]
        positions = [length // 4]
    else:
        ks = sorted({0, L // 4, half, (3 * L) // 4, L})
        crit = sorted({L // 4, half, (3 * L) // 4})
        positions = sorted({length // 8, length // 4, length // 2})
    return SuiteSettings(
        quick=quick, windows=windows, length=length, n_bootstrap=200 if quick else 1000,
        diversity_gains=[1.0, 2.0] if quick else [0.5, 1.0, 2.0], defect_k_values=ks,
        defect_n_random=0 if quick else 1, defect_brackets=not quick, defect_evaluate=not quick,
        timing_repeats=1 if quick else 3,  # quick: the sub-modules timed once each after a warm-up
        plan_k=half, parallel_repeats=5 if quick else 7,  # alternating rounds: [min, max] covers 93.8% / 98.4%
        parallel_timing_windows=1 if quick else 2,  # 4 forwards a round of 1 x 64 / 2 x 128 tokens
        critical_layers=crit, critical_n_starts=4 if quick else 8, prefix_layer=L // 2,
        prefix_positions=[p for p in positions if 0 < p < length])


__all__ = ["CRITICAL_METHODS", "PLAN_CHOICE_STRATEGIES", "STAGES", "SuiteSettings", "check_windows_length", "default_settings"]
