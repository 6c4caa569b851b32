"""Radial / tangential FFN ablation (protocol 2 of the paper; specification: docs/ablation.md)."""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from ..data.windows import model_tokens
from .. import validation
from ..hooks import ffn_component
from ..metrics import kl_divergence, next_token_loss, top1_agreement
from ..results import Result, register
from ..data.sharding import World, gather_rows, my_batches
from .._util.claims import Claim, fmt, sgn
from ..reference import band_check, paper_statement, published_number
from ..stats import bootstrap_ci
from ..validation import as_int
from ..backends.ownership import exclusive

VARIANTS: tuple[str, ...] = ("tangential", "radial", "zero", "random_tangent")


@register
@dataclasses.dataclass(kw_only=True)
class AblationResult(Result):
    """FFN-component ablation metrics (see :func:`ffn_ablation`); every field is defined in docs/ablation.md
    ("Metrics")."""

    variants: list[str] = dataclasses.field(default_factory=list)
    layers: list[int] = dataclasses.field(default_factory=list)
    scope: str = "all"
    ablate_position_0: bool = True
    clean_loss: float = math.nan
    delta_loss: dict[str, float] = dataclasses.field(default_factory=dict)
    delta_loss_ci: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    ratio_to_zero: dict[str, float] = dataclasses.field(default_factory=dict)
    kl: dict[str, float] = dataclasses.field(default_factory=dict)
    top1_agreement: dict[str, float] = dataclasses.field(default_factory=dict)
    per_layer_delta_loss: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    per_layer_kl: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    per_layer_top1: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    per_sequence_delta_loss: dict[str, Float[Tensor, " seq"]] = dataclasses.field(default_factory=dict)
    n_predicted: int = 0

    kind = "ffn_ablation"

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"clean_loss": self.clean_loss, "scope": self.scope,
                               "ablate_position_0": self.ablate_position_0}
        for v in self.variants:
            out.update({f"{name}_{v}": getattr(self, name)[v] for name in ("delta_loss", "ratio_to_zero", "kl",
                                                                             "top1_agreement")})
        return out

    def claim(self) -> Claim:
        """The paper's claim (docs/ablation.md): tangential-only preserves most of the quality, radial-only collapses
        it. Each dCE against the paper's range; the verdict: holds when tangential-only is cheaper than radial-only
        and inside the paper's tangential range (or below it), partly when only the ordering holds."""
        tan, rad, zero = (self.delta_loss.get(k, math.nan) for k in ("tangential", "radial", "zero"))
        tr = published_number("ablation_tangential")["range"]
        if not (math.isfinite(tan) and math.isfinite(rad)):
            verdict, why = "not judged", "not judged (a variant was not run)"
        elif tan >= rad:
            verdict, why = "does not hold", "the claim does not hold: tangential-only is not cheaper than radial-only"
        elif tan <= tr[1]:
            less = fmt(rad / tan if tan > 0 else math.inf)
            verdict, why = "holds", f"the claim holds: tangential-only costs {less}x less"
        else:
            verdict, why = "partly holds", ("the ordering holds (tangential-only is cheaper) but the tangential part "
                                            "does not preserve the model's quality as the paper says")
        zero_txt = f", zero FFN {sgn(zero)}" if math.isfinite(zero) else ""
        ci = self.delta_loss_ci.get("tangential")
        return Claim(paper_statement("ablation"), verdict,
                     f"tangential-only costs {sgn(tan)} nats ({band_check(tan, 'ablation_tangential').why}) and "
                     f"radial-only {sgn(rad)} ({band_check(rad, 'ablation_radial').why}){zero_txt}: {why}",
                     value=tan, interval=None if ci is None else (ci[0], ci[1]))

    def plot(self, title: str | None = None):
        """Bars of ΔCE per variant (with CI); with a per-layer scan, a second panel of ΔCE per layer."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        scan = bool(self.per_layer_delta_loss)
        fig = make_subplots(rows=1, cols=2 if scan else 1,
                            subplot_titles=("all layers ablated", "one layer at a time") if scan else None)
        ys = [self.delta_loss[v] for v in self.variants]
        ci = [self.delta_loss_ci.get(v, [math.nan, math.nan]) for v in self.variants]
        fig.add_trace(go.Bar(
            x=self.variants, y=ys, name="ΔCE",
            error_y={"type": "data", "symmetric": False, "array": [c[1] - y for c, y in zip(ci, ys)],
                     "arrayminus": [y - c[0] for c, y in zip(ci, ys)]},
            text=[f"{y:.3g}" for y in ys], hovertext=[f"KL {self.kl[v]:.3g}, top-1 {self.top1_agreement[v]:.3f}"
                                                   for v in self.variants]), row=1, col=1)
        if scan:
            for v, y in self.per_layer_delta_loss.items():
                fig.add_trace(go.Scatter(x=self.layers, y=y.tolist(), mode="lines+markers", name=f"{v} (layer)"),
                              row=1, col=2)
            fig.update_xaxes(title_text="layer", row=1, col=2)
        fig.update_yaxes(title_text="ΔCE (nats)", row=1, col=1)
        fig.update_layout(title=title or f"FFN component ablation (clean CE {self.clean_loss:.3f}, "
                          f"position 0 {'ablated' if self.ablate_position_0 else 'kept'})", template="plotly_white")
        return fig


def _collect(model: Any, ad: Any, tokens: Tensor, jobs: list[tuple[str, int | None]], layer_list: list[int],
             skip: tuple[int, ...], seed: int, batch_size: int, world: World | None) -> dict[tuple, Tensor]:
    """Per-window means over the predicted positions (float64, :mod:`tl_steering.metrics`), every window gathered:
    the clean loss at ``("clean",)`` and each job's (variant, layer or None for all) ``(job, "loss" | "kl" |
    "agree")`` against the clean forward."""
    n_seq = tokens.shape[0]
    keys = [("clean",)] + [(job, m) for job in jobs for m in ("loss", "kl", "agree")]
    out = {k: torch.zeros(n_seq, dtype=torch.float64) for k in keys}
    mine = my_batches(n_seq, batch_size, world)  # this rank's batches (all of them without a process group)
    for rows in mine:
        tb = tokens[rows]
        clean_logits = ad.run_with_hooks(tb, [], return_type="logits")
        out[("clean",)][rows] = next_token_loss(clean_logits, tb).mean(-1).cpu()
        for job in jobs:
            variant, lay = job
            # the random-tangent generator is seeded per batch: the same batch always gets the same noise
            hooks = ffn_component(model, keep=variant, layers=layer_list if lay is None else [lay],
                                  skip_positions=skip, seed=seed + rows.start)
            logits = ad.run_with_hooks(tb, hooks, return_type="logits")
            out[(job, "loss")][rows] = next_token_loss(logits, tb).mean(-1).cpu()
            out[(job, "kl")][rows] = kl_divergence(clean_logits[:, :-1], logits[:, :-1]).mean(-1).cpu()
            out[(job, "agree")][rows] = top1_agreement(logits[:, :-1], clean_logits[:, :-1]).mean(-1).cpu()
            del logits
    return gather_rows(out, mine, world)  # the other ranks' windows, in window order


@exclusive
def ffn_ablation(model: Any, tokens: Tensor, keep: Sequence[str] | str = ("tangential", "radial", "zero"),
                 scope: Literal["all", "per_layer"] = "all", layers: Sequence[int] | int | None = None,
                 include_random_tangent: bool = True, ablate_position_0: bool = True, seed: int = 0,
                 corpus: str | None = None, batch_size: int = 8, n_bootstrap: int = 1000, world: World | None = None
) -> AblationResult:
    """Loss, KL and top-1 agreement when each FFN write keeps only its tangential or radial part (docs/ablation.md).

    Arguments: docs/ablation.md, "Arguments of ffn_ablation"."""
    ad, tokens, corpus = model_tokens(model, tokens, corpus)
    layer_list = ad.layers(layers)
    seed = as_int(seed, "seed")
    batch_size = as_int(batch_size, "batch_size", minimum=1)
    n_bootstrap = as_int(n_bootstrap, "n_bootstrap", minimum=0)
    scope = validation.as_choice(scope, "scope", ("all", "per_layer"))
    variants = list(dict.fromkeys(validation.as_choices(keep, "keep", VARIANTS) + ["zero"]
                                  + (["random_tangent"] if include_random_tangent else [])))
    validation.check_weights_finite(model, layer_list, "ffn_ablation")  # NaN weights: name layer and site
    skip = () if ablate_position_0 else (0,)

    jobs: list[tuple[str, int | None]] = [(v, None) for v in variants]
    if scope == "per_layer" and len(layer_list) > 1:  # with one layer the joint ablation is the scan
        jobs += [(v, lay) for v in variants for lay in layer_list]
    got = _collect(model, ad, tokens, jobs, layer_list, skip, seed, batch_size, world)
    clean = got[("clean",)]

    def mean(v: str, lay: int | None, key: str) -> float:
        x = got[((v, lay if len(layer_list) > 1 else None), key)]
        return float(((x - clean) if key == "loss" else x).mean())

    delta = {v: got[((v, None), "loss")] - clean for v in variants}
    d_mean = {v: float(delta[v].mean()) for v in variants}
    zero = d_mean["zero"]
    per_layer = {name: {v: torch.tensor([mean(v, lay, key) for lay in layer_list], dtype=torch.float64)
                        for v in variants} if scope == "per_layer" else {}
                 for name, key in (("per_layer_delta_loss", "loss"), ("per_layer_kl", "kl"),
                                   ("per_layer_top1", "agree"))}
    return AblationResult(
        provenance=ad.provenance(tokens, corpus=corpus, seed=seed, protocol="ffn_ablation", keep=variants, scope=scope,
                                 layers=layer_list, ablate_position_0=ablate_position_0, batch_size=batch_size,
                                 n_bootstrap=n_bootstrap),
        variants=variants, layers=layer_list, scope=scope, ablate_position_0=bool(ablate_position_0),
        clean_loss=float(clean.mean()), delta_loss=d_mean,
        delta_loss_ci={v: [float(c) for c in bootstrap_ci(delta[v], n_bootstrap=n_bootstrap, seed=seed)]
                       for v in variants},
        ratio_to_zero={v: d_mean[v] / zero if zero != 0 else math.nan for v in variants},
        kl={v: mean(v, None, "kl") for v in variants}, top1_agreement={v: mean(v, None, "agree") for v in variants},
        per_sequence_delta_loss=delta, n_predicted=tokens.shape[1] - 1, **per_layer)


__all__ = ["AblationResult", "VARIANTS", "ffn_ablation"]
