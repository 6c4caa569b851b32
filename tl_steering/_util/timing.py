"""The one timing primitive: a block's wall and CPU time, a call's median time, several calls in alternating
rounds (docs/statistics.md, "Timing")."""

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch


@dataclasses.dataclass
class Stopwatch:
    """Wall and process-CPU seconds of a ``with timed() as sw:`` block (filled when the block ends, also
    when it raises)."""

    wall_s: float = 0.0
    cpu_s: float = 0.0


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


def _call_seconds(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """(wall seconds of one ``fn()``: CUDA events on a CUDA device (the device time of the queued work), else
    ``time.perf_counter``; what it returned)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, out
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median_seconds(fn: Callable[[], Any], device: torch.device | str = "cpu", warmup: int = 2,
                   repeats: int = 5) -> float:
    """Median wall time in seconds of ``fn()``: the one-function case of :func:`alternating_seconds`."""
    return float(statistics.median(alternating_seconds([fn], device, warmup, repeats)[0]))


def alternating_seconds(fns: Sequence[Callable[[], Any]], device: torch.device | str = "cpu", warmup: int = 1,
                        rounds: int = 5, after: Callable[[Any], None] | None = None) -> list[list[float]]:
    """``times[i][r]``: seconds of ``fns[i]`` in round ``r``, the order rotated per round (docs/statistics.md,
    "Timing"); ``after``, when given, receives what each call returned (warm-ups included), outside the timing."""
    device = torch.device(device)
    n = len(fns)
    times: list[list[float]] = [[] for _ in range(n)]
    done = after or (lambda out: None)
    with torch.no_grad():
        for _ in range(warmup):
            for fn in dict.fromkeys(fns):  # a function listed twice (an A/A control) is warmed once
                done(fn())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for r in range(max(1, rounds)):
            for j in range(n):
                i = (j + r) % n
                t, out = _call_seconds(fns[i], device)
                times[i].append(t)
                done(out)
    return times


__all__ = ["Stopwatch", "alternating_seconds", "median_seconds", "timed"]
