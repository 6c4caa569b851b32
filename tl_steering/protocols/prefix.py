"""Prefix-indexed causal dynamics (docs/prefix.md): how a perturbation of token j travels to later tokens, and
prefix-set diversity statistics as a function of the prefix length."""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .. import geometry as geo
from ..backends import check_finite
from ..data.windows import model_tokens
from ..errors import InputError
from ..metrics import kl_divergence
from ..results import Result, register, tensor_field
from .._util.claims import Claim, fmt
from ..reference import paper_statement
from ..stats import check_exclude_positions, position_mask
from ..validation import as_choice, as_choices, as_float, as_int, as_int_list
from ..backends.ownership import exclusive
from .deficit import activation64

STATS: tuple[str, ...] = ("pairwise_cosine", "resultant_length", "effective_rank", "participation_ratio")



@register
@dataclasses.dataclass(kw_only=True)
class PrefixSensitivityResult(Result):
    """Spread of a perturbation at position j to later positions (see :func:`prefix_sensitivity`); every field is
    defined in docs/prefix.md ("Prefix sensitivity")."""

    mode: str = "noise"
    eps: float = 0.0
    perturb_layer: int = 0
    positions: list[int] = dataclasses.field(default_factory=list)
    layers: list[int] = dataclasses.field(default_factory=list)
    distance: Int[Tensor, " distance"] = tensor_field(0, dtype=torch.int64)
    angle: Float[Tensor, "layer distance"] = tensor_field(0, 0)
    kl: Float[Tensor, " distance"] = tensor_field(0)
    count: Int[Tensor, " distance"] = tensor_field(0, dtype=torch.int64)
    angle_final: Float[Tensor, " distance"] = tensor_field(0)
    prefix_max_angle: float = math.nan
    prefix_max_rel_change: float = math.nan
    prefix_max_kl: float = math.nan
    prefix_bitwise_equal: bool = False
    replaced_tokens: list[list[int]] = dataclasses.field(default_factory=list)

    kind = "prefix_sensitivity"

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {n: getattr(self, n) for n in ("mode", "eps", "perturb_layer", "positions",
                                                              "prefix_max_angle", "prefix_max_rel_change",
                                                              "prefix_max_kl", "prefix_bitwise_equal")}
        if self.kl.numel():
            out["kl_at_perturbed"] = float(self.kl[0])
            out["angle_final_at_perturbed"] = float(self.angle_final[0])
            if self.kl.numel() > 1:
                out["kl_mean_later"] = float(self.kl[1:].nanmean())
                out["angle_final_mean_later"] = float(self.angle_final[1:].nanmean())
        return out

    def claim(self) -> Claim:
        """The paper's claim (docs/prefix.md): a perturbation at position j leaves every earlier position unchanged;
        holds when they are bit-identical or move by rounding only (< 1e-6 rad)."""
        a = self.prefix_max_angle
        if self.prefix_bitwise_equal:
            verdict, before = "holds", "every earlier position is bit-identical: the claim holds"
        elif not math.isfinite(a):
            verdict, before = "not judged", "earlier positions were not measured: not judged"
        elif a < 1e-6:
            verdict, before = "holds", f"earlier positions move by at most {a:.2g} rad (rounding): the claim holds"
        else:
            verdict, before = "does not hold", f"earlier positions move by up to {fmt(a)} rad: the claim does not hold"
        later = self.summary().get("angle_final_mean_later", math.nan)
        later_txt = f"; later positions move by {fmt(later)} rad on average at the last layer" \
            if math.isfinite(later) else ""
        return Claim(paper_statement("prefix"), verdict, f"perturbing layer {self.perturb_layer} at positions "
                     f"{list(self.positions)}, {before}{later_txt}", value=a)

    def plot(self, title: str | None = None):
        """Left: δθ against distance i - j, one line per layer; right: KL against distance (plotly)."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        fig = make_subplots(rows=1, cols=2, subplot_titles=("angle change δθ (rad)", "KL(p_clean || p_pert)"))
        x = self.distance.tolist()
        n = len(self.layers)
        for k, layer in enumerate(self.layers):
            shade = int(40 + 180 * k / max(n - 1, 1))
            fig.add_trace(go.Scatter(x=x, y=self.angle[k].tolist(), mode="lines", name=f"layer {layer}",
                                     line={"color": f"rgb({shade},{80},{255 - shade})"}), row=1, col=1)
        fig.add_trace(go.Scatter(x=x, y=self.kl.tolist(), mode="lines+markers", name="KL",
                                 line={"color": "black"}), row=1, col=2)
        fig.update_xaxes(title_text="distance i - j")
        fig.update_yaxes(type="log", row=1, col=1)
        fig.update_yaxes(type="log", row=1, col=2)
        what = f"noise ε={self.eps:g} at layer {self.perturb_layer}" if self.mode == "noise" else "token replaced"
        fig.update_layout(template="plotly_white", title=title or f"Prefix sensitivity ({what}; prefix max δθ "
                                                                   f"{self.prefix_max_angle:.1e})")
        return fig


def _perturbed(ad: Any, tokens: Tensor, mode: str, j: int, l0: int, eps: float, gen: torch.Generator,
               replaced: list[list[int]]) -> tuple[Tensor, list]:
    """The perturbed forward's tokens and hooks at position ``j`` (the two modes of docs/prefix.md); token mode
    appends ``[sequence, j, old, new]`` to ``replaced``."""
    n_seq = tokens.shape[0]
    if mode == "noise":
        xi = torch.randn(n_seq, ad.d_model, generator=gen, dtype=torch.float64)
        xi = (xi / xi.norm(dim=-1, keepdim=True)).to(ad.device)

        def perturb(act: Tensor, hook: Any) -> Tensor:
            act = act.clone()
            x = act[:, j].to(torch.float64)
            act[:, j] = (x + eps * x.norm(dim=-1, keepdim=True) * xi).to(act.dtype)
            return act

        return tokens, [(ad.hook_name(l0, "resid_pre"), perturb)]
    toks = tokens.clone()
    vocab = int(ad.cfg.d_vocab)
    for b in range(n_seq):
        new = int(torch.randint(0, vocab - 1, (1,), generator=gen))
        old = int(tokens[b, j])
        new = new + 1 if new >= old else new
        toks[b, j] = new
        replaced.append([b, j, old, new])
    return toks, []


@exclusive
def prefix_sensitivity(model: Any, tokens: Int[Tensor, "batch pos"], layer: int, position: int | Sequence[int],
                       eps: float = 1e-2, mode: Literal["noise", "token"] = "noise", seed: int = 0,
                       corpus: str | None = None) -> PrefixSensitivityResult:
    """Perturb position j and measure the change at positions i >= j (and check i < j is unchanged), docs/prefix.md.

    Arguments: docs/prefix.md, "Arguments of prefix_sensitivity"."""
    ad, tokens, corpus = model_tokens(model, tokens, corpus)
    mode = as_choice(mode, "mode", ("noise", "token"))
    seed = as_int(seed, "seed")
    n_seq, n_pos = tokens.shape
    items = as_int_list([position] if isinstance(position, int) else position, "position", allow_empty=False)
    positions = [as_int(p, "position", minimum=-n_pos, maximum=n_pos - 1) % n_pos for p in items]
    if mode == "noise":
        l0 = ad.check_layer(layer)
        if (eps := as_float(eps, "eps")) <= 0:
            raise InputError(f"eps must be a positive finite float, got {eps!r}")
    else:
        l0 = 0
    layers = list(range(l0, ad.n_layers))
    names = [ad.hook_name(lay, "resid_post") for lay in layers]
    logits_c, cache_c = ad.run_with_cache(tokens, names)
    for lay, nm in zip(layers, names):
        check_finite(cache_c[nm], lay, "resid_post")

    gen = torch.Generator().manual_seed(seed)
    max_d = n_pos - min(positions)
    angle_sum = torch.zeros(len(layers), max_d, dtype=torch.float64)
    kl_sum = torch.zeros(max_d, dtype=torch.float64)
    count = torch.zeros(max_d, dtype=torch.int64)
    pre_angle, pre_rel, pre_kl, bitwise = 0.0, 0.0, 0.0, True
    replaced: list[list[int]] = []
    for j in positions:
        toks, hooks = _perturbed(ad, tokens, mode, j, l0, eps, gen, replaced)
        logits_p, cache_p = ad.run_with_cache(toks, names, fwd_hooks=hooks)
        kl = kl_divergence(logits_c, logits_p)  # [b, pos] KL(p_clean || p_pert)
        d = n_pos - j
        for k, nm in enumerate(names):
            xc, xp = cache_c[nm], cache_p[nm]
            ang = geo.angle(xp, xc)  # [b, pos]
            angle_sum[k, :d] += ang[:, j:].sum(0)
            if j > 0:
                pre_angle = max(pre_angle, float(ang[:, :j].max()))
                rel = (xp[:, :j].to(torch.float64) - xc[:, :j].to(torch.float64)).norm(dim=-1) / \
                    xc[:, :j].to(torch.float64).norm(dim=-1).clamp_min(geo.EPS_NORM)
                pre_rel = max(pre_rel, float(rel.max()))
                bitwise = bitwise and bool(torch.equal(xp[:, :j], xc[:, :j]))
        kl_sum[:d] += kl[:, j:].sum(0)
        count[:d] += n_seq
        if j > 0:
            pre_kl = max(pre_kl, float(kl[:, :j].max()))
            bitwise = bitwise and bool(torch.equal(logits_p[:, :j], logits_c[:, :j]))
    denom = count.clamp_min(1).to(torch.float64)
    angle = angle_sum / denom
    kl_mean = kl_sum / denom
    return PrefixSensitivityResult(
        provenance=ad.provenance(tokens, corpus=corpus, seed=seed, protocol="prefix_sensitivity", mode=mode, layer=l0,
                                 positions=positions, eps=eps if mode == "noise" else None),
        mode=mode, eps=eps if mode == "noise" else 0.0, perturb_layer=l0, positions=positions, layers=layers,
        distance=torch.arange(max_d, dtype=torch.int64), angle=angle, kl=kl_mean, count=count,
        angle_final=angle[-1].clone(), prefix_max_angle=pre_angle, prefix_max_rel_change=pre_rel,
        prefix_max_kl=pre_kl, prefix_bitwise_equal=bitwise, replaced_tokens=replaced)


@register
@dataclasses.dataclass(kw_only=True)
class PrefixStatisticsResult(Result):
    """Prefix-set diversity statistics as a function of the prefix end t, per layer (see :func:`prefix_statistics`);
    every field is defined in docs/prefix.md ("Prefix statistics")."""

    site: str = "resid_post"
    layers: list[int] = dataclasses.field(default_factory=list)
    stats: list[str] = dataclasses.field(default_factory=list)
    positions: Int[Tensor, " pos"] = tensor_field(0, dtype=torch.int64)
    n_valid: Int[Tensor, " pos"] = tensor_field(0, dtype=torch.int64)
    values: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    exclude_positions: list[int] = dataclasses.field(default_factory=lambda: [0])

    kind = "prefix_statistics"

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"site": self.site, "n_layers": len(self.layers)}
        for s in self.stats:
            v = self.values[s]
            if v.numel():
                out[f"{s}_full_prefix_mean_over_layers"] = float(v[:, -1].nanmean())
        return out

    def claim(self) -> Claim:
        """Ours: the prefix statistics describe the prefix sets u_1..u_t (docs/prefix.md); they judge nothing, so the
        verdict is "not judged", with the full-prefix pairwise cosine where it was computed."""
        v = self.values.get("pairwise_cosine")
        full = float(v[:, -1].nanmean()) if v is not None and v.numel() else math.nan
        return Claim("the diversity statistics of every prefix set u_1..u_t describe the causal dynamics", "not judged",
                     f"a description with nothing to judge: the full-prefix pairwise cosine at {self.site} is "
                     f"{fmt(full)} averaged over {len(self.layers)} layers", value=full, by="ours")

    def plot(self, stat: str = "pairwise_cosine", title: str | None = None):
        """One line per layer: the statistic against the prefix end t (plotly Figure)."""
        import plotly.graph_objects as go

        if stat not in self.values:
            raise InputError(f"stat must be one of {list(self.values)}, got {stat!r}")
        fig = go.Figure()
        n = len(self.layers)
        for k, layer in enumerate(self.layers):
            shade = int(40 + 180 * k / max(n - 1, 1))
            fig.add_trace(go.Scatter(x=self.positions.tolist(), y=self.values[stat][k].tolist(), mode="lines",
                                     name=f"layer {layer}", line={"color": f"rgb({shade},80,{255 - shade})"}))
        fig.update_layout(template="plotly_white", xaxis_title="prefix end t", yaxis_title=stat,
                          title=title or f"Prefix {stat} at {self.site} per layer")
        return fig


@exclusive
def prefix_statistics(model: Any, tokens: Int[Tensor, "batch pos"], layers: Sequence[int] | int | None = None,
                      site: str = "resid_post", stats: Sequence[str] = STATS, exclude_positions: Sequence[int] = (0,),
                      corpus: str | None = None) -> PrefixStatisticsResult:
    """Diversity of every prefix set U_{≤t} per layer, averaged over sequences (docs/prefix.md).

    Arguments: docs/prefix.md, "Arguments of prefix_statistics"."""
    ad, tokens, corpus = model_tokens(model, tokens, corpus)
    sel = ad.layers(layers)
    stats = as_choices(stats, "stats", STATS)
    n_seq, n_pos = tokens.shape
    exclude_positions = check_exclude_positions(exclude_positions)
    mask = position_mask(n_pos, exclude_positions)
    names = [ad.hook_name(lay, site) for lay in sel]
    _, cache = ad.run_with_cache(tokens, names)
    fns = {"pairwise_cosine": geo.prefix_mean_pairwise_cosine, "resultant_length": geo.prefix_mean_resultant_length,
           "effective_rank": geo.prefix_effective_rank, "participation_ratio": geo.prefix_participation_ratio}
    values = {s: torch.full((len(sel), n_pos), math.nan, dtype=torch.float64) for s in stats}
    m = mask.to(tokens.device).expand(n_seq, n_pos)
    for k, lay in enumerate(sel):
        x = activation64(ad, cache, lay, site)
        for s in stats:
            vals = fns[s](x, m).cpu()  # masked rows are zeroed: excluded exactly from every statistic
            values[s][k] = vals.nanmean(0) if n_seq > 1 else vals[0]
    return PrefixStatisticsResult(
        provenance=ad.provenance(tokens, corpus=corpus, protocol="prefix_statistics", layers=sel, site=site, stats=stats,
                                 exclude_positions=list(exclude_positions)),
        site=site, layers=sel, stats=stats, positions=torch.arange(n_pos, dtype=torch.int64),
        n_valid=mask.to(torch.int64).cumsum(0), values=values, exclude_positions=list(exclude_positions))


__all__ = ["PrefixSensitivityResult", "PrefixStatisticsResult", "STATS", "prefix_sensitivity", "prefix_statistics"]
