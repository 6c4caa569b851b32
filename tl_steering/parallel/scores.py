"""Every per-layer parallelization score in one call, :func:`parallel_scores`, and the attribution scores from one
forward and backward, first and second order (docs/defect.md "Attribution", "Second order")."""

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .. import geometry as geo
from ..backends import adapt
from ..backends.ownership import exclusive
from ..data.windows import model_tokens
from ..metrics import next_token_loss
from ..results import Result, register, tensor_field
from ..validation import as_int
from .defect import parallel_defect
from .defect_result import LayerScores
from .gold import PlanLoss, single_layer_gold
from .strategies import FISHER_SAMPLES


@register
@dataclasses.dataclass(kw_only=True)
class ParallelScoresResult(Result, LayerScores):
    """Per-layer scores of making each block parallel; every tensor is indexed like :attr:`layers` (each field in
    docs/defect.md "Layer planning")."""

    layers: list[int] = dataclasses.field(default_factory=list)
    already_parallel: list[bool] = dataclasses.field(default_factory=list)
    scores: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    clean_loss: float = math.nan
    evaluated: bool = False
    delta_ce: Float[Tensor, " layer"] = tensor_field(0)
    spearman: dict[str, float] = dataclasses.field(default_factory=dict)
    cost: dict[str, float] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    kind = "parallel_scores"

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n_layers": len(self.layers), "n_candidates": len(self.candidates),
                               "clean_loss": self.clean_loss, **{f"cost_{k}": v for k, v in self.cost.items()}}
        for name in self.scores:
            so = self.score_of(name)
            if so:
                out[f"{name}_argmin_layer"] = min(so, key=lambda lay: (so[lay], lay))
        out.update({f"spearman_{k}": v for k, v in self.spearman.items()})
        return out

    def plot(self, title: str | None = None):
        """Each score per layer, scaled by its largest |value| (and the measured dCE when evaluated)."""
        import plotly.graph_objects as go

        fig = go.Figure()
        for name, val in {**self.scores, **({"measured dCE": self.delta_ce} if self.evaluated else {})}.items():
            m = float(val[torch.isfinite(val)].abs().max()) if torch.isfinite(val).any() else 1.0
            fig.add_trace(go.Scatter(x=self.layers, y=(val / (m or 1.0)).tolist(), mode="lines+markers",
                                     name=name + (f" (rho {self.spearman[name]:.2f})" if name in self.spearman
                                                  else "")))
        fig.update_layout(title=title or f"Parallelization scores per layer ({self.provenance.model})",
                          xaxis_title="layer", yaxis_title="score / max |score|", template="plotly_white")
        return fig


@exclusive
def parallel_scores(model: Any, tokens: Int[Tensor, "batch pos"], layers: Sequence[int] | int | None = None,
                    exclude_positions: Sequence[int] = (0,), gold: bool = False, batch_size: int = 8,
                    corpus: str | None = None, fisher_samples: int = FISHER_SAMPLES,
                    seed: int = 0) -> ParallelScoresResult:
    """Every per-layer score of making a block parallel, a :class:`ParallelScoresResult` (the arguments and the cost
    in docs/defect.md "Layer planning"; the scores in "Attribution", "Second order", "Peer scores")."""
    t0 = time.perf_counter()
    ad, tokens, corpus = model_tokens(model, tokens, corpus)
    defect = parallel_defect(model, tokens, layers=layers, exclude_positions=exclude_positions,
                             batch_size=batch_size, corpus=corpus)
    sel = defect.layers
    attr, clean = attribution_scores(model, tokens, sel, batch_size=batch_size, fisher_samples=fisher_samples,
                                     seed=seed)
    scores = {**{k: v.clone() for k, v in defect.scores.items()}, **attr,
              **{k: v.clone() for k, v in defect.peer_scores.items()}}
    cost = {"forward": 2.0, "backward": 1.0 + fisher_samples}
    delta = torch.full((len(sel),), math.nan, dtype=torch.float64)
    rho: dict[str, float] = {}
    if gold:
        loss = PlanLoss(model, tokens, batch_size)
        delta, rho = single_layer_gold(loss, sel, defect.already_parallel, scores)
        cost["forward"] += loss.passes
    cost["seconds"] = time.perf_counter() - t0
    options = {"layers": sel, "exclude_positions": list(exclude_positions), "gold": bool(gold),
               "batch_size": batch_size, "fisher_samples": fisher_samples, "seed": seed}
    return ParallelScoresResult(
        provenance=ad.provenance(tokens, corpus=defect.provenance.corpus, **options),
        layers=sel, already_parallel=list(defect.already_parallel), scores=scores, clean_loss=clean,
        evaluated=bool(gold), delta_ce=delta, spearman=rho, cost=cost, options=options)


@exclusive
def attribution_scores(model: Any, tokens: Tensor, layers: Sequence[int], batch_size: int = 8,
                       fisher_samples: int = 0, seed: int = 0) -> tuple[dict[str, Tensor], float]:
    """The attribution scores per layer of ``layers`` (float64; NaN for already-parallel blocks; the second-order
    ones with ``fisher_samples > 0``) and the model's mean CE (docs/defect.md "Attribution", "Second order")."""
    fisher_samples = as_int(fisher_samples, "fisher_samples", minimum=0)
    ad = adapt(model)
    layers = list(layers)
    todo = [lay for lay in layers if not ad.is_parallel(lay)]
    signed, absval, square, fisher, fisher_diag = (torch.zeros(len(layers), dtype=torch.float64) for _ in range(5))
    n_pred = tokens.shape[0] * (tokens.shape[1] - 1)
    loss_total = 0.0
    idx = {lay: i for i, lay in enumerate(layers)}
    for start in range(0, tokens.shape[0], batch_size):
        tb = tokens[start:start + batch_size]
        store: dict[str, Tensor] = {}

        def leaf(act: Tensor, hook: Any) -> Tensor:
            return act.detach().requires_grad_(True)  # the graph starts here: no weight gradients at all

        def keep(site: str, lay: int) -> Any:
            def fn(act: Tensor, hook: Any) -> None:  # resid_post stays in the graph: the gradients are w.r.t. it
                store[f"{site}{lay}"] = act if site == "resid_post" else act.detach()
            return fn

        hooks = [(ad.hook_name(0, "resid_pre"), leaf)] + [(ad.hook_name(lay, site), keep(site, lay)) for lay in todo
                                   for site in ("resid_pre", "mlp_out", "resid_post")]
        logits = ad.run_with_hooks(tb, hooks, return_type="logits", grad=True)
        loss_sum = next_token_loss(logits, tb).sum()
        loss_total += float(loss_sum.detach())
        outs = [store[f"resid_post{lay}"] for lay in todo]
        grads = torch.autograd.grad(loss_sum / n_pred, outs, retain_graph=fisher_samples > 0) if todo else []
        with torch.no_grad():
            defects = {lay: geo.to64(store[f"mlp_out{lay}"]) - geo.to64(ad.ffn(lay)(store[f"resid_pre{lay}"]))
                       for lay in todo}
            for lay, g in zip(todo, grads):
                per_tok = -(geo.to64(g) * defects[lay]).sum(-1)  # [batch, pos]
                i = idx[lay]
                signed[i] += float(per_tok.sum())
                absval[i] += float(per_tok.abs().sum())
                square[i] += float((per_tok * per_tok).sum())
        if todo and fisher_samples:
            _fisher_terms(logits, outs, defects, todo, idx, fisher_samples, int(seed), start, fisher, fisher_diag)
        del logits, loss_sum, outs, grads
        store.clear()
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    mask = torch.tensor([lay in todo for lay in layers], dtype=torch.bool)
    out = {"attribution": signed, "attribution_abs": absval, "attribution_rms": torch.sqrt(square * n_pred)}
    if fisher_samples:
        fisher /= 2.0 * n_pred * fisher_samples
        fisher_diag /= 2.0 * n_pred * fisher_samples
        out.update({"attribution_fisher": fisher, "attribution_2nd": signed + fisher,
                    "attribution_fisher_diag": fisher_diag})
    return {k: torch.where(mask, v, nan) for k, v in out.items()}, loss_total / n_pred


def _fisher_terms(logits: Tensor, outs: list[Tensor], defects: dict[int, Tensor], todo: list[int],
                  idx: dict[int, int], samples: int, seed: int, first_row: int, fisher: Tensor,
                  fisher_diag: Tensor) -> None:
    """Add the sampled-label Gauss-Newton sums of one batch to ``fisher`` / ``fisher_diag``, not yet divided by
    ``2 N S`` (docs/defect.md "Second order": the labels of a sequence do not depend on the batching)."""
    with torch.no_grad():
        probs = torch.softmax(logits[:, :-1].detach(), dim=-1)  # the model's dtype (memory: batch x pos x vocab)
        flat = probs.cpu()
        labels = torch.stack([torch.multinomial(flat[b], samples, replacement=True,
                                                generator=torch.Generator().manual_seed(seed * 1_000_003 + first_row + b))
                              for b in range(flat.shape[0])]).to(probs.device)  # [batch, pos, sample]
    for s in range(samples):
        with torch.no_grad():
            v = -probs.clone()
            v.scatter_add_(-1, labels[..., s:s + 1], torch.ones_like(labels[..., s:s + 1], dtype=v.dtype))
            v = torch.cat([v, torch.zeros_like(v[:, :1])], dim=1)  # the last position predicts nothing
        hs = torch.autograd.grad(logits, outs, grad_outputs=v, retain_graph=s < samples - 1)
        with torch.no_grad():
            for lay, h in zip(todo, hs):
                per_tok = (geo.to64(h) * defects[lay]).sum(-1)  # [batch, pos]
                fisher[idx[lay]] += float((per_tok.sum(-1) ** 2).sum())
                fisher_diag[idx[lay]] += float((per_tok * per_tok).sum())


__all__ = ["ParallelScoresResult", "attribution_scores", "parallel_scores"]
