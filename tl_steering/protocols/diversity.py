"""Spherical diversity of token directions before and after attention and the FFN (protocol 3 of the paper;
specification: docs/diversity.md)."""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from .. import geometry as geo
from ..backends import ModelAdapter
from ..data.windows import model_tokens
from ..errors import ArgumentTypeError
from ..hooks import attention_gain, ffn_component
from ..metrics import entropy, next_token_loss
from ..probing.kernels import in_parts, parts_for
from ..results import Result, register, tensor_field
from ..data.sharding import World, gather_rows, my_batches
from .._util.threads import single_threaded
from ..data.batching import iter_batches
from .._util.claims import Claim, pct
from ..reference import band_check, paper_statement
from ..stats import check_exclude_positions, finite_mean, position_mask
from ..validation import as_choices, as_float, as_int
from .ablation import VARIANTS
from .deficit import activation64
from ..backends.ownership import exclusive

STATS: tuple[str, ...] = ("pairwise_cosine", "resultant_length", "effective_rank", "participation_ratio",
                          "rank_collapse")
SITES: tuple[str, ...] = ("resid_pre", "resid_mid", "resid_post")



def _stats(x: Tensor, base: Tensor) -> tuple[dict[str, Tensor], Tensor]:
    """Per-sequence statistics of the valid directions of ``x`` [b, pos, d]; also the number masked per sequence."""
    valid = base & ~geo.degenerate_mask(x, base)
    # the sequences' SVDs in parts, one a torch thread (each on one thread: see single_threaded): every
    # sequence's numbers come from its own decomposition, so the same numbers either way
    n_parts = parts_for(x.device)
    with single_threaded():
        parts = in_parts(lambda a, b: geo.diversity_stats(x[a:b], mask=valid[a:b]), x.shape[0], n_parts)
    return {k: torch.cat([p[k] for p in parts]).cpu() for k in STATS}, (base & ~valid).sum(-1).cpu()


def _collect(ad: ModelAdapter, tokens: Tensor, layer_list: list[int], pmask: Tensor, batch_size: int,
             hooks: list, world: World | None = None) -> dict[Any, Tensor]:
    """One forward configuration (clean or one ablation), per window, every window gathered: each statistic per
    layer and site (``("site", stat)``, ``[window, layer, 4]``, the last slot the state used as "mid" for the
    effects), after the last layer (``("final", stat)``), the ``"entropy"``, the ``"loss"`` and the degenerate tokens
    ``"masked"``."""
    n_seq, last, mid_slot = tokens.shape[0], ad.n_layers - 1, len(SITES)
    run: dict[Any, Tensor] = {("site", k): torch.full((n_seq, len(layer_list), len(SITES) + 1), math.nan,
                                                      dtype=torch.float64) for k in STATS}
    run.update({("final", k): torch.full((n_seq,), math.nan, dtype=torch.float64) for k in STATS})
    run.update({"entropy": torch.zeros(n_seq, dtype=torch.float64), "loss": torch.zeros(n_seq, dtype=torch.float64),
                "masked": torch.zeros(n_seq, dtype=torch.int64)})
    names = [ad.hook_name(lay, site) for lay in layer_list
             for site in ("resid_pre", "resid_post", "attn_out" if ad.is_parallel(lay) else "resid_mid")]
    names.append(ad.hook_name(last, "resid_post"))
    mine = my_batches(n_seq, batch_size, world)
    for rows, logits, cache in iter_batches(ad, tokens, list(dict.fromkeys(names)), batch_size, fwd_hooks=hooks,
                                            rows=mine):
        run["entropy"][rows] = entropy(logits[:, :-1]).mean(-1).cpu()  # over the predicted positions
        run["loss"][rows] = next_token_loss(logits, tokens[rows]).mean(-1).cpu()
        del logits
        base = pmask.expand(rows.stop - rows.start, -1)
        for j, lay in enumerate(layer_list):
            pre = activation64(ad, cache, lay, "resid_pre")
            post = activation64(ad, cache, lay, "resid_post")
            if ad.is_parallel(lay):
                states = {0: pre, 2: post, mid_slot: pre + activation64(ad, cache, lay, "attn_out")}
            else:
                states = {0: pre, 1: activation64(ad, cache, lay, "resid_mid"), 2: post}
            for slot, x in states.items():
                st, n_bad = _stats(x, base)
                if slot < mid_slot:
                    run["masked"][rows] += n_bad
                for k in STATS:
                    run[("site", k)][rows, j, slot] = st[k]
            if not ad.is_parallel(lay):  # the "mid" of the effects is resid_mid itself
                for k in STATS:
                    run[("site", k)][rows, j, mid_slot] = run[("site", k)][rows, j, 1]
        st, _ = _stats(activation64(ad, cache, last, "resid_post"), base)
        for k in STATS:
            run[("final", k)][rows] = st[k]
    return gather_rows(run, mine, world)  # the other ranks' windows, in window order


def _table(run: dict[Any, Tensor], stat: str) -> Tensor:
    return torch.nanmean(run[("site", stat)][..., : len(SITES)], dim=0)


@register
@dataclasses.dataclass(kw_only=True)
class DiversityResult(Result):
    """Direction diversity per layer and site, its attention/FFN effects, ablations and a gain sweep (see
    :func:`diversity`); every field is defined in docs/diversity.md ("Definitions")."""

    layers: list[int] = dataclasses.field(default_factory=list)
    parallel: list[bool] = dataclasses.field(default_factory=list)
    sites: list[str] = dataclasses.field(default_factory=lambda: list(SITES))
    pairwise_cosine: Float[Tensor, "layer site"] = tensor_field(0, 3)
    resultant_length: Float[Tensor, "layer site"] = tensor_field(0, 3)
    effective_rank: Float[Tensor, "layer site"] = tensor_field(0, 3)
    participation_ratio: Float[Tensor, "layer site"] = tensor_field(0, 3)
    rank_collapse: Float[Tensor, "layer site"] = tensor_field(0, 3)
    attention_effect: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    ffn_effect: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    under_ablation: dict[str, Float[Tensor, "layer site"]] = dataclasses.field(default_factory=dict)
    under_ablation_stats: dict[str, dict[str, Float[Tensor, "layer site"]]] = dataclasses.field(default_factory=dict)
    ablation_effects: dict[str, dict[str, dict[str, Float[Tensor, " layer"]]]] = dataclasses.field(
        default_factory=dict)
    final_diversity: dict[str, float] = dataclasses.field(default_factory=dict)
    final_diversity_under_ablation: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    entropy: dict[str, float] = dataclasses.field(default_factory=dict)
    loss: dict[str, float] = dataclasses.field(default_factory=dict)
    gain_sweep: dict[str, Float[Tensor, " gain"]] = dataclasses.field(default_factory=dict)
    exclude_positions: list[int] = dataclasses.field(default_factory=list)
    n_masked: int = 0

    kind = "diversity"

    def summary(self) -> dict[str, Any]:
        att = self.attention_effect.get("pairwise_cosine", torch.zeros(0))
        ffn = self.ffn_effect.get("pairwise_cosine", torch.zeros(0))
        out: dict[str, Any] = {  # the fractions: NaN without layers
            "pairwise_cosine_post_mean": finite_mean(self.pairwise_cosine[:, 2]) if len(self.layers) else math.nan,
            "frac_layers_attention_concentrates": finite_mean((att > 0).to(torch.float64)),
            "frac_layers_ffn_diversifies": finite_mean((ffn < 0).to(torch.float64)),
            "final_pairwise_cosine": self.final_diversity.get("pairwise_cosine", math.nan),
            "entropy_clean": self.entropy.get("clean", math.nan),
            "n_masked": self.n_masked}
        for name, d in self.final_diversity_under_ablation.items():
            out[f"final_pairwise_cosine_{name}"] = d.get("pairwise_cosine", math.nan)
            out[f"entropy_{name}"] = self.entropy.get(name, math.nan)
        return out

    def tangential_preserves(self) -> bool | None:
        """Whether the tangential-only FFN keeps the final pairwise cosine closer to the clean run's than the
        radial-only FFN does (None without both ablations)."""
        clean = self.final_diversity.get("pairwise_cosine", math.nan)
        tan, rad = (self.final_diversity_under_ablation.get(k, {}).get("pairwise_cosine", math.nan)
                    for k in ("tangential", "radial"))
        return abs(tan - clean) < abs(rad - clean) if math.isfinite(tan + rad + clean) else None

    def claim(self) -> Claim:
        """The paper's claim in three parts (docs/diversity.md): attention concentrates the directions in most layers,
        the FFN diversifies them in at least a quarter (the tolerance bands of published.json), and the
        tangential-only final diversity is the closer to the clean one; the verdict counts the parts that hold."""
        s = self.summary()
        att, ffn = s["frac_layers_attention_concentrates"], s["frac_layers_ffn_diversifies"]
        tan = self.tangential_preserves()
        checks = [band_check(att, "diversity_attention_contracts"), band_check(ffn, "diversity_ffn_restores"),
                  band_check(tan, "diversity_tangential_preserves")]
        held, judged = sum(1 for c in checks if c.ok), sum(1 for c in checks if c.ok is not None)
        verdict = ("not judged" if not judged else "holds" if held == judged else "does not hold" if not held
                   else "partly holds")
        said = f"the claim {verdict}" if verdict in ("holds", "does not hold") else f"{held} of {judged} parts hold"
        tan_txt = {True: "closer to the clean model's than the radial-only model's", None: "not compared",
                   False: "not closer to the clean model's than the radial-only model's"}[tan]
        return Claim(paper_statement("diversity"), verdict,
                     f"attention concentrates the directions in {pct(att)} of the layers "
                     f"({'most' if checks[0].ok else 'not most'}), the FFN diversifies them in {pct(ffn)} "
                     f"({'at least a quarter' if checks[1].ok else 'fewer than a quarter'}), and the tangential-only "
                     f"model's final diversity is {tan_txt}: {said}", value=att)

    def plot(self, title: str | None = None):
        """Pairwise cosine per layer (clean sites and resid_post under each ablation), and the gain sweep."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        sweep = bool(self.gain_sweep) and self.gain_sweep["gain"].numel() > 0
        fig = make_subplots(rows=1, cols=2 if sweep else 1,
                            subplot_titles=("Mean pairwise cosine", "Attention-gain sweep") if sweep else None)
        for s, site in enumerate(self.sites):
            fig.add_trace(go.Scatter(x=self.layers, y=self.pairwise_cosine[:, s].tolist(), mode="lines+markers",
                                     name=f"clean {site}"), row=1, col=1)
        for name, table in self.under_ablation.items():
            fig.add_trace(go.Scatter(x=self.layers, y=table[:, 2].tolist(), mode="lines", line={"dash": "dash"},
                                     name=f"{name}-only resid_post"), row=1, col=1)
        fig.update_xaxes(title_text="layer", row=1, col=1)
        if sweep:
            g = self.gain_sweep["gain"].tolist()
            fig.add_trace(go.Scatter(x=g, y=self.gain_sweep["final_pairwise_cosine"].tolist(),
                                     mode="lines+markers", name="final pairwise cosine"), row=1, col=2)
            fig.add_trace(go.Scatter(x=g, y=self.gain_sweep["entropy"].tolist(), mode="lines+markers",
                                     name="next-token entropy (nats)"), row=1, col=2)
            fig.update_xaxes(title_text="attention gain", row=1, col=2)
        fig.update_layout(title=title or f"Direction diversity ({self.provenance.model})", template="plotly_white")
        return fig


@exclusive
def diversity(model: Any, tokens: Tensor, layers: Sequence[int] | int | None = None,
              exclude_positions: Sequence[int] = (0,), ablations: Sequence[str] = ("tangential", "radial"),
              gains: Sequence[float] = (0.5, 1.0, 1.5, 2.0), seed: int = 0, corpus: str | None = None,
              batch_size: int = 8, world: World | None = None) -> DiversityResult:
    """Direction diversity at resid_pre / resid_mid / resid_post per layer, clean, under all-layer FFN-component
    ablations, and under an attention-gain sweep (docs/diversity.md).

    Arguments: docs/diversity.md, "Arguments of diversity"."""
    ad, tokens, corpus = model_tokens(model, tokens, corpus)
    layer_list = ad.layers(layers)
    excl = check_exclude_positions(exclude_positions)
    seed = as_int(seed, "seed")
    batch_size = as_int(batch_size, "batch_size", minimum=1)
    ablations = [] if isinstance(ablations, (list, tuple)) and not ablations else list(
        dict.fromkeys(as_choices(ablations, "ablations", VARIANTS)))
    if isinstance(gains, (str, bytes)) or not hasattr(gains, "__iter__"):
        raise ArgumentTypeError(f"gains must be a sequence of numbers, got {gains!r}")
    gain_list = [as_float(g, f"gains[{i}] (an attention gain)") for i, g in enumerate(gains)]

    pmask = position_mask(tokens.shape[1], excl, device=tokens.device)
    clean = _collect(ad, tokens, layer_list, pmask, batch_size, [], world)
    runs = {name: _collect(ad, tokens, layer_list, pmask, batch_size, ffn_component(model, keep=name, seed=seed),
                           world) for name in ablations}
    # a * 1.0 == a: gain 1 is the clean forward
    swept = [clean if g == 1.0 else _collect(ad, tokens, [], pmask, batch_size, attention_gain(model, g), world)
             for g in gain_list]
    sweep = {"final_pairwise_cosine": [finite_mean(r[("final", "pairwise_cosine")]) for r in swept],
             "final_effective_rank": [finite_mean(r[("final", "effective_rank")]) for r in swept],
             "entropy": [float(r["entropy"].mean()) for r in swept], "loss": [float(r["loss"].mean()) for r in swept]}

    def finals(run: dict[Any, Tensor]) -> dict[str, float]:
        return {k: float(torch.nanmean(run[("final", k)])) for k in STATS}

    def effects(run: dict[Any, Tensor]) -> dict[str, dict[str, Tensor]]:
        out: dict[str, dict[str, Tensor]] = {"attention": {}, "ffn": {}}
        for k in STATS:
            s = run[("site", k)]
            pre, mid, post = s[..., 0], s[..., len(SITES)], s[..., 2]
            out["attention"][k], out["ffn"][k] = torch.nanmean(mid - pre, dim=0), torch.nanmean(post - mid, dim=0)
        return out

    return DiversityResult(
        provenance=ad.provenance(tokens, corpus=corpus, seed=seed, protocol="diversity", layers=layer_list,
                                 exclude_positions=list(excl), ablations=ablations, gains=gain_list,
                                 batch_size=batch_size),
        layers=layer_list, parallel=[ad.is_parallel(lay) for lay in layer_list], sites=list(SITES),
        **{k: _table(clean, k) for k in STATS},
        **{f"{part}_effect": v for part, v in effects(clean).items()},  # attention_effect, ffn_effect
        under_ablation={a: _table(r, "pairwise_cosine") for a, r in runs.items()},
        under_ablation_stats={a: {k: _table(r, k) for k in STATS} for a, r in runs.items()},
        ablation_effects={a: effects(r) for a, r in runs.items()},
        final_diversity=finals(clean),
        final_diversity_under_ablation={a: finals(r) for a, r in runs.items()},
        entropy={a: float(r["entropy"].mean()) for a, r in {"clean": clean, **runs}.items()},
        loss={a: float(r["loss"].mean()) for a, r in {"clean": clean, **runs}.items()},
        gain_sweep={"gain": torch.tensor(gain_list, dtype=torch.float64),
                    **{k: torch.tensor(v, dtype=torch.float64) for k, v in sweep.items()}},
        exclude_positions=list(excl), n_masked=int(clean["masked"].sum()))


__all__ = ["DiversityResult", "SITES", "STATS", "diversity"]
