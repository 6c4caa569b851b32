"""Attribution score of making a layer parallel: the first-order loss change, for every layer at once.

Making sequential block l parallel changes its output by ``-(Phi(x + a) - Phi(x)) = -d_l`` (x = resid_pre,
a = attn_out, Phi = ``ad.ffn(l)``); to first order the mean next-token CE changes by

    attribution_l = < dCE / d resid_post_l , -d_l >   (summed over batch and positions; CE a mean),

the attribution-patching estimate [ours] (see docs/defect.md "Attribution"). One forward with autograd on
and one ``torch.autograd.grad`` w.r.t. the residual stream (captured by hooks) give it for all layers; model
weights get no ``.grad`` (the graph starts at a detached copy of the first block's input, and
``autograd.grad`` accumulates nothing). Variants:

* ``attribution_abs``: ``sum_t |<g_t, d_t>|`` over token positions t: no cancellation between tokens.
* ``attribution_rms``: ``sqrt(N * sum_t <g_t, d_t>^2)``, N the number of predicted tokens.

``base`` layers are made parallel first (:func:`tl_steering.hooks.parallel_blocks`, in the same forward),
so the score can be re-computed on a partly parallel model (the greedy planner).
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import geometry as geo
from ..backends import adapt
from ..hooks import parallel_blocks
from ..metrics import next_token_loss

ATTRIBUTION_VARIANTS: tuple[str, ...] = ("attribution", "attribution_abs", "attribution_rms")
"""Keys of :func:`attribution_scores`."""


def attribution_scores(model: Any, tokens: Tensor, layers: Sequence[int], base: Sequence[int] = (),
                       batch_size: int = 8) -> tuple[dict[str, Tensor], float]:
    """Attribution variants per layer of ``layers`` (NaN for already-parallel blocks and ``base`` layers)
    and the mean CE of the (partly parallel) model; float64. Cost: one forward + one backward per batch."""
    ad = adapt(model)
    layers = list(layers)
    base = sorted({int(b) for b in base})
    todo = [lay for lay in layers if not ad.is_parallel(lay) and lay not in base]
    n = len(layers)
    signed = torch.zeros(n, dtype=torch.float64)
    absval = torch.zeros(n, dtype=torch.float64)
    square = torch.zeros(n, dtype=torch.float64)
    n_pred = tokens.shape[0] * (tokens.shape[1] - 1)
    loss_total = 0.0
    idx = {lay: i for i, lay in enumerate(layers)}
    first = ad.hook_name(0, "resid_pre")
    for start in range(0, tokens.shape[0], batch_size):
        tb = tokens[start:start + batch_size]
        store: dict[str, Tensor] = {}

        def leaf(act: Tensor, hook: Any) -> Tensor:
            return act.detach().requires_grad_(True)  # the graph starts here: no weight gradients at all

        def keep(name: str, detach: bool) -> Any:
            def fn(act: Tensor, hook: Any) -> None:
                store[name] = act.detach() if detach else act
            return fn

        hooks = [(first, leaf)] + parallel_blocks(model, base)
        for lay in todo:
            hooks += [(ad.hook_name(lay, "resid_pre"), keep(f"x{lay}", True)),
                      (ad.hook_name(lay, "mlp_out"), keep(f"m{lay}", True)),
                      (ad.hook_name(lay, "resid_post"), keep(f"p{lay}", False))]
        logits = ad.run_with_hooks(tb, hooks, return_type="logits", grad=True)
        loss_sum = next_token_loss(logits, tb).sum()
        loss_total += float(loss_sum.detach())
        if todo:
            grads = torch.autograd.grad(loss_sum / n_pred, [store[f"p{lay}"] for lay in todo])
        else:
            grads = []
        del logits, loss_sum
        with torch.no_grad():
            for lay, g in zip(todo, grads):
                d = geo.to64(store[f"m{lay}"]) - geo.to64(ad.ffn(lay)(store[f"x{lay}"]))
                per_tok = -(geo.to64(g) * d).sum(-1)  # [batch, pos]
                i = idx[lay]
                signed[i] += float(per_tok.sum())
                absval[i] += float(per_tok.abs().sum())
                square[i] += float((per_tok * per_tok).sum())
        store.clear()
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    mask = torch.tensor([lay in todo for lay in layers], dtype=torch.bool)
    out = {"attribution": signed, "attribution_abs": absval, "attribution_rms": torch.sqrt(square * n_pred)}
    return {k: torch.where(mask, v, nan) for k, v in out.items()}, loss_total / n_pred


__all__ = ["ATTRIBUTION_VARIANTS", "attribution_scores"]
