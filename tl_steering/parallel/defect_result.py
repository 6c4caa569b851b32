"""The result of :func:`tl_steering.parallel.parallel_defect`, :class:`DefectResult` (docs/defect.md), with the
paper's plan (the k lowest-C layers) and its speedup estimate; the planner is :func:`tl_steering.plan_parallel`."""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from .._util.claims import Claim, fmt, plural
from ..errors import InputError
from ..reference import band_check, paper_statement, published_number
from ..results import Result, register, tensor_field
from . import strategies as _strategies

SPEEDUP_LABEL = "estimate (sub-module times, critical path max(t_attn, t_ffn))"
"""Label of every speedup estimate (docs/defect.md "Speedup estimate"): an estimate, not a measured kernel speedup."""
DEFECT_VARIANTS: tuple[str, ...] = ("C", "C_phi", "C1", "C_tan")
"""Score variants (keys of :attr:`DefectResult.scores`); ``"C"`` is the primary one."""
BRACKET_TERMS: tuple[str, ...] = ("DPhi_A", "DA_Phi", "bracket")
"""Keys of :attr:`DefectResult.brackets`: RMS of DPhi.A, DA.Phi and [A, Phi] = DPhi.A - DA.Phi."""


class LayerScores:
    """The layer selection of a result with ``layers``, ``already_parallel`` and per-layer ``scores``
    (:class:`DefectResult`, :class:`~tl_steering.parallel.scores.ParallelScoresResult`)."""

    @property
    def candidates(self) -> list[int]:
        """Layers that can be made parallel (the sequential ones among :attr:`layers`)."""
        return [lay for lay, par in zip(self.layers, self.already_parallel) if not par]

    def score_of(self, name: str) -> dict[int, float]:
        """``{layer: score}`` over the candidates, for :mod:`tl_steering.parallel.strategies`."""
        if name not in self.scores:
            raise InputError(f"unknown score {name!r}; choose one of {sorted(self.scores)}")
        pos = {lay: i for i, lay in enumerate(self.layers)}
        return {lay: float(self.scores[name][pos[lay]]) for lay in self.candidates}


@register
@dataclasses.dataclass(kw_only=True)
class DefectResult(Result, LayerScores):
    """Per-layer sequential-to-parallel defect scores, optionally with the loss they predict and timings; every
    per-layer tensor is indexed like :attr:`layers`. Each field is described in docs/defect.md "DefectResult"."""

    layers: list[int] = dataclasses.field(default_factory=list)
    already_parallel: list[bool] = dataclasses.field(default_factory=list)
    score: Float[Tensor, " layer"] = tensor_field(0)
    scores: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    nonlinearity: Float[Tensor, " layer"] = tensor_field(0)
    counterfactual_scores: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    counterfactual_nonlinearity: Float[Tensor, " layer"] = tensor_field(0)
    rms: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    phi_check: Float[Tensor, " layer"] = tensor_field(0)
    brackets: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    peer_scores: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    n_tokens: int = 0
    evaluated: bool = False
    clean_loss: float = math.nan
    delta_ce: Float[Tensor, " layer"] = tensor_field(0)
    spearman: dict[str, float] = dataclasses.field(default_factory=dict)
    k_values: list[int] = dataclasses.field(default_factory=list)
    curves: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    curve_layers: dict[str, list] = dataclasses.field(default_factory=dict)
    t_attn: Float[Tensor, " layer"] = tensor_field(0)
    t_ffn: Float[Tensor, " layer"] = tensor_field(0)
    t_forward: float = math.nan
    t_other: float = math.nan
    timing_shape: list[int] = dataclasses.field(default_factory=list)
    timing_device: str = ""
    seconds: float = 0.0
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    kind = "defect"
    added_fields = ("peer_scores",)

    def __post_init__(self) -> None:
        n = len(self.layers)
        # per-layer fields left at their (empty) defaults mean "not computed": NaN per layer
        tensors = ("score", "nonlinearity", "counterfactual_nonlinearity", "phi_check", "delta_ce", "t_attn", "t_ffn")
        for name in tensors:
            if n and len(getattr(self, name)) == 0:
                setattr(self, name, torch.full((n,), math.nan, dtype=torch.float64))
        if n and not self.already_parallel:
            self.already_parallel = [False] * n
        if "C" in self.scores and len(self.score) == n and bool(torch.isnan(self.score).all()):
            self.score = self.scores["C"].clone()
        per_layer = {name: getattr(self, name) for name in ("already_parallel",) + tensors}
        for group in ("scores", "counterfactual_scores", "rms", "brackets", "peer_scores"):
            per_layer.update({f"{group}[{k!r}]": v for k, v in getattr(self, group).items()})
        for name, value in per_layer.items():
            if len(value) != n:
                raise InputError(f"DefectResult.{name} has {len(value)} entries for {n} layers; build it "
                                 "with parallel_defect")

    # -- layer selection ------------------------------------------------------------------------------------
    def plan(self, k: int, variant: str = "C") -> list[int]:
        """The k sequential layers (never an already-parallel block) with the lowest score ``variant``, sorted by
        layer index (:func:`~.strategies.one_shot`: ties go to the lower layer, NaN scores rank last)."""
        return _strategies.one_shot(self.candidates, self.score_of(variant), k)

    # -- speedup --------------------------------------------------------------------------------------------
    def speedup_estimate(self, layers: Sequence[int]) -> dict[str, Any]:
        """Estimated speedup of making ``layers`` parallel from the measured sub-module times: ``T_seq / T_par`` of
        docs/defect.md "Speedup estimate" (already-parallel blocks count with ``max`` in both; ``*_with_other`` adds
        :attr:`t_other` to both)."""
        if not self.layers or not torch.isfinite(self.t_attn).all() or not torch.isfinite(self.t_ffn).all():
            raise InputError("no sub-module times: run parallel_defect(..., timing=True)")
        picked = sorted({int(x) for x in layers})
        unknown = [x for x in picked if x not in self.layers]
        if unknown:
            raise InputError(f"layers {unknown} were not analysed (analysed: {list(self.layers)})")
        ta, tf, t_other = self.t_attn.tolist(), self.t_ffn.tolist(), self.t_other
        t_seq = t_par = 0.0
        for i, lay in enumerate(self.layers):
            seq_cost = max(ta[i], tf[i]) if self.already_parallel[i] else ta[i] + tf[i]
            t_seq += seq_cost
            t_par += max(ta[i], tf[i]) if lay in picked else seq_cost
        return {"label": SPEEDUP_LABEL, "layers": picked, "k": len(picked), "T_seq_s": t_seq, "T_par_s": t_par,
                "speedup": t_seq / t_par if t_par > 0 else math.nan, "T_other_s": t_other,
                "speedup_with_other": (t_seq + t_other) / (t_par + t_other) if math.isfinite(t_other) else math.nan,
                "timing_shape": list(self.timing_shape), "device": self.timing_device}

    def claim(self, k: int | None = None) -> Claim:
        """The paper's parallelization claim (:func:`ordering_claim`) on this result's curves at ``k`` (default: half
        the candidate layers); not judged without the curves at that k (``parallel_defect(..., evaluate=True)``)."""
        k = len(self.candidates) // 2 if k is None else k
        if not self.evaluated or k not in self.k_values:
            why = f"no loss curves at k = {k} (parallel_defect(..., evaluate=True)): not judged"
            return ordering_claim(k, len(self.candidates), math.nan, math.nan, missing=why)
        lo, hi = (float(self.curves[s][self.k_values.index(k)]) for s in ("lowest", "highest"))
        return ordering_claim(k, len(self.candidates), lo, hi)

    # -- display --------------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        cand = self.candidates
        out: dict[str, Any] = {"n_layers": len(self.layers), "n_candidates": len(cand),
                               "n_already_parallel": int(sum(self.already_parallel)),
                               "n_tokens": self.n_tokens}
        idx = [i for i, par in enumerate(self.already_parallel) if not par]
        if idx:
            c = self.score[idx]
            out.update({"C_mean": float(c.mean()), "C_min": float(c.min()), "C_max": float(c.max()),
                        "C_argmin_layer": cand[int(c.argmin())], "C_argmax_layer": cand[int(c.argmax())],
                        "nonlinearity_median": float(self.nonlinearity[idx].nanmedian())})
        half = len(cand) // 2
        out["k_half"] = half
        if self.evaluated:
            out["clean_loss"] = self.clean_loss
            out.update({f"spearman_{k}": v for k, v in self.spearman.items()})
            if "k" in self.curves and half in self.k_values:
                j = self.k_values.index(half)
                for s in ("lowest", "highest", "contiguous", "random_mean"):
                    out[f"dCE_{s}_half"] = float(self.curves[s][j])
        if cand and torch.isfinite(self.t_attn).all() and torch.isfinite(self.t_ffn).all():
            est = self.speedup_estimate(self.plan(half))
            out["speedup_estimate_half"] = est["speedup"]
            out["speedup_estimate_with_other_half"] = est["speedup_with_other"]
        return out

    def plot(self, title: str | None = None):
        """Per-layer score variants (top) and, when computed, the bracket norms (bottom); plotly Figure."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        rows = 2 if self.brackets else 1
        fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                            subplot_titles=["defect scores C_l"] + (["Lie-bracket terms (RMS per token)"]
                                                                    if rows == 2 else []))
        for name, val in self.scores.items():
            fig.add_trace(go.Scatter(x=self.layers, y=val.tolist(), mode="lines+markers", name=name), row=1, col=1)
        par = [lay for lay, p in zip(self.layers, self.already_parallel) if p]
        if par:
            fig.add_trace(go.Scatter(x=par, y=[0.0] * len(par), mode="markers", name="already parallel",
                                     marker={"symbol": "x", "size": 10, "color": "black"}), row=1, col=1)
        for name, val in self.brackets.items():
            fig.add_trace(go.Scatter(x=self.layers, y=val.tolist(), mode="lines+markers", name=name), row=2, col=1)
        fig.update_xaxes(title_text="layer", row=rows, col=1)
        fig.update_yaxes(title_text="score", row=1, col=1)
        fig.update_layout(title=title or f"Sequential-to-parallel defect ({self.provenance.model})",
                          template="plotly_white")
        return fig

    def plot_curves(self, title: str | None = None):
        """dCE vs number of parallelized layers k for each layer choice (plotly Figure)."""
        import plotly.graph_objects as go

        if not self.evaluated:
            raise InputError("no loss curves in this result: run parallel_defect(..., evaluate=True)")
        fig = go.Figure()
        k = self.curves["k"].tolist()
        for name, label in (("lowest", "lowest C"), ("highest", "highest C"), ("contiguous", "contiguous"),
                            ("random_mean", "random (mean)")):
            fig.add_trace(go.Scatter(x=k, y=self.curves[name].tolist(), mode="lines+markers", name=label))
        rnd = self.curves.get("random")
        if rnd is not None and rnd.numel():
            for r, row in enumerate(rnd.tolist()):
                fig.add_trace(go.Scatter(x=k, y=row, mode="markers", name=f"random draw {r}",
                                         showlegend=r == 0, legendgroup="draws",
                                         marker={"color": "gray", "size": 5, "opacity": 0.5}))
        fig.update_layout(title=title or f"Loss increase vs parallelized layers ({self.provenance.model})",
                          xaxis_title="k (layers made parallel)", yaxis_title="ΔCE (nats)",
                          template="plotly_white")
        return fig


def ordering_claim(k: int, n_candidates: int, lowest: float, highest: float, strategy: str = "C",
                   missing: str = "") -> Claim:
    """The paper's claim on a plan of ``k`` of ``n_candidates`` layers (docs/defect.md): holds when the ``k``
    highest-C layers' dCE ``highest`` is at least the published threshold times the plan's ``lowest`` and ``lowest``
    is in its published band; does not hold when the control costs no more; partly holds in between."""
    if missing:
        return Claim(paper_statement("defect"), "not judged", missing)
    thr = published_number("parallel_gpt2_large_high_defect_degrades")["band"][0]
    ratio = highest / lowest if lowest > 0 else (math.inf if highest > 0 else math.nan)
    cost = band_check(lowest, "parallel_gpt2_large_delta_ce")
    ctrl = f"the {plural(k, 'highest-C layer')} cost"
    if math.isinf(ratio) or ratio >= thr:
        order = (f"{ctrl} {highest:+.3g} nats while the plan costs nothing (the ordering holds)" if math.isinf(ratio)
                 else f"{ctrl} {fmt(ratio)}x as much (at least {fmt(thr)}x: the ordering holds)")
        verdict = "holds" if cost.ok else "partly holds"
    elif not math.isfinite(ratio):
        verdict, order = "not judged", "the highest-C control was not measured"
    elif ratio > 1:
        verdict, order = "partly holds", (f"{ctrl} only {fmt(ratio)}x as much (below the {fmt(thr)}x threshold [I]: "
                                          "weaker than the paper's sharp degradation)")
    else:
        verdict, order = "does not hold", f"{ctrl} {fmt(ratio)}x as much (not more: the ordering does not hold)"
    which = "lowest-C" if strategy in ("C", "lowest_C") else f"{strategy}-chosen"
    return Claim(paper_statement("defect"), verdict, f"the {k} {which} of {plural(n_candidates, 'layer')} cost ΔCE "
                 f"{lowest:+.3g} nats ({cost.why}), and {order}", value=lowest, parts={"high_over_low": ratio})


__all__ = ["BRACKET_TERMS", "DEFECT_VARIANTS", "SPEEDUP_LABEL", "DefectResult", "LayerScores", "ordering_claim"]
