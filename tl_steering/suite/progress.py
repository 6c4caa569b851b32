"""Progress of a suite run: the :class:`Progress` protocol :func:`~tl_steering.suite.run_suite` reports to, and
:class:`TqdmProgress`, one tqdm bar per stage on stderr."""

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from .._util import progress as _progress
from .settings import STAGES

Tick = Callable[[str], None]


class Progress(Protocol):
    """What run_suite reports progress to: ``with progress.stage(name, total) as tick: tick(note)``."""

    def stage(self, name: str, total: int = 1) -> Any: ...


def _label(name: str) -> str:
    """``[k/10] name``: where a stage's bar or line starts (k its place in STAGES, 0 for another name)."""
    return f"[{STAGES.index(name) + 1 if name in STAGES else 0}/{len(STAGES)}] {name:<9}"


class TqdmProgress:
    """One tqdm bar per stage on stderr (``enabled=False``: silent)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def elsewhere(self, name: str, ranks: Any) -> None:
        """One line for a stage that other ranks run (their bars are not drawn here), in its place in the order."""
        if self.enabled:
            print(f"{_label(name)}: on rank {', '.join(map(str, ranks))}", file=sys.stderr)

    @contextmanager
    def stage(self, name: str, total: int = 1) -> Iterator[Tick]:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=_label(name), unit="step", leave=True, file=sys.stderr,
                   disable=not self.enabled, dynamic_ncols=True)
        t0 = time.perf_counter()
        notes = {"step": "", "fwd": ""}

        def show(refresh: bool) -> None:
            bar.set_postfix_str(" | ".join(v for v in notes.values() if v), refresh=refresh)

        def tick(note: str = "") -> None:
            if note:
                notes["step"] = note
                show(False)
            bar.update(1)

        def forwards(stats: _progress.ForwardStats) -> None:  # every adapter forward of the stage
            notes["fwd"] = stats.note()
            show(True)

        try:
            with _progress.reporting(forwards, min_interval=1.0):
                yield tick
            if bar.n < total:
                bar.update(total - bar.n)
        finally:
            bar.set_postfix_str(f"{time.perf_counter() - t0:.1f}s", refresh=True)
            bar.close()


__all__ = ["Progress", "Tick", "TqdmProgress"]
