"""Running a model over token batches: activation collection and the token-weighted mean loss
(see docs/metrics.md, "Mean loss over batches"). The model is reached through the backend adapter only."""

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from jaxtyping import Float64, Int
from torch import Tensor

from ..backends import ModelAdapter, adapt, check_finite
from ..metrics import next_token_loss
from ..stats import block_sums
from .sharding import batch_slices

HookList = list[tuple[str, Callable[..., Any]]]


def iter_batches(ad: ModelAdapter, tokens: Int[Tensor, "batch pos"], names: Sequence[str], batch_size: int,
                 fwd_hooks: HookList = (), first_names: Sequence[str] = (), rows: Sequence[slice] | None = None
                 ) -> Iterator[tuple[slice, Tensor, dict[str, Tensor]]]:
    """``(rows, logits, cache)`` of :meth:`ModelAdapter.run_with_cache` (hooks removed after each forward) per batch
    ``rows`` of ``tokens`` (default every batch of ``batch_size``; a rank's share: :func:`.sharding.my_batches`);
    ``first_names`` are collected on the first batch only (e.g. :meth:`ModelAdapter.identity_names`)."""
    for sl in batch_slices(tokens.shape[0], batch_size) if rows is None else rows:
        wanted = list(dict.fromkeys(list(names) + (list(first_names) if sl.start == 0 else [])))
        logits, cache = ad.run_with_cache(tokens[sl], wanted, fwd_hooks=list(fwd_hooks))
        yield sl, logits, cache


def mean_loss(model: Any, tokens: Int[Tensor, "batch pos"], hooks: HookList = (), batch_size: int = 8,
              world: Any = None) -> float:
    """Mean next-token cross-entropy (nats) over every predicted token of ``tokens``, with ``hooks``, every token
    weighing the same (docs/metrics.md, "Mean loss over batches"); ``model`` may be a model or its adapter."""
    from .sharding import gather_rows, my_batches

    ad = adapt(model)
    n = tokens.shape[0]
    mine = my_batches(n, batch_size, world)
    per_row = torch.zeros(n, dtype=torch.float64)
    for rows in mine:  # per window, the next-token CE summed over its predicted positions
        logits = ad.run_with_hooks(tokens[rows], list(hooks), return_type="logits")
        per_row[rows] = token_losses(logits, tokens[rows]).sum(-1).cpu()
    per_row = gather_rows({"s": per_row}, mine, world)["s"]
    return token_mean(per_row, tokens)


def token_mean(per_row: Tensor, tokens: Int[Tensor, "batch pos"]) -> float:
    """The token-weighted mean CE from per-window sums ``per_row`` of ``tokens``: ``sum / (windows x (pos - 1))``."""
    return float(per_row.sum()) / (tokens.shape[0] * (tokens.shape[1] - 1))


def token_losses(logits: Tensor, tokens: Int[Tensor, "batch pos"]) -> Float64[Tensor, "batch pos_minus_1"]:
    """:func:`tl_steering.metrics.next_token_loss` (float64, on the logits' device); NonFiniteError on NaN/Inf."""
    lt = next_token_loss(logits, tokens)
    check_finite(lt, None, "next-token loss")
    return lt.to(torch.float64)


def loss_block_sums(logits: Tensor, tokens: Int[Tensor, "batch pos"], length: int) -> Tensor:
    """Per window, the next-token CE summed over blocks of ``length`` predicted positions
    (:func:`tl_steering.stats.block_sums`): float64 ``[batch, n_blocks]`` on the CPU, the unit of the plan losses'
    bootstrap (:func:`tl_steering.stats.cluster_bootstrap_ci`); NonFiniteError on NaN/Inf."""
    return block_sums(token_losses(logits, tokens).cpu(), length)


__all__ = ["HookList", "iter_batches", "loss_block_sums", "mean_loss", "token_losses", "token_mean"]
