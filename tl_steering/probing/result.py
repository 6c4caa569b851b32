"""The result of a streaming geometry probe (:func:`tl_steering.probe`): per-layer running sums, counts and masked
counts, their means, merging, summary and figures (docs/probe.md)."""

import dataclasses
import math
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..errors import InputError
from ..results import Result, register
from ..stats import finite_mean

METRICS: tuple[str, ...] = ("resid_norm", "radial_coef", "tangent_alignment", "tangential_speed", "diversity",
                            "effective_rank", "participation_ratio")
SITES3: tuple[str, ...] = ("pre", "mid", "post")
QUANTITIES: dict[str, tuple[str, ...]] = {
    "resid_norm": ("resid_norm_pre", "resid_norm_mid", "resid_norm_post"),
    "radial_coef": ("radial_coef_attn", "radial_coef_ffn"),
    "tangent_alignment": ("tangent_alignment",),
    "tangential_speed": ("tangential_speed_attn", "tangential_speed_ffn"),
    "diversity": tuple(f"{s}_{w}" for s in ("pairwise_cosine", "resultant_length") for w in SITES3),
    "effective_rank": tuple(f"effective_rank_{w}" for w in SITES3),
    "participation_ratio": tuple(f"participation_ratio_{w}" for w in SITES3)}
TOKEN_METRICS = ("resid_norm", "radial_coef", "tangent_alignment", "tangential_speed")
SEQUENCE_METRICS = ("diversity", "effective_rank", "participation_ratio")
#: what ``probe(model)`` measures: every metric but the per-sequence spectra (docs/probe.md, "Which metrics by default")
DEFAULT_METRICS: tuple[str, ...] = (*TOKEN_METRICS, "diversity")
SEQUENCE_QUANTITIES: tuple[str, ...] = tuple(q for m in SEQUENCE_METRICS for q in QUANTITIES[m])
ALL_QUANTITIES: tuple[str, ...] = tuple(q for m in METRICS for q in QUANTITIES[m])


def _mean(s: Tensor, c: Tensor) -> Tensor:
    return torch.where(c > 0, s / c.to(torch.float64).clamp_min(1.0), torch.full_like(s, math.nan))


@register
@dataclasses.dataclass(kw_only=True)
class ProbeResult(Result):
    """Per-layer geometry accumulated by :func:`probe`: running sums, counts and masked counts per quantity and the
    probe's setup; means by :meth:`get` or ``res.<quantity>``. Fields: docs/probe.md, "The result"."""

    metrics: list[str] = dataclasses.field(default_factory=list)
    layers: list[int] = dataclasses.field(default_factory=list)
    parallel: list[bool] = dataclasses.field(default_factory=list)
    exclude_positions: list[int] = dataclasses.field(default_factory=lambda: [0])
    position_bins: bool = False
    bin_edges: Tensor = dataclasses.field(default_factory=lambda: torch.tensor([0, 1]))
    n_tokens: int = 0
    n_sequences: int = 0
    n_forwards: int = 0
    sums: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    counts: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    masked: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    kind = "probe"

    def __post_init__(self) -> None:
        if "effective_rank" not in self.metrics and any(q in self.sums for q in QUANTITIES["effective_rank"]):
            # a result saved when "diversity" still included the effective rank (before the two were split)
            self.metrics = [m for m in METRICS if m in self.metrics or m == "effective_rank"]
        if set(self.sums) != set(self.counts) or set(self.sums) != set(self.masked):
            raise InputError("ProbeResult: sums, counts and masked must hold the same quantities")
        for q, s in self.sums.items():
            if s.shape[0] != len(self.layers):
                raise InputError(f"ProbeResult.sums[{q!r}] has {s.shape[0]} layers, expected {len(self.layers)}")

    @property
    def quantities(self) -> list[str]:
        return [q for q in ALL_QUANTITIES if q in self.sums]

    def _check(self, name: str) -> str:
        if name in self.sums:
            return name
        if name in QUANTITIES:
            if name not in self.metrics:
                raise InputError(f"metric {name!r} was not probed (probed: {self.metrics}); pass it in metrics=")
            raise InputError(f"metric {name!r} has several quantities; ask for one of {QUANTITIES[name]}")
        if name in ALL_QUANTITIES:
            raise InputError(f"{name!r} was not probed (probed metrics: {self.metrics})")
        raise InputError(f"unknown quantity {name!r}; choose one of {self.quantities}")

    def get(self, name: str) -> Float[Tensor, " layer"]:
        """Per-layer mean of one quantity (float64, NaN where no row was counted)."""
        q = self._check(name)
        return _mean(self.sums[q].sum(-1), self.counts[q].sum(-1))

    def get_bins(self, name: str) -> Float[Tensor, "layer bin"]:
        """Per-layer, per-position-bin mean of one token quantity (``position_bins=True``)."""
        q = self._check(name)
        if q in SEQUENCE_QUANTITIES:
            raise InputError(f"{q!r} is a per-sequence statistic and has no position bins")
        return _mean(self.sums[q], self.counts[q])

    def n_masked(self, name: str) -> Tensor:
        """Per-layer number of masked rows (undefined statistic) of one quantity (int64)."""
        return self.masked[self._check(name)].sum(-1)

    def __getattr__(self, name: str) -> Any:
        if name in ALL_QUANTITIES and name in self.__dict__.get("sums", {}):
            return self.get(name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    def merge(self, other: "ProbeResult") -> "ProbeResult":
        """Add the running sums of another result of the same probe setup (e.g. from another process)."""
        same = (self.layers == other.layers and set(self.sums) == set(other.sums)
                and self.exclude_positions == other.exclude_positions
                and torch.equal(self.bin_edges, other.bin_edges))
        if not same:
            raise InputError("can only merge results of the same probe setup (layers, metrics, positions, bins)")
        return dataclasses.replace(
            self, **{f: {q: getattr(self, f)[q] + getattr(other, f)[q] for q in self.sums}
                     for f in ("sums", "counts", "masked")},
            n_tokens=self.n_tokens + other.n_tokens, n_sequences=self.n_sequences + other.n_sequences,
            n_forwards=self.n_forwards + other.n_forwards,
            provenance=dataclasses.replace(self.provenance, n_tokens=self.n_tokens + other.n_tokens,
                                           n_sequences=self.n_sequences + other.n_sequences))

    def summary(self) -> dict[str, Any]:
        """Mean over probed layers (NaN layers skipped: :func:`tl_steering.stats.finite_mean`) of every quantity, plus
        token counts."""
        return {"n_tokens": self.n_tokens, "n_sequences": self.n_sequences, "n_forwards": self.n_forwards,
                **{q: finite_mean(self.get(q)) for q in self.quantities}}

    def plot(self):
        """Per-layer curves, one panel per metric group (plotly Figure)."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        groups = [m for m in METRICS if m in self.metrics]
        fig = make_subplots(rows=len(groups), cols=1, shared_xaxes=True, subplot_titles=groups,
                            vertical_spacing=0.06 if len(groups) > 1 else 0.1)
        for r, m in enumerate(groups, start=1):
            for q in QUANTITIES[m]:
                if q in self.sums:
                    fig.add_trace(go.Scatter(x=self.layers, y=self.get(q).tolist(), mode="lines+markers",
                                             name=q, legendgroup=m), row=r, col=1)
        fig.update_xaxes(title_text="layer", row=len(groups), col=1)
        fig.update_layout(height=260 * len(groups) + 80, title=f"probe: {self.provenance.model} "
                          f"({self.n_tokens} tokens)")
        return fig

    def plot_bins(self, name: str = "tangent_alignment"):
        """Heatmap layer x position bin of one token quantity (needs ``position_bins=True``)."""
        import plotly.graph_objects as go

        if not self.position_bins:
            raise InputError("plot_bins needs a probe run with position_bins=True")
        z = self.get_bins(name)
        e = self.bin_edges.tolist()
        labels = [f"[{e[k]},{e[k + 1]})" for k in range(len(e) - 1)]
        fig = go.Figure(go.Heatmap(z=z.T.tolist(), x=self.layers, y=labels, colorbar={"title": name}))
        fig.update_layout(title=f"{name} by layer and position bin", xaxis_title="layer", yaxis_title="position bin")
        return fig


__all__ = ["ALL_QUANTITIES", "METRICS", "QUANTITIES", "ProbeResult", "SEQUENCE_METRICS", "SEQUENCE_QUANTITIES",
           "SITES3", "TOKEN_METRICS"]
