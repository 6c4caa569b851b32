"""Helpers shared by the protocols: batched activation collection, position masks and bins, per-sequence
aggregation and the bootstrap over sequences.

Nothing here knows TransformerLens's classes: the model is reached through :class:`ModelAdapter`.
"""

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .. import geometry as geo
from ..backends import ModelAdapter, check_finite
from ..errors import InputError

HookList = list[tuple[str, Callable[..., Any]]]


# ----------------------------------------------------------------------------------------------------------
# argument checks


def check_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive int, got {batch_size!r}")
    return batch_size


def check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(f"seed must be an int, got {seed!r}")
    return seed


def check_exclude_positions(exclude_positions: Any) -> tuple[int, ...]:
    """Normalise ``exclude_positions`` to a tuple of ints (negative indices count from the end)."""
    if exclude_positions is None:
        return ()
    if isinstance(exclude_positions, int) and not isinstance(exclude_positions, bool):
        exclude_positions = (exclude_positions,)
    try:
        out = tuple(exclude_positions)
    except TypeError as e:
        raise InputError(f"exclude_positions must be a tuple of ints such as (0,), got {exclude_positions!r}") from e
    for p in out:
        if isinstance(p, bool) or not isinstance(p, int):
            raise InputError(f"exclude_positions must hold ints, got {p!r}")
    return out


def check_n_bootstrap(n_bootstrap: Any) -> int:
    if isinstance(n_bootstrap, bool) or not isinstance(n_bootstrap, int) or n_bootstrap < 0:
        raise InputError(f"n_bootstrap must be an int >= 0 (0 = no confidence interval), got {n_bootstrap!r}")
    return n_bootstrap


# ----------------------------------------------------------------------------------------------------------
# running the model in batches


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


def activation64(cache: dict[str, Tensor], name: str, layer: int | None, site: str) -> Float[Tensor, "b p d"]:
    """A cached activation as float64, after checking it is finite (NonFiniteError names layer and site)."""
    x = cache[name]
    check_finite(x, layer, site)
    return geo.to64(x)


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch on one intra-op thread for the duration (restores the previous count).

    Batched LAPACK calls (``svdvals`` of ``[batch, n, d]``) through MKL with two OpenMP threads ran 5-100x slower
    than with one on a shared 2-core machine (MKL's threads spin against each other and against other
    processes); the matrices here are small, so one thread loses nothing. ``torch.set_num_threads`` is
    process-wide: do not run other torch work in parallel threads inside this block.
    """
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------------------
# positions


def position_mask(n_pos: int, exclude_positions: Sequence[int], device: torch.device | str = "cpu"
                  ) -> Bool[Tensor, " pos"]:
    """True at the positions that enter statistics (``exclude_positions`` are False; negatives count from
    the end; indices outside the sequence are ignored)."""
    mask = torch.ones(n_pos, dtype=torch.bool, device=device)
    for p in exclude_positions:
        if -n_pos <= p < n_pos:
            mask[p] = False
    if not bool(mask.any()):
        raise InputError(f"exclude_positions={tuple(exclude_positions)} leaves no position of a length-{n_pos} "
                         "sequence; exclude fewer positions or pass longer sequences")
    return mask


def position_bins(n_pos: int) -> tuple[list[int], Int[Tensor, " pos"]]:
    """Log-spaced position bins ``[1, 2), [2, 4), [4, 8), ...`` covering positions ``1..n_pos-1``.

    Returns:
        ``(edges, index)``: ``edges = [1, 2, 4, ..., 2^k]`` (bin ``j`` is ``[edges[j], edges[j+1])``; the last
        bin is cut at ``n_pos``), and ``index[p]`` the bin of position ``p`` (-1 for position 0).
    """
    # positions 1..n_pos-1 fall in bins 0..k-1 with k the bit length of n_pos - 1
    n_bins = max(1, (n_pos - 1).bit_length())
    edges = [2**j for j in range(n_bins + 1)]
    pos = torch.arange(n_pos)
    index = torch.full((n_pos,), -1, dtype=torch.long)
    index[1:] = torch.floor(torch.log2(pos[1:].to(torch.float64))).long()
    return edges, index


def bin_labels(edges: Sequence[int], n_pos: int) -> list[str]:
    return [f"[{lo},{min(hi, n_pos)})" for lo, hi in zip(edges[:-1], edges[1:])]


# ----------------------------------------------------------------------------------------------------------
# degenerate tokens


def nondegenerate(norms: Float[Tensor, "b p"], mask: Bool[Tensor, "b p"], rel: float = geo.DEGENERATE_REL
                  ) -> Bool[Tensor, "b p"]:
    """``mask`` minus the degenerate tokens: norm 0, or below ``rel`` times the median norm of the valid
    positions of the same sequence (per-sequence median, so the result does not depend on the batching)."""
    out = mask & (norms > 0)
    fill = torch.where(mask, norms, torch.full_like(norms, math.nan))
    med = torch.nanmedian(fill, dim=-1, keepdim=True).values
    med = torch.where(torch.isnan(med), torch.zeros_like(med), med)
    return out & (norms >= rel * med)


# ----------------------------------------------------------------------------------------------------------
# aggregation


def masked_mean(values: Float[Tensor, "*b p"], mask: Bool[Tensor, "*b p"], dim: int = -1) -> Tensor:
    """Mean of ``values`` over ``mask`` along ``dim`` (NaN where nothing is valid)."""
    w = mask.to(values.dtype)
    total = torch.where(mask, values, torch.zeros_like(values)).sum(dim)
    count = w.sum(dim)
    return torch.where(count > 0, total / count.clamp_min(1.0), torch.full_like(total, math.nan))


def bootstrap_ci(
    per_sequence: Float[Tensor, "seq *rest"],
    statistic: Callable[[Tensor], Tensor] | None = None,
    n_bootstrap: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> Float[Tensor, "*out 2"]:
    """Percentile bootstrap CI over sequences (rows resampled with replacement, seeded generator).

    Args:
        per_sequence: one row per sequence (any trailing shape).
        statistic: maps a ``[seq, *rest]`` sample to the statistic (default: ``nanmean`` over sequences).
        n_bootstrap: resamples; 0 gives NaN bounds.
        seed: seed of the CPU generator (same seed, same interval).
        level: coverage (0.95: the 2.5 % and 97.5 % quantiles).

    Returns:
        ``[*out, 2]`` (lower, upper) in float64.
    """
    stat = statistic or (lambda s: torch.nanmean(s, dim=0))
    x = per_sequence.detach().to("cpu", torch.float64)
    point = stat(x)
    if n_bootstrap == 0 or x.shape[0] < 2:
        return torch.stack([torch.full_like(point, math.nan)] * 2, dim=-1)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, x.shape[0], (n_bootstrap, x.shape[0]), generator=g)
    samples = torch.stack([stat(x[i]) for i in idx])
    alpha = (1.0 - level) / 2.0
    q = torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64)
    flat = samples.reshape(n_bootstrap, -1)
    out = torch.nanquantile(flat, q, dim=0).T  # [cols, 2]
    return out.reshape(*point.shape, 2)


def finite_mean(x: Tensor) -> float:
    """Mean of the finite entries (NaN when there are none)."""
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else math.nan


__all__ = [
    "activation64",
    "bin_labels",
    "bootstrap_ci",
    "check_batch_size",
    "check_exclude_positions",
    "check_n_bootstrap",
    "check_seed",
    "finite_mean",
    "iter_batches",
    "masked_mean",
    "nondegenerate",
    "position_bins",
    "position_mask",
    "single_threaded",
]
