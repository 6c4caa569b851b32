"""The one timing primitive (see docs/statistics.md, "Timing"): wall and CPU time of a block, and the median
wall time of a repeated call (CUDA events on a GPU, ``time.perf_counter`` on a CPU).

Timings are never part of a pinned or compared number: they depend on the machine and its load.
"""

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


@dataclasses.dataclass
class Stopwatch:
    """Wall and process-CPU seconds of a ``with timed() as sw:`` block (filled when the block ends, also
    when it raises)."""

    wall_s: float = 0.0
    cpu_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"wall_s": self.wall_s, "cpu_s": self.cpu_s}


@contextlib.contextmanager
def timed() -> Iterator[Stopwatch]:
    """``with timed() as sw: ...`` then ``sw.wall_s`` (``time.perf_counter``) and ``sw.cpu_s``
    (``time.process_time``: every thread of this process)."""
    sw = Stopwatch()
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        yield sw
    finally:
        sw.wall_s = time.perf_counter() - t0
        sw.cpu_s = time.process_time() - c0


def median_seconds(fn: Callable[[], Any], device: torch.device | str = "cpu", warmup: int = 2,
                   repeats: int = 5) -> float:
    """Median wall time in seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed calls.

    Runs under ``torch.no_grad()``. On CUDA each call is bracketed by CUDA events (the device time of the
    queued work); elsewhere by ``time.perf_counter``.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    times: list[float] = []
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
        for _ in range(max(1, repeats)):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


__all__ = ["Stopwatch", "median_seconds", "timed"]
