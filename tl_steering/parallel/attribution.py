"""The attribution scores of making each layer parallel, first and second order, from one forward and backward
(docs/defect.md, "Attribution" and "Second order")."""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import geometry as geo
from ..backends import adapt
from ..backends.ownership import exclusive
from ..errors import InputError
from ..metrics import next_token_loss


@exclusive
def attribution_scores(model: Any, tokens: Tensor, layers: Sequence[int], batch_size: int = 8,
                       fisher_samples: int = 0, seed: int = 0) -> tuple[dict[str, Tensor], float]:
    """The attribution variants per layer of ``layers`` (float64; NaN for already-parallel blocks): ``attribution``,
    ``attribution_abs``, ``attribution_rms``, and with ``fisher_samples > 0`` ``attribution_fisher``,
    ``attribution_2nd``, ``attribution_fisher_diag``; and the model's mean CE. Cost: one forward + ``1 +
    fisher_samples`` backward passes per batch; the sampled labels are deterministic for a seed, whatever
    ``batch_size``."""
    if isinstance(fisher_samples, bool) or not isinstance(fisher_samples, int) or fisher_samples < 0:
        raise InputError(f"fisher_samples must be an int >= 0, got {fisher_samples!r}")
    ad = adapt(model)
    layers = list(layers)
    todo = [lay for lay in layers if not ad.is_parallel(lay)]
    n = len(layers)
    signed = torch.zeros(n, dtype=torch.float64)
    absval = torch.zeros(n, dtype=torch.float64)
    square = torch.zeros(n, dtype=torch.float64)
    fisher = torch.zeros(n, dtype=torch.float64)
    fisher_diag = torch.zeros(n, dtype=torch.float64)
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

        hooks = [(first, leaf)]
        for lay in todo:
            hooks += [(ad.hook_name(lay, "resid_pre"), keep(f"x{lay}", True)),
                      (ad.hook_name(lay, "mlp_out"), keep(f"m{lay}", True)),
                      (ad.hook_name(lay, "resid_post"), keep(f"p{lay}", False))]
        logits = ad.run_with_hooks(tb, hooks, return_type="logits", grad=True)
        loss_sum = next_token_loss(logits, tb).sum()
        loss_total += float(loss_sum.detach())
        outs = [store[f"p{lay}"] for lay in todo]
        grads = torch.autograd.grad(loss_sum / n_pred, outs, retain_graph=fisher_samples > 0) if todo else []
        with torch.no_grad():
            defects = {lay: geo.to64(store[f"m{lay}"]) - geo.to64(ad.ffn(lay)(store[f"x{lay}"])) for lay in todo}
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
    """Add the sampled-label Gauss-Newton sums of one batch (module docstring) to ``fisher`` / ``fisher_diag``
    (not yet divided by ``2 N S``). The labels of sequence i (its index in the windows) come from
    ``torch.Generator().manual_seed(seed * 1_000_003 + i)`` on the CPU: the same whatever the batching."""
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


__all__ = ["attribution_scores"]
