"""Next-token metrics of logits, in float64: cross-entropy, KL divergence, entropy, top-1 (see docs/metrics.md)."""

from collections.abc import Callable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .errors import InputError

#: logits turned into float64 at once: off the CPU (16 M, 128 MB), and on a CPU per torch thread (128 k, 1 MB: the
#: chunk stays in a core's cache from the conversion to the sum; docs/metrics.md, "Precision")
CHUNK_ELEMENTS, CACHE_ELEMENTS = 1 << 24, 1 << 17


def _per_chunk(fn: Callable[..., Tensor], *tensors: Tensor) -> Tensor:
    """``fn`` of row chunks of ``tensors`` (``[*lead, vocab]`` and ``[*lead]``; rows of the last leading dimension,
    one index of the others at a time, no copy), their float64 copies under :data:`CACHE_ELEMENTS` logits per thread
    on a CPU and :data:`CHUNK_ELEMENTS` elsewhere; the results ``[*lead]`` stacked back (gradients flow)."""
    first = tensors[0]
    if first.ndim < 2:
        raise InputError(f"logits must have shape [batch, ..., vocab], got {tuple(first.shape)}")
    per = CACHE_ELEMENTS * torch.get_num_threads() if first.device.type == "cpu" else CHUNK_ELEMENTS
    step = max(1, per // max(1, first.shape[-1] * sum(t.ndim == first.ndim for t in tensors)))

    def rows(ts: tuple[Tensor, ...]) -> Tensor:
        if ts[0].ndim > 2 and len(ts[0]):
            return torch.stack([rows(tuple(t[i] for t in ts)) for i in range(len(ts[0]))])
        parts = [fn(*(t[s:s + step] for t in ts)) for s in range(0, len(ts[0]), step)] or [fn(*ts)]  # empty: as is
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return rows(tensors)


def next_token_loss(logits: Float[Tensor, "batch pos vocab"], tokens: Int[Tensor, "batch pos"]
                    ) -> Float[Tensor, "batch pos_minus_1"]:
    """Cross-entropy of predicting ``tokens[:, 1:]`` from ``logits[:, :-1]``, per position, float64 (nats):
    ``loss[b, i] = -log softmax(logits[b, i])[tokens[b, i + 1]]``."""
    if logits.ndim != 3 or tokens.ndim != 2 or logits.shape[:2] != tokens.shape:
        raise InputError(f"logits [batch, pos, vocab] and tokens [batch, pos] must agree, got "
                         f"{tuple(logits.shape)} and {tuple(tokens.shape)}")

    def chunk(lg: Tensor, tk: Tensor) -> Tensor:
        logp = torch.log_softmax(lg.to(torch.float64), dim=-1)
        return -logp.gather(-1, tk[..., None].long()).squeeze(-1)

    return _per_chunk(chunk, logits[:, :-1], tokens[:, 1:])


def kl_divergence(logits_p: Float[Tensor, "*batch vocab"], logits_q: Float[Tensor, "*batch vocab"]
                  ) -> Float[Tensor, " *batch"]:
    """``KL(p || q) = sum_v p_v (log p_v - log q_v)`` per position, float64, with ``p = softmax(logits_p)``, clamped
    at 0 (the float64 sum can be a few ulp below 0 when ``p == q``); both inputs of one shape."""
    if logits_p.shape != logits_q.shape:
        raise InputError(f"logits_p and logits_q must have the same shape, got {tuple(logits_p.shape)} and "
                         f"{tuple(logits_q.shape)}")

    def chunk(lp: Tensor, lq: Tensor) -> Tensor:
        a, b = (torch.log_softmax(t.to(torch.float64), dim=-1) for t in (lp, lq))
        return (a.exp() * (a - b)).sum(-1).clamp_min(0.0)

    return _per_chunk(chunk, logits_p, logits_q)


def entropy(logits: Float[Tensor, "*batch vocab"]) -> Float[Tensor, " *batch"]:
    """Entropy ``H(p) = -sum_v p_v log p_v`` of ``p = softmax(logits)`` per position, float64 (nats)."""

    def chunk(lg: Tensor) -> Tensor:
        logp = torch.log_softmax(lg.to(torch.float64), dim=-1)
        return -(logp.exp() * logp).sum(-1)

    return _per_chunk(chunk, logits)


def top1(logits: Float[Tensor, "*batch vocab"]) -> Int[Tensor, " *batch"]:
    """The most likely token per position, ``argmax_v logits_v`` (the argmax of the softmax; first on ties)."""
    return logits.argmax(-1)


def top1_agreement(logits_p: Float[Tensor, "*batch vocab"], logits_q: Float[Tensor, "*batch vocab"]
                   ) -> Float[Tensor, " *batch"]:
    """1.0 where both logits have the same argmax, else 0.0 (float64), per position."""
    return (top1(logits_p) == top1(logits_q)).to(torch.float64)


__all__ = ["CACHE_ELEMENTS", "CHUNK_ELEMENTS", "entropy", "kl_divergence", "next_token_loss", "top1", "top1_agreement"]
