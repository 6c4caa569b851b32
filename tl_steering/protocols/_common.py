"""Helpers shared by the protocols: argument checks, float64 activations, the single-thread block, and
re-exports of the shared primitives (:mod:`tl_steering.data.batching`, :mod:`tl_steering.stats`).

Nothing here knows TransformerLens's classes: the model is reached through :class:`ModelAdapter`.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from .. import geometry as geo
from ..backends import check_finite
from ..data.batching import HookList, iter_batches, mean_loss
from ..validation import as_int
from ..stats import (
    bin_labels,
    bootstrap_ci,
    check_exclude_positions,
    finite_mean,
    masked_mean,
    position_bin_edges,
    position_bin_index,
    position_bins,
    position_mask,
)


# ----------------------------------------------------------------------------------------------------------
# argument checks (tl_steering.validation does the checking)


def check_batch_size(batch_size: Any) -> int:
    return as_int(batch_size, "batch_size", minimum=1)


def check_seed(seed: Any) -> int:
    return as_int(seed, "seed")


def check_n_bootstrap(n_bootstrap: Any) -> int:
    """An int >= 0 (0 = no confidence interval)."""
    return as_int(n_bootstrap, "n_bootstrap", minimum=0)


# ----------------------------------------------------------------------------------------------------------
# activations


def activation64(cache: dict[str, Tensor], name: str, layer: int | None, site: str) -> Float[Tensor, "b p d"]:
    """A cached activation as float64, after checking it is finite (NonFiniteError names layer and site)."""
    x = cache[name]
    check_finite(x, layer, site)
    return geo.to64(x)


_BLAS: Any = None  # threadpoolctl's handle on the BLAS libraries loaded in this process (numpy's)


def _blas() -> Any:
    global _BLAS
    if _BLAS is None:
        from threadpoolctl import ThreadpoolController

        _BLAS = ThreadpoolController().select(user_api="blas")
    return _BLAS


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch on one intra-op thread, and numpy's BLAS on one thread, for the duration (restores both).

    Batched LAPACK calls (``svdvals`` of ``[batch, n, d]``) through MKL with two OpenMP threads ran 5-100x slower
    than with one on a shared 2-core machine (MKL's threads spin against each other and against other
    processes); the matrices here are small, so one thread loses nothing. Numpy's BLAS (the probe's Gram
    products, ``probe_kernels.gram_sets``) is capped through threadpoolctl, which finds the library whatever it
    is (OpenBLAS, MKL, BLIS): a multi-threaded OpenBLAS serializes two threads that call it at once. Both
    settings are process-wide: do not run other torch or numpy work in parallel threads inside this block.
    """
    before = torch.get_num_threads()
    blas = _blas()
    with contextlib.ExitStack() as stack:  # undone in reverse order, also on an exception
        if any(lib.num_threads > 1 for lib in blas.lib_controllers):
            stack.enter_context(blas.limit(limits=1))
        if before != 1:
            torch.set_num_threads(1)
            stack.callback(torch.set_num_threads, before)
        yield


__all__ = [
    "activation64",
    "bin_labels",
    "bootstrap_ci",
    "check_batch_size",
    "check_exclude_positions",
    "check_n_bootstrap",
    "check_seed",
    "finite_mean",
    "HookList",
    "iter_batches",
    "masked_mean",
    "mean_loss",
    "position_bin_edges",
    "position_bin_index",
    "position_bins",
    "position_mask",
    "single_threaded",
]
