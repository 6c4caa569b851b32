"""Next-token metrics of logits, in float64: cross-entropy, KL divergence, entropy, top-1 (see docs/metrics.md)."""

from collections.abc import Callable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .errors import InputError

CHUNK_ELEMENTS: int = 1 << 24
"""Most logits (16 M, 128 MB in float64) turned into float64 at once."""


def _per_chunk(fn: Callable[..., Tensor], *tensors: Tensor) -> Tensor:
    """``fn`` of slices of the leading dimension whose float64 copy stays under :data:`CHUNK_ELEMENTS` elements,
    concatenated."""
    first = tensors[0]
    if first.ndim < 2:
        raise InputError(f"logits must have shape [batch, ..., vocab], got {tuple(first.shape)}")
    step = max(1, CHUNK_ELEMENTS // (max(1, first[0].numel()) if first.shape[0] else 1))
    parts = [fn(*(t[start:start + step] for t in tensors)) for start in range(0, first.shape[0], step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def next_token_loss(logits: Float[Tensor, "batch pos vocab"], tokens: Int[Tensor, "batch pos"]
                    ) -> Float[Tensor, "batch pos_minus_1"]:
    """Cross-entropy of predicting ``tokens[:, 1:]`` from ``logits[:, :-1]``, per position, float64 (nats):
    ``loss[b, i] = -log softmax(logits[b, i])[tokens[b, i + 1]]``."""
    if logits.ndim != 3 or tokens.ndim != 2 or logits.shape[:2] != tokens.shape:
        raise InputError(f"logits [batch, pos, vocab] and tokens [batch, pos] must agree, got "
                         f"{tuple(logits.shape)} and {tuple(tokens.shape)}")

    def chunk(lg: Tensor, tk: Tensor) -> Tensor:
        logp = torch.log_softmax(lg[:, :-1].to(torch.float64), dim=-1)
        return -logp.gather(-1, tk[:, 1:, None].long()).squeeze(-1)

    return _per_chunk(chunk, logits, tokens)


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


__all__ = ["CHUNK_ELEMENTS", "entropy", "kl_divergence", "next_token_loss", "top1", "top1_agreement"]
