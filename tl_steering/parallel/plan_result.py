"""The result of :func:`tl_steering.plan_parallel`: :class:`ParallelPlan` (docs/parallel.md "Planning"; its saved
file holds the fitted corrections bit for bit)."""

import dataclasses
import math
from typing import Any

from jaxtyping import Float
from torch import Tensor

from .._util.plan_parts import PlanPart
from ..errors import InputError
from ..results import Result, register, tensor_field


def _no_interval() -> Any:
    return dataclasses.field(default_factory=lambda: [math.nan, math.nan])


@register
@dataclasses.dataclass(kw_only=True)
class ParallelPlan(Result):
    """A set of layers to make parallel, how it was chosen and what it costs (loss and planner passes); every field
    is described in docs/parallel.md "Planning", "Refit" and "Uncertainty and the choice"."""

    layers: list[int] = dataclasses.field(default_factory=list)
    k: int = 0
    strategy: str = ""
    requested: str = ""
    candidates: list[int] = dataclasses.field(default_factory=list)
    calibration_delta_ce: float = math.nan
    held_out_delta_ce: float = math.nan
    clean_loss_calibration: float = math.nan
    clean_loss_held_out: float = math.nan
    cost: dict[str, float] = dataclasses.field(default_factory=dict)
    total_cost: dict[str, float] = dataclasses.field(default_factory=dict)
    k_values: list[int] = dataclasses.field(default_factory=list)
    strategies: list[str] = dataclasses.field(default_factory=list)
    calibration_curves: dict[str, Float[Tensor, " k"]] = dataclasses.field(default_factory=dict)
    held_out_curves: dict[str, Float[Tensor, " k"]] = dataclasses.field(default_factory=dict)
    plans: dict[str, list] = dataclasses.field(default_factory=dict)
    strategy_costs: dict[str, dict] = dataclasses.field(default_factory=dict)
    n_calibration: int = 0
    n_held_out: int = 0
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    refit: str = "none"
    refit_order: str = "sequential"
    gates: Float[Tensor, " k"] = tensor_field(0)
    biases: Float[Tensor, "k d_model"] = tensor_field(0, 0)
    linears: Float[Tensor, "k2 d_model2 d_model3"] = tensor_field(0, 0, 0)
    calibration_delta_ce_uncorrected: float = math.nan
    held_out_delta_ce_uncorrected: float = math.nan
    held_out_curves_uncorrected: dict[str, Float[Tensor, " k"]] = dataclasses.field(default_factory=dict)
    refit_requested: str = ""
    calibration_fit: str = ""
    calibration_note: str = ""
    reference: str = ""
    choice_rule: str = ""
    margins: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    margins_uncorrected: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    calibration_intervals: dict[str, Float[Tensor, "k 2"]] = dataclasses.field(default_factory=dict)
    held_out_intervals: dict[str, Float[Tensor, "k 2"]] = dataclasses.field(default_factory=dict)
    held_out_intervals_uncorrected: dict[str, Float[Tensor, "k 2"]] = dataclasses.field(default_factory=dict)
    calibration_delta_ce_interval: list[float] = _no_interval()
    held_out_delta_ce_interval: list[float] = _no_interval()
    calibration_delta_ce_uncorrected_interval: list[float] = _no_interval()
    held_out_delta_ce_uncorrected_interval: list[float] = _no_interval()
    interval: dict[str, Any] = dataclasses.field(default_factory=dict)

    kind = "parallel_plan"

    def corrections(self) -> tuple[dict[int, float], dict[int, Tensor]]:
        """The fitted corrections as ``({layer: g}, {layer: b})`` for :func:`tl_steering.hooks.parallel_blocks`
        and :func:`tl_steering.parallel.parallelize` (empty dicts for ``refit="none"``)."""
        if self.refit == "none":
            return {}, {}
        gates = {lay: float(g) for lay, g in zip(self.layers, self.gates.tolist())}
        biases = {lay: self.biases[i].clone() for i, lay in enumerate(self.layers)} \
            if self.refit in ("affine", "linear") else {}
        # tagged: a call given only some parts of this correction says what is missing (plan_parts.check_complete)
        return PlanPart(gates, "gates", self.refit, self.layers), PlanPart(biases, "biases", self.refit, self.layers)

    def linear_maps(self) -> dict[int, Tensor]:
        """``{layer: W}`` of ``refit="linear"`` (empty otherwise), for ``parallel_blocks(..., linears=)`` and
        ``parallelize(..., linears=)``."""
        if self.refit != "linear":
            return {}
        return PlanPart({lay: self.linears[i].clone() for i, lay in enumerate(self.layers)}, "linears", self.refit,
                        self.layers)

    def hooks(self, model: Any) -> list:
        """``fwd_hooks`` that run the chosen plan with its corrections (the exact surrogate)."""
        from ..hooks import parallel_blocks

        gates, biases = self.corrections()
        return parallel_blocks(model, self.layers, gates, biases, self.linear_maps())

    def plan_of(self, strategy: str, k: int | None = None) -> list[int]:
        """The layer set ``strategy`` chose at ``k`` (default :attr:`k`)."""
        k = self.k if k is None else k
        if strategy not in self.plans or k not in self.k_values:
            raise InputError(f"no {strategy!r} plan at k={k}; strategies {self.strategies}, k {self.k_values}")
        return list(self.plans[strategy][self.k_values.index(k)])

    def at_k(self, curves: str = "held_out", k: int | None = None) -> dict[str, float]:
        """Every strategy's dCE at ``k`` (default :attr:`k`) on ``"held_out"`` or ``"calibration"`` windows."""
        k = self.k if k is None else k
        c = self.held_out_curves if curves == "held_out" else self.calibration_curves
        j = self.k_values.index(k)
        return {s: float(v[j]) for s, v in c.items()}

    def summary(self) -> dict[str, Any]:
        """Headline figures, every dCE with its ``_interval`` ``[low, high]`` (docs/parallel.md "Planning")."""
        def with_interval(name: str) -> dict[str, Any]:
            return {name: getattr(self, name), f"{name}_interval": list(getattr(self, f"{name}_interval"))}

        out: dict[str, Any] = {"k": self.k, "layers": list(self.layers), "strategy": self.strategy,
                               "refit": self.refit, "calibration_fit": self.calibration_fit,
                               **with_interval("calibration_delta_ce"), **with_interval("held_out_delta_ce"),
                               "cost_forward": self.cost.get("forward"), "cost_backward": self.cost.get("backward"),
                               "total_forward": self.total_cost.get("forward"),
                               "total_backward": self.total_cost.get("backward"),
                               **with_interval("held_out_delta_ce_uncorrected")}
        if self.refit_requested not in ("", self.refit):
            out["refit_requested"] = self.refit_requested
        out.update({n: getattr(self, n) for n in ("calibration_note", "reference") if getattr(self, n)})
        if self.k in self.k_values:
            j = self.k_values.index(self.k)
            for split, intervals in (("held_out", self.held_out_intervals),
                                     ("calibration", self.calibration_intervals)):
                for s, v in self.at_k(split).items():
                    out[f"{split}_delta_ce_{s}"] = v
                    if s in intervals:
                        out[f"{split}_delta_ce_{s}_interval"] = intervals[s][j].tolist()
            for s, m in self.margins.items():
                if s != self.reference:
                    out[f"calibration_margin_{s}"] = list(m)
        return out

    def plot(self, title: str | None = None):
        """Loss increase vs k for every strategy: held-out (solid) and calibration (dotted); plotly Figure."""
        import plotly.graph_objects as go

        fig = go.Figure()
        palette = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                   "#bcbd22", "#17becf", "#000000"]
        for i, s in enumerate(self.strategies):
            color = palette[i % len(palette)]
            width = 4 if s == self.strategy else 2
            err = None
            if s in self.held_out_intervals:  # the interval as asymmetric error bars
                y, iv = self.held_out_curves[s], self.held_out_intervals[s]
                err = {"type": "data", "symmetric": False, "array": (iv[:, 1] - y).tolist(),
                       "arrayminus": (y - iv[:, 0]).tolist(), "thickness": 1}
            fig.add_trace(go.Scatter(x=self.k_values, y=self.held_out_curves[s].tolist(), mode="lines+markers",
                                     name=f"{s} (held-out)", line={"color": color, "width": width},
                                     legendgroup=s, error_y=err))
            fig.add_trace(go.Scatter(x=self.k_values, y=self.calibration_curves[s].tolist(), mode="lines",
                                     name=f"{s} (calibration)", line={"color": color, "dash": "dot"},
                                     legendgroup=s, showlegend=False))
        fig.update_layout(title=title or f"Loss increase vs parallel layers, chosen: {self.strategy} at k={self.k} "
                                         f"({self.provenance.model})",
                          xaxis_title="k (layers made parallel)", yaxis_title="ΔCE (nats)", template="plotly_white")
        return fig


_FIELDS = [f.name for f in dataclasses.fields(ParallelPlan)]
ParallelPlan.added_fields = tuple(_FIELDS[_FIELDS.index("refit"):])  # after the first plan files: load without them

__all__ = ["ParallelPlan"]
