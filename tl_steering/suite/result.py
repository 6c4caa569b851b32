"""The suite's result: one typed, registered :class:`SuiteResult` holding every protocol's result and the
analyses the suite adds, saved and loaded like every result (docs/suite.md, "The result")."""

import dataclasses
import math
import platform
from typing import Any, ClassVar

import torch

from ..protocols.gates import GateResult

from ..critical import CriticalPointsResult as CriticalResult
from ..protocols.prefix import PrefixSensitivityResult
from ..protocols.ablation import AblationResult
from ..parallel.defect import DefectResult
from ..protocols.deficit import DeficitResult
from ..protocols.diversity import DiversityResult
from ..results import Result, register
from .._util.claims import Claim
from .claims import suite_claims
from .settings import SuiteSettings


@register
@dataclasses.dataclass
class ModelSummary:
    """The model the suite ran on (name, revision, shape, backend, processing, dtype, device, BOS)."""

    kind: ClassVar[str] = "suite_model"

    name: str = "unknown"
    revision: str | None = None
    n_layers: int = 0
    d_model: int = 0
    backend: str = "unknown"
    processing: str = "unknown"
    dtype: str = "unknown"
    device: str = "unknown"
    prepend_bos: bool = True


@register
@dataclasses.dataclass
class Environment:
    """Versions and machine of the run."""

    kind: ClassVar[str] = "suite_environment"

    tl_steering: str = ""
    transformer_lens: str = "unknown"
    torch: str = ""
    python: str = ""
    platform: str = ""
    torch_threads: int = 0
    cuda: str | None = None

    @classmethod
    def here(cls, tl_version: str) -> "Environment":
        from .._util import __version__

        return cls(tl_steering=__version__, transformer_lens=tl_version, torch=torch.__version__,
                   python=platform.python_version(), platform=platform.platform(terse=True),
                   torch_threads=torch.get_num_threads(),
                   cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)


@register
@dataclasses.dataclass
class Checks:
    """The clean model on the suite's tokens: mean next-token CE and the residual identity check."""

    kind: ClassVar[str] = "suite_checks"

    clean_loss: float = math.nan
    max_residual_identity_error: float = math.nan


@register
@dataclasses.dataclass
class PlanLosses:
    """The layer plan the suite makes parallel and its loss (the surrogate hooks of docs/defect.md); fields:
    docs/suite.md, "The result"."""

    kind: ClassVar[str] = "suite_plan"

    k: int = 0
    layers: list[int] = dataclasses.field(default_factory=list)
    variant: str = "C"
    strategy: str = "C"
    n_candidates: int = 0
    highest_layers: list[int] = dataclasses.field(default_factory=list)
    delta_ce_lowest: float = math.nan
    delta_ce_highest: float = math.nan
    source: str = ""

    @property
    def high_over_low(self) -> float:
        """dCE(highest k) / dCE(lowest k) (inf when only the control costs, NaN when neither does)."""
        lo, hi = self.delta_ce_lowest, self.delta_ce_highest
        return hi / lo if lo > 0 else (math.inf if hi > 0 else math.nan)


@register
@dataclasses.dataclass
class SpeedupEstimate:
    """The critical-path speedup estimate of the plan from the sub-module times (``DefectResult.speedup_estimate``'s
    fields, one for one)."""

    kind: ClassVar[str] = "suite_speedup"

    label: str = ""
    layers: list[int] = dataclasses.field(default_factory=list)
    k: int = 0
    T_seq_s: float = math.nan
    T_par_s: float = math.nan
    speedup: float = math.nan
    T_other_s: float = math.nan
    speedup_with_other: float = math.nan
    timing_shape: list[int] = dataclasses.field(default_factory=list)
    device: str = ""


@register
@dataclasses.dataclass
class ExecutorTiming:
    """The plan run by the real parallel executor: its loss and its whole-forward time against the original (the
    timing fields and older files without rounds: docs/suite.md, "Verdicts").

    ``status`` is ``"ok"``, ``"skipped"`` (empty plan) or ``"not supported"`` (``reason`` says why). ``strategy``
    and ``correction`` say which plan ran (the lowest-C plan uncorrected, or the chosen plan with its fitted
    ``g_l Phi(x) + b_l`` folded into the fused weights)."""

    kind: ClassVar[str] = "suite_executor"
    # fields older files lack: they ran the lowest-C plan uncorrected (the defaults say so) with no rounds and
    # no A/A control
    added_fields: ClassVar[tuple[str, ...]] = (
        "strategy", "correction", "rounds", "timing_sequential_s", "timing_control_s", "timing_parallel_s",
        "speedup_interval", "speedup_control", "speedup_control_interval", "speedup_coverage")

    status: str = "ok"
    reason: str = ""
    label: str = ""
    strategy: str = "C"
    correction: str = "none"
    layers: list[int] = dataclasses.field(default_factory=list)
    timing_shape: list[int] = dataclasses.field(default_factory=list)
    device: str = ""
    t_forward_sequential_s: float = math.nan
    t_forward_parallel_s: float = math.nan
    measured_speedup: float = math.nan
    loss: float = math.nan
    delta_ce: float = math.nan
    rounds: int = 0
    timing_sequential_s: list[float] = dataclasses.field(default_factory=list)
    timing_control_s: list[float] = dataclasses.field(default_factory=list)
    timing_parallel_s: list[float] = dataclasses.field(default_factory=list)
    speedup_interval: list[float] = dataclasses.field(default_factory=lambda: [math.nan, math.nan])
    speedup_control: float = math.nan
    speedup_control_interval: list[float] = dataclasses.field(default_factory=lambda: [math.nan, math.nan])
    speedup_coverage: float = math.nan

    def set_times(self, sequential: list[float], control: list[float], parallel: list[float],
                  level: float = 0.95) -> None:
        """Fill the timing fields from the per-round seconds of the original, the A/A control and the copy."""
        from ..stats import median_interval

        self.rounds = len(parallel)
        self.timing_sequential_s = [float(t) for t in sequential]
        self.timing_control_s = [float(t) for t in control]
        self.timing_parallel_s = [float(t) for t in parallel]
        self.t_forward_sequential_s = median_interval(sequential, level)[0]
        self.t_forward_parallel_s = median_interval(parallel, level)[0]
        speed = [a / b if b > 0 else math.nan for a, b in zip(sequential, parallel)]
        ctrl = [a / b if b > 0 else math.nan for a, b in zip(sequential, control)]
        self.measured_speedup, lo, hi, self.speedup_coverage = median_interval(speed, level)
        self.speedup_interval = [lo, hi]
        self.speedup_control, clo, chi, _ = median_interval(ctrl, level)
        self.speedup_control_interval = [clo, chi]


@register
@dataclasses.dataclass
class PlanChoice:
    """The ``plan_choice`` stage: a cheap comparison of planner strategies, chosen on the first half of the
    windows and reported on the second half beside the paper's lowest-C plan; fields: docs/suite.md, "The result"."""

    kind: ClassVar[str] = "suite_plan_choice"

    plan: Result | None = None
    lowest_c_layers: list[int] = dataclasses.field(default_factory=list)
    lowest_c_held_out_delta_ce: float = math.nan
    ratio_to_lowest_c: float = math.nan
    fisher_samples: int = 0

    def summary(self) -> dict[str, Any]:
        """The chosen plan's headline numbers, every compared strategy's held-out dCE at k, and the ratio."""
        p = self.plan
        if p is None:
            return {}
        out: dict[str, Any] = {
            "chosen layers": list(p.layers),
            "chosen strategy": p.strategy,
            "correction": f"{p.refit} ({p.refit_order})" if p.refit != "none" else "none",
            "k": p.k,
            "calibration / held-out windows": f"{p.n_calibration} / {p.n_held_out}",
            "calibration dCE": p.calibration_delta_ce,
            "held-out dCE": p.held_out_delta_ce,
            "held-out dCE without the correction": p.held_out_delta_ce_uncorrected,
            "lowest-C plan": list(self.lowest_c_layers),
            "lowest-C plan held-out dCE (uncorrected)": self.lowest_c_held_out_delta_ce,
            "ratio to the lowest-C plan (held out)": self.ratio_to_lowest_c,
            "fisher samples": self.fisher_samples,
            "planner passes (forward / backward)": f"{p.total_cost.get('forward', math.nan):.0f} / "
                                                    f"{p.total_cost.get('backward', math.nan):.0f}"}
        if p.k in p.k_values:
            out.update({f"held-out dCE, {s}": v for s, v in p.at_k().items()})
        return out


@register
@dataclasses.dataclass
class StageTiming:
    """Wall and CPU seconds of one stage, and the forward passes it ran (this process): ``forwards`` counts every
    model forward through the adapter (hooked or cached, any batch; not a clean forward an earlier stage ran, nor
    a timed one) and every run of a plan from a shared clean prefix (``parallel.gold.PlanLoss``), ``tokens``
    their tokens (-1: not recorded by an older file)."""

    kind: ClassVar[str] = "suite_stage_timing"
    added_fields: ClassVar[tuple[str, ...]] = ("forwards", "tokens")  # older files read -1

    wall_s: float = math.nan
    cpu_s: float = math.nan
    forwards: int = -1
    tokens: int = -1


@register
@dataclasses.dataclass
class DistributedRun:
    """How the run was spread over processes: ``world_size`` (1: no process group), the ``torch.distributed``
    ``backend`` (``"none"`` for one process) and the placement of the stages (``sharded_stages``, ``rank0_stages``,
    ``stage_ranks``: empty for one process); docs/scale_out.md, "The sharded report"."""

    kind: ClassVar[str] = "suite_distributed"
    added_fields: ClassVar[tuple[str, ...]] = ("stage_ranks",)

    world_size: int = 1
    backend: str = "none"
    sharded_stages: list[str] = dataclasses.field(default_factory=list)
    rank0_stages: list[str] = dataclasses.field(default_factory=list)
    stage_ranks: dict[str, list[int]] = dataclasses.field(default_factory=dict)


@register
@dataclasses.dataclass
class RunArguments:
    """How the suite was asked for (the CLI's arguments; empty when run_suite was called from Python)."""

    kind: ClassVar[str] = "suite_arguments"

    model: str = ""
    backend: str = ""
    text: str = ""
    windows: int | None = None
    length: int | None = None
    out: str = ""
    device: str | None = None
    seed: int = 0
    quick: bool = False
    command: str | None = None


@register
@dataclasses.dataclass
class SuiteResult(Result):
    """Every protocol of the paper on one model and one set of token windows (:func:`run_suite`); a field is
    ``None`` when its stage was not run (docs/suite.md, "The result")."""

    settings: SuiteSettings = dataclasses.field(default_factory=SuiteSettings)
    seed: int = 0
    model: ModelSummary = dataclasses.field(default_factory=ModelSummary)
    environment: Environment = dataclasses.field(default_factory=Environment)
    arguments: RunArguments = dataclasses.field(default_factory=RunArguments)
    distributed: DistributedRun = dataclasses.field(default_factory=DistributedRun)
    started: str = ""
    total_wall_s: float = math.nan
    timings: dict[str, StageTiming] = dataclasses.field(default_factory=dict)
    checks: Checks | None = None
    deficit: DeficitResult | None = None
    ablation: AblationResult | None = None
    diversity: DiversityResult | None = None
    defect: DefectResult | None = None
    defect_gold: DefectResult | None = None
    plan: PlanLosses | None = None
    planner: Result | None = None
    plan_choice: PlanChoice | None = None
    speedup: SpeedupEstimate | None = None
    executor: ExecutorTiming | None = None
    executor_choice: ExecutorTiming | None = None
    gates: GateResult | None = None
    critical: CriticalResult | None = None
    critical_fixed_point: CriticalResult | None = None
    prefix: PrefixSensitivityResult | None = None

    kind = "suite"
    # stages and records added after the first suites: older files load without them
    added_fields = ("distributed", "planner", "plan_choice", "executor_choice")

    def summary(self) -> dict[str, Any]:
        """The headline: the scalars the report leads with (each also inside a field of the result); stages not
        run are left out. Each headline number is named here once: ``tl_steering.suite.numbers`` (the published
        and pinned maps) reads it by this name."""
        out: dict[str, Any] = {}
        if self.checks is not None:
            out.update(clean_loss=self.checks.clean_loss,
                       max_residual_identity_error=self.checks.max_residual_identity_error)
        if self.deficit is not None:
            d = self.deficit
            out.update(deficit_mean=d.mean, deficit_mean_ci=list(d.mean_ci),
                       deficit_mean_excluding_first=d.mean_excluding_first,
                       ffn_contribution_mean=d.ffn_contribution_mean)
        if self.ablation is not None:
            out.update({f"ablation_delta_loss_{k}": self.ablation.delta_loss.get(k, math.nan)
                        for k in ("tangential", "radial", *self.ablation.delta_loss)})
            out["ablation_ratio_to_zero_radial"] = self.ablation.ratio_to_zero.get("radial", math.nan)
        if self.diversity is not None:
            vs = self.diversity.summary()
            out.update(
                diversity_frac_layers_attention_concentrates=vs["frac_layers_attention_concentrates"],
                diversity_frac_layers_ffn_diversifies=vs["frac_layers_ffn_diversifies"],
                **{f"diversity_final_pairwise_cosine{s}": vs.get(f"final_pairwise_cosine{s}", math.nan)
                   for s in ("", "_tangential", "_radial")},
                diversity_tangential_preserves=self.diversity.tangential_preserves())
        if self.defect is not None:
            cs = self.defect.summary()
            out.update(defect_C_min=cs.get("C_min", math.nan), defect_C_max=cs.get("C_max", math.nan),
                       defect_spearman_C=self.defect.spearman.get("C", math.nan))
        if self.plan is not None:
            out.update(plan_k=self.plan.k, plan_layers=self.plan.layers, plan_delta_ce=self.plan.delta_ce_lowest,
                       plan_high_over_low=self.plan.high_over_low)
        if self.speedup is not None:
            out.update(speedup_estimate=self.speedup.speedup,
                       speedup_estimate_with_other=self.speedup.speedup_with_other)
        if self.executor is not None:
            out.update(parallel_measured_speedup=self.executor.measured_speedup,
                       parallel_executor_delta_ce=self.executor.delta_ce)
        if self.gates is not None:
            gs = self.gates.summary()
            out.update(gates_delta_ce_base_heldout=gs["delta_ce_base_heldout"],
                       gates_delta_ce_gated_heldout=gs["delta_ce_gated_heldout"])
        if self.critical is not None:
            cr = self.critical
            out.update(critical_n_points=int(cr.n_points.sum()), critical_saddle_fraction=cr.saddle_fraction(),
                       critical_rotational_points=int(cr.rotational.sum()),
                       critical_converged_starts=int(cr.n_converged.sum()))
        fp = self.critical_fixed_point
        out["critical_fixed_point_counts"] = fp.totals() if fp is not None else None
        if self.prefix is not None:
            out.update(prefix_max_angle=self.prefix.prefix_max_angle,
                       prefix_bitwise_equal=self.prefix.prefix_bitwise_equal)
        return out

    def claims(self) -> dict[str, Claim]:
        """Every section's claim, ``{section: Claim}``, for the stages that ran: the protocol results' own
        ``claim()`` and the suite's records' (``tl_steering.suite.claims``; docs/suite.md, "Claims")."""
        return suite_claims(self)

    def nan_reasons(self) -> dict[str, str]:
        """Why a headline number of :meth:`summary` is NaN, by its key (only the NaNs that have a known cause)."""
        out: dict[str, str] = {}
        d = self.defect
        if d is not None and not math.isfinite(d.spearman.get("C", math.nan)):
            if not d.evaluated:
                out["defect_spearman_C"] = ("not measured: this run skipped the defect's gold standard (the "
                                            "single-layer ΔCE it correlates C_l with; --quick skips it), so "
                                            "there is nothing to correlate; run the report without --quick")
            else:
                out["defect_spearman_C"] = ("undefined: fewer than 3 sequential candidate layers, or C_l or the "
                                            "single-layer ΔCE constant over them")
        return out


__all__ = ["Checks", "DistributedRun", "Environment", "ExecutorTiming", "ModelSummary", "PlanChoice", "PlanLosses",
           "RunArguments", "SpeedupEstimate", "StageTiming", "SuiteResult"]
