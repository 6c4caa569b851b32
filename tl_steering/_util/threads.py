"""Thread caps for small batched linear algebra (:func:`single_threaded`) and the cores a process may use."""

import contextlib
import os
from collections.abc import Iterator
from typing import Any

_BLAS: Any = None  # threadpoolctl's handle on the BLAS libraries loaded in this process (numpy's)


def _blas() -> Any:
    global _BLAS
    if _BLAS is None:
        from threadpoolctl import ThreadpoolController

        _BLAS = ThreadpoolController().select(user_api="blas")
    return _BLAS


@contextlib.contextmanager
def single_threaded(blas: bool = True) -> Iterator[None]:
    """Run torch and (``blas``) numpy's BLAS (threadpoolctl) on one thread for the duration, restoring both (why:
    docs/probe.md, "Cost"); process-wide: run no other torch or numpy work in parallel threads inside this block."""
    import torch  # here: usable_cores serves the CLI's launcher, which imports no torch

    before = torch.get_num_threads()
    with contextlib.ExitStack() as stack:  # undone in reverse order, also on an exception
        for lib in [c for c in (_blas().lib_controllers if blas else ()) if c.num_threads > 1]:  # not .limit(): slow
            stack.callback(lib.set_num_threads, lib.num_threads)
            lib.set_num_threads(1)
        if before != 1:
            torch.set_num_threads(1)
            stack.callback(torch.set_num_threads, before)
        yield


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity where the OS has one, else the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


__all__ = ["single_threaded", "usable_cores"]
