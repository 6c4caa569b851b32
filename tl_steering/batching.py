"""Running a model over token batches: activation collection and the token-weighted mean loss
(see docs/metrics.md, "Mean loss over batches"). The model is reached through the backend adapter only.
"""

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jaxtyping import Int
from torch import Tensor

from .backends import ModelAdapter, adapt, check_finite

HookList = list[tuple[str, Callable[..., Any]]]


def iter_batches(
    ad: ModelAdapter,
    tokens: Int[Tensor, "batch pos"],
    names: Sequence[str],
    batch_size: int,
    fwd_hooks: HookList = (),
    first_names: Sequence[str] = (),
) -> Iterator[tuple[slice, Tensor, dict[str, Tensor]]]:
    """Forward ``tokens`` in batches of ``batch_size`` sequences with :meth:`ModelAdapter.run_with_cache`.

    Yields ``(rows, logits, cache)`` per batch, ``rows`` the slice of ``tokens`` it covers. ``first_names`` are
    collected on the first batch only (e.g. :meth:`ModelAdapter.identity_names` for the residual check).
    Every hook is removed after each forward (``run_with_hooks`` runs inside ``hook_guard``).
    """
    n = tokens.shape[0]
    for start in range(0, n, batch_size):
        rows = slice(start, min(start + batch_size, n))
        wanted = list(dict.fromkeys(list(names) + (list(first_names) if start == 0 else [])))
        logits, cache = ad.run_with_cache(tokens[rows], wanted, fwd_hooks=list(fwd_hooks))
        yield rows, logits, cache


def mean_loss(model: Any, tokens: Int[Tensor, "batch pos"], hooks: HookList = (), batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over every predicted token of ``tokens``, with ``hooks``.

    ``sum over batches of sum_i loss_i / number of predicted tokens``: every token weighs the same, whatever
    the batching; accumulated in float64 (:func:`tl_steering.metrics.next_token_loss`). Raises
    :class:`~tl_steering.errors.NonFiniteError` if a loss is NaN/Inf. ``model`` may be a model or its adapter.
    """
    ad = adapt(model)
    total, count = 0.0, 0
    for start in range(0, tokens.shape[0], batch_size):
        lt = ad.loss_per_token(tokens[start:start + batch_size], list(hooks))
        check_finite(lt, None, "next-token loss")
        total += float(lt.sum())
        count += lt.numel()
    return total / count


__all__ = ["HookList", "iter_batches", "mean_loss"]
