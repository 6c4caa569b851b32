"""The result of :func:`tl_steering.plan_parallel`: :class:`ParallelPlan` (docs/parallel.md "Planning").

Its tensors (``gates``, ``biases``, ``linears``: the fitted corrections) are :attr:`ParallelPlan.sidecar_fields`:
``plan.save("plan.json")`` writes them to ``plan.tensors.safetensors`` beside the JSON (a linear-corrected plan
holds k x d_model^2 float64 entries, 40 MB for SmolLM2 at k = 15, which JSON lists would blow up), and
``ParallelPlan.load`` reads them back bit for bit; plan files written before (tensors inline) still load.
"""

import dataclasses
import math
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from ..errors import InputError
from ..results import Result, register
from .plan_parts import PlanPart


@register
@dataclasses.dataclass(kw_only=True)
class ParallelPlan(Result):
    """A set of layers to make parallel, how it was chosen and what it costs (loss and planner passes).

    Attributes:
        layers: the chosen layers (sorted).
        k: ``len(layers)``.
        strategy: the strategy that produced :attr:`layers`.
        requested: the ``strategy`` argument (``"best"`` or a strategy name).
        candidates: the sequential layers that could be chosen.
        calibration_delta_ce / held_out_delta_ce: CE(plan) - CE(clean) on the calibration / held-out windows.
        clean_loss_calibration / clean_loss_held_out: the clean mean next-token CE on each.
        cost: passes over the calibration windows the chosen strategy needed on its own (``forward``,
            ``backward``, ``seconds``); total_cost: of the whole call (every strategy and every curve point).
        k_values: the k of the curves; strategies: the strategies compared.
        calibration_curves / held_out_curves: per strategy, dCE at each k (float64).
        plans: per strategy, the layer set at each k.
        strategy_costs: per strategy, its own cost (as :attr:`cost`).
        n_calibration / n_held_out: token windows in each set.
        options: the call's options.
        refit: the closed-form correction of the parallel FFN writes (``"none"``, ``"gate"``, ``"affine"``,
            ``"linear"``;
            :mod:`tl_steering.parallel.refit`), fitted on the calibration windows for EVERY plan measured (so
            every dCE above, and the choice, is of the corrected plans); refit_order: ``"sequential"`` or
            ``"joint"``.
        gates: ``[k]`` float64, the fitted g_l of :attr:`layers` (in that order; ones for ``"none"``).
        biases: ``[k, d_model]`` float64, the fitted b_l (zeros unless ``"affine"`` or ``"linear"``).
        linears: ``[k, d_model, d_model]`` float64, the fitted W_l of ``refit="linear"`` (the write adds a W_l,
            a the block's attention write); ``[0, 0, 0]`` for the other refits.
        calibration_delta_ce_uncorrected / held_out_delta_ce_uncorrected: the chosen layers' dCE without the
            correction (equal to the corrected ones for ``"none"``).
        held_out_curves_uncorrected: per strategy, the held-out dCE of its plans WITHOUT the correction at each
            k (``plan_parallel(..., uncorrected_curves=True)`` with a refit; else empty).
    """

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
    gates: Float[Tensor, " k"] = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    biases: Float[Tensor, "k d_model"] = dataclasses.field(
        default_factory=lambda: torch.zeros(0, 0, dtype=torch.float64))
    linears: Float[Tensor, "k2 d_model2 d_model3"] = dataclasses.field(
        default_factory=lambda: torch.zeros(0, 0, 0, dtype=torch.float64))
    calibration_delta_ce_uncorrected: float = math.nan
    held_out_delta_ce_uncorrected: float = math.nan
    held_out_curves_uncorrected: dict[str, Float[Tensor, " k"]] = dataclasses.field(default_factory=dict)

    kind = "parallel_plan"
    # the closed-form corrections (refit) came after the first plans: older files load uncorrected;
    # held_out_curves_uncorrected: 2026-12-05 (issue 30)
    added_fields = ("refit", "refit_order", "gates", "biases", "linears", "calibration_delta_ce_uncorrected",
                    "held_out_delta_ce_uncorrected", "held_out_curves_uncorrected")
    #: tensors a JSON save writes to the safetensors sidecar (``<stem>.tensors.safetensors``; results.Result.save)
    sidecar_fields: ClassVar[tuple[str, ...]] = ("gates", "biases", "linears")

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
        out: dict[str, Any] = {"k": self.k, "layers": list(self.layers), "strategy": self.strategy,
                               "refit": self.refit,
                               "calibration_delta_ce": self.calibration_delta_ce,
                               "held_out_delta_ce": self.held_out_delta_ce,
                               "cost_forward": self.cost.get("forward"), "cost_backward": self.cost.get("backward"),
                               "total_forward": self.total_cost.get("forward"),
                               "total_backward": self.total_cost.get("backward"),
                               "held_out_delta_ce_uncorrected": self.held_out_delta_ce_uncorrected}
        if self.k in self.k_values:
            out.update({f"held_out_delta_ce_{s}": v for s, v in self.at_k().items()})
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
            fig.add_trace(go.Scatter(x=self.k_values, y=self.held_out_curves[s].tolist(), mode="lines+markers",
                                     name=f"{s} (held-out)", line={"color": color, "width": width},
                                     legendgroup=s))
            fig.add_trace(go.Scatter(x=self.k_values, y=self.calibration_curves[s].tolist(), mode="lines",
                                     name=f"{s} (calibration)", line={"color": color, "dash": "dot"},
                                     legendgroup=s, showlegend=False))
        fig.update_layout(title=title or f"Loss increase vs parallel layers, chosen: {self.strategy} at k={self.k} "
                                         f"({self.provenance.model})",
                          xaxis_title="k (layers made parallel)", yaxis_title="ΔCE (nats)", template="plotly_white")
        return fig


__all__ = ["ParallelPlan"]
