"""Thread caps for small batched linear algebra: :func:`single_threaded`."""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

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
    products, ``probing.kernels.gram_sets``) is capped through threadpoolctl, which finds the library whatever it
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


__all__ = ["single_threaded"]
