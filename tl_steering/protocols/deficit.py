"""Angular-deficit diagnostic: how well the attention-only update aligns with the real block update
(protocol 1 of the paper; specification: docs/deficit.md)."""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .. import geometry as geo
from ..data.windows import model_tokens
from ..results import Result, register, tensor_field
from ..data.sharding import World, gather_rows, my_batches
from ..data.batching import iter_batches
from .._util.claims import Claim, fmt, pct
from ..reference import paper_statement, published_number
from ..stats import bin_labels, bootstrap_ci, check_exclude_positions, finite_mean, masked_mean, position_bins, position_mask
from ..validation import as_int
from ..backends import check_finite
from ..backends.ownership import exclusive


def activation64(ad: Any, cache: Any, layer: int, site: str) -> Float[Tensor, "b p d"]:
    """The cached activation of ``layer`` at ``site`` as float64, checked finite (NonFiniteError names both)."""
    x = cache[ad.hook_name(layer, site)]
    check_finite(x, layer, site)
    return geo.to64(x)


@register
@dataclasses.dataclass(kw_only=True)
class DeficitResult(Result):
    """Angular deficit per layer with its variants (a)-(d), by position bin, and its bootstrap CIs (see
    :func:`angular_deficit`); every field is defined in docs/deficit.md ("Definitions" and its notes)."""

    layers: list[int] = dataclasses.field(default_factory=list)
    parallel: list[bool] = dataclasses.field(default_factory=list)
    deficit: Float[Tensor, " layer"] = tensor_field(0)
    deficit_ci: Float[Tensor, "layer 2"] = tensor_field(0, 2)
    deficit_median: Float[Tensor, " layer"] = tensor_field(0)
    per_sequence_alignment: Float[Tensor, "seq layer"] = tensor_field(0, 0)
    mean: float = math.nan
    mean_ci: list[float] = dataclasses.field(default_factory=lambda: [math.nan, math.nan])
    mean_excluding_first: float = math.nan
    mean_excluding_first_ci: list[float] = dataclasses.field(default_factory=lambda: [math.nan, math.nan])
    untangented_deficit: Float[Tensor, " layer"] = tensor_field(0)
    angle_deficit: Float[Tensor, " layer"] = tensor_field(0)
    error_attention: Float[Tensor, " layer"] = tensor_field(0)
    error_parallel: Float[Tensor, " layer"] = tensor_field(0)
    ffn_contribution: Float[Tensor, " layer"] = tensor_field(0)
    ffn_contribution_mean: float = math.nan
    r2_attention: Float[Tensor, " layer"] = tensor_field(0)
    r2_parallel: Float[Tensor, " layer"] = tensor_field(0)
    position_bin_edges: list[int] = dataclasses.field(default_factory=list)
    deficit_by_position: Float[Tensor, "layer bin"] = tensor_field(0, 0)
    position_bin_counts: Int[Tensor, "layer bin"] = tensor_field(0, 0, dtype=torch.int64)
    n_tokens_used: Int[Tensor, " layer"] = tensor_field(0, dtype=torch.int64)
    n_masked: Int[Tensor, " layer"] = tensor_field(0, dtype=torch.int64)
    residual_identity_error: list[float] = dataclasses.field(default_factory=list)
    exclude_positions: list[int] = dataclasses.field(default_factory=list)
    seq_len: int = 0

    kind = "angular_deficit"

    def summary(self) -> dict[str, Any]:
        d = self.deficit
        return {
            "deficit_mean": self.mean, "deficit_mean_ci": list(self.mean_ci),
            "deficit_mean_excluding_first": self.mean_excluding_first,
            "deficit_min": float(d.min()) if d.numel() else math.nan,
            "deficit_max": float(d.max()) if d.numel() else math.nan,
            **{f"{n}_mean": finite_mean(getattr(self, n)) for n in ("untangented_deficit", "angle_deficit",
                                                                      "error_attention", "error_parallel")},
            "ffn_contribution_mean": self.ffn_contribution_mean,
            **{f"{n}_mean": finite_mean(getattr(self, n)) for n in ("r2_attention", "r2_parallel")},
            "n_layers": len(self.layers),
            "n_tokens_used": int(self.n_tokens_used.sum()) if self.n_tokens_used.numel() else 0,
            "n_masked": int(self.n_masked.sum()) if self.n_masked.numel() else 0}

    def claim(self) -> Claim:
        """The paper's claim on the deficit (docs/deficit.md): where the mean deficit falls beside the paper's GPT-2
        and Llama-3-8B values, and whether adding the FFN improves the one-step angular prediction (the verdict)."""
        lo, hi = published_number("deficit_gpt2")["value"], published_number("deficit_llama3_8b")["value"]
        m, f, ci = self.mean, self.ffn_contribution_mean, self.mean_ci
        where = ("between the paper's GPT-2 and Llama-3-8B values" if lo <= m <= hi else
                 "below the paper's GPT-2 value" if m < lo else "above the paper's Llama-3-8B value")
        verdict = "holds" if f > 0 else "does not hold" if math.isfinite(f) else "not judged"
        ffn = {"holds": f"adding the FFN improves the one-step angular prediction by {pct(f)}",
               "does not hold": f"adding the FFN does not improve the one-step angular prediction ({pct(f)})",
               "not judged": "the FFN's one-step contribution is not available"}[verdict]
        return Claim(paper_statement("deficit"), verdict, f"the mean deficit is {fmt(m)} (95% CI [{fmt(ci[0])}, "
                     f"{fmt(ci[1])}]), {where}, and {ffn}", value=m, interval=(ci[0], ci[1]))

    def plot(self, title: str | None = None):
        """Per-layer curves: the deficit (with its CI band) and variants a, b; the one-step errors and R^2."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        x = list(self.layers)
        fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                            subplot_titles=("Angular deficit", "One-step angular error and velocity R²"))
        lo, hi = self.deficit_ci[:, 0].tolist(), self.deficit_ci[:, 1].tolist()
        fig.add_trace(go.Scatter(x=x + x[::-1], y=hi + lo[::-1], fill="toself", line={"width": 0},
                                 fillcolor="rgba(31,119,180,0.2)", name="95% CI", hoverinfo="skip"), row=1, col=1)
        for name, y, color in (("1 - cos(P_u a, P_u Δx)", self.deficit, "#1f77b4"),
                               ("1 - cos(a, Δx)", self.untangented_deficit, "#ff7f0e"),
                               ("arccos(align)/π", self.angle_deficit, "#2ca02c")):
            fig.add_trace(go.Scatter(x=x, y=y.tolist(), mode="lines+markers", name=name,
                                     line={"color": color}), row=1, col=1)
        for name, y, dash in (("e_A (rad)", self.error_attention, None),
                              ("e_AF (rad)", self.error_parallel, None),
                              ("R² attention", self.r2_attention, "dot"),
                              ("R² attention+Φ(x)", self.r2_parallel, "dot")):
            fig.add_trace(go.Scatter(x=x, y=y.tolist(), mode="lines+markers", name=name,
                                     line={"dash": dash}), row=2, col=1)
        fig.update_xaxes(title_text="layer", row=2, col=1)
        fig.update_layout(title=title or f"Angular deficit (mean {self.mean:.3f}, "
                          f"{self.provenance.model})", template="plotly_white", height=700)
        return fig

    def plot_positions(self, title: str | None = None):
        """Heatmap of the deficit by layer and log-spaced position bin."""
        import plotly.graph_objects as go

        labels = bin_labels(self.position_bin_edges, self.seq_len or self.position_bin_edges[-1])
        z = [[None if not math.isfinite(v) else v for v in row] for row in self.deficit_by_position.tolist()]
        fig = go.Figure(go.Heatmap(z=z, x=labels, y=[str(lay) for lay in self.layers], colorscale="Viridis",
                                   colorbar={"title": "deficit"}))
        fig.update_layout(title=title or "Angular deficit by layer and position bin", xaxis_title="position bin",
                          yaxis_title="layer", template="plotly_white")
        return fig


def _collect(ad: Any, tokens: Tensor, layer_list: list[int], excl: Sequence[int], batch_size: int,
             world: World | None) -> tuple[dict[str, Tensor], Tensor]:
    """The per-window sums and means (docs/deficit.md) of every window, gathered in window order from the ranks'
    batches (the reduction is then the same on one rank or many: docs/scale_out.md), and the position-bin edges."""
    n_seq, n_pos = tokens.shape
    n_lay = len(layer_list)
    pmask = position_mask(n_pos, excl, device=tokens.device)
    edges, bin_index = position_bins(n_pos)
    n_bins = len(edges) - 1
    bin_index = bin_index.to(tokens.device)
    onehot = torch.nn.functional.one_hot(bin_index.clamp_min(0), n_bins).to(torch.float64)
    onehot[bin_index < 0] = 0.0  # position 0 belongs to no bin

    keys = ("align", "untangented", "angle", "e_a", "e_af")
    per_seq = {k: torch.full((n_seq, n_lay), math.nan, dtype=torch.float64) for k in keys}
    per_seq["r2"] = torch.zeros(n_seq, 3, n_lay, dtype=torch.float64)
    per_seq["bin_sum"] = torch.zeros(n_seq, n_lay, n_bins, dtype=torch.float64)
    per_seq["bin_count"] = torch.zeros(n_seq, n_lay, n_bins, dtype=torch.float64)
    per_seq["used"] = torch.zeros(n_seq, n_lay, dtype=torch.int64)
    per_seq["masked"] = torch.zeros(n_seq, n_lay, dtype=torch.int64)
    per_seq["identity"] = torch.full((n_seq, n_lay), math.nan, dtype=torch.float64)  # first batch only
    mine = my_batches(n_seq, batch_size, world)

    names = [ad.hook_name(lay, s) for lay in layer_list for s in ("resid_pre", "attn_out", "resid_post")]
    for rows, logits, cache in iter_batches(ad, tokens, names, batch_size, first_names=ad.identity_names(layer_list),
                                            rows=mine):
        del logits
        if rows.start == 0:
            identity = ad.check_residual_identity(cache, layer_list)
            per_seq["identity"][0] = torch.tensor([identity[lay] for lay in layer_list], dtype=torch.float64)
        base = pmask.expand(rows.stop - rows.start, n_pos)
        for j, layer in enumerate(layer_list):
            x_model = cache[ad.hook_name(layer, "resid_pre")]
            x = activation64(ad, cache, layer, "resid_pre")
            a = activation64(ad, cache, layer, "attn_out")
            post = activation64(ad, cache, layer, "resid_post")
            with torch.no_grad():
                phi = geo.to64(ad.ffn(layer)(x_model))
            dx = post - x
            r = geo.norm(x)
            ta, tdx, taf = geo.tangential_part(a, x), geo.tangential_part(dx, x), geo.tangential_part(a + phi, x)
            valid = base & ~(geo.degenerate_mask(x, base) | geo.degenerate_mask(ta, base)
                             | geo.degenerate_mask(tdx, base))
            per_seq["masked"][rows, j] = (base & ~valid).sum(-1).cpu()
            per_seq["used"][rows, j] = valid.sum(-1).cpu()

            align = geo.tangent_alignment(a, dx, x)  # cos(P_u a, P_u Dx)
            for key, v in {"align": align, "untangented": geo.safe_cosine(a, dx), "angle": geo.angle(ta, tdx) / math.pi,
                           "e_a": geo.angle(x + a, post), "e_af": geo.angle(x + a + phi, post)}.items():
                per_seq[key][rows, j] = masked_mean(v, valid).cpu()

            w = valid.to(torch.float64)
            inv_r2 = w / (r * r).clamp_min(geo.EPS_NORM**2)
            for q, resid in enumerate((tdx - ta, tdx - taf, tdx)):  # residual A, residual AF, total
                per_seq["r2"][rows, q, j] = ((resid**2).sum(-1) * inv_r2).sum(-1).cpu()

            bw = onehot.unsqueeze(0) * w.unsqueeze(-1)  # [b, pos, bin]
            per_seq["bin_sum"][rows, j] = torch.einsum(
                "bp,bpk->bk", torch.where(valid, align, torch.zeros_like(align)), bw).cpu()
            per_seq["bin_count"][rows, j] = bw.sum(1).cpu()

    return gather_rows(per_seq, mine, world), edges


@exclusive
def angular_deficit(model: Any, tokens: Tensor, layers: Sequence[int] | int | None = None,
                    exclude_positions: Sequence[int] = (0,), n_bootstrap: int = 1000, seed: int = 0,
                    corpus: str | None = None, batch_size: int = 8, world: World | None = None) -> DeficitResult:
    """Angular deficit of the attention-only update against the real block update (docs/deficit.md).

    Arguments: docs/deficit.md, "Arguments of angular_deficit"."""
    ad, tokens, corpus = model_tokens(model, tokens, corpus)
    layer_list = ad.layers(layers)
    excl = check_exclude_positions(exclude_positions)
    n_bootstrap = as_int(n_bootstrap, "n_bootstrap", minimum=0)
    seed = as_int(seed, "seed")
    batch_size = as_int(batch_size, "batch_size", minimum=1)

    per_seq, edges = _collect(ad, tokens, layer_list, excl, batch_size, world)
    n_lay, n_pos = len(layer_list), tokens.shape[1]
    r2 = per_seq.pop("r2").sum(0)
    bin_sum, bin_count = per_seq.pop("bin_sum").sum(0), per_seq.pop("bin_count").sum(0)
    used, masked = per_seq.pop("used").sum(0), per_seq.pop("masked").sum(0)
    identity = per_seq.pop("identity")[0].tolist()
    means = {k: torch.nanmean(v, dim=0) for k, v in per_seq.items()}
    not_first = torch.tensor([lay != 0 for lay in layer_list])

    def stat(sample: Tensor) -> Tensor:
        d = 1.0 - torch.nanmean(sample, dim=0)
        excl_first = d[not_first].mean() if bool(not_first.any()) else torch.tensor(math.nan, dtype=d.dtype)
        return torch.cat([d, d.mean()[None], excl_first[None]])

    point = stat(per_seq["align"])
    ci = bootstrap_ci(per_seq["align"], stat, n_bootstrap=n_bootstrap, seed=seed)
    e_a, e_af = means["e_a"], means["e_af"]
    contribution = (e_a - e_af) / e_a
    return DeficitResult(
        provenance=ad.provenance(tokens, corpus=corpus, seed=seed, protocol="angular_deficit", layers=layer_list,
                                 exclude_positions=list(excl), n_bootstrap=n_bootstrap, batch_size=batch_size),
        layers=layer_list, parallel=[ad.is_parallel(lay) for lay in layer_list], deficit=1.0 - means["align"],
        deficit_ci=ci[:n_lay], deficit_median=1.0 - torch.nanmedian(per_seq["align"], dim=0).values,
        per_sequence_alignment=per_seq["align"], mean=float(point[n_lay]), mean_ci=[float(v) for v in ci[n_lay]],
        mean_excluding_first=float(point[n_lay + 1]), mean_excluding_first_ci=[float(v) for v in ci[n_lay + 1]],
        untangented_deficit=1.0 - means["untangented"], angle_deficit=means["angle"], error_attention=e_a,
        error_parallel=e_af, ffn_contribution=contribution, ffn_contribution_mean=finite_mean(contribution),
        r2_attention=1.0 - r2[0] / r2[2], r2_parallel=1.0 - r2[1] / r2[2], position_bin_edges=edges,
        deficit_by_position=1.0 - bin_sum / bin_count.where(bin_count > 0, torch.tensor(math.nan, dtype=torch.float64)),
        position_bin_counts=bin_count.round().to(torch.int64), n_tokens_used=used, n_masked=masked,
        residual_identity_error=identity, exclude_positions=list(excl), seq_len=n_pos)


__all__ = ["DeficitResult", "angular_deficit"]
