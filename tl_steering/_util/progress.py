"""Progress inside long stages: a tick per forward pass, with tokens/s, without a callback argument on every
protocol (docs/suite.md, "Progress")."""

import contextlib
import contextvars
import dataclasses
import time
from typing import Callable, Iterator


@dataclasses.dataclass
class ForwardStats:
    """Forward passes seen by one :func:`reporting` block so far."""

    forwards: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def note(self) -> str:
        """Short text for a progress bar, e.g. ``"12 fwd, 3,410 tok/s"``."""
        return f"{self.forwards} fwd, {self.tokens_per_s:,.0f} tok/s"


class _Block:
    def __init__(self, callback: Callable[[ForwardStats], None], min_interval: float,
                 parent: "_Block | None"):
        self.callback = callback
        self.min_interval = min_interval
        self.parent = parent
        self.t0 = time.perf_counter()
        self.last = -float("inf")
        self.stats = ForwardStats()

    def add(self, n_tokens: int) -> None:
        now = time.perf_counter()
        self.stats.forwards += 1
        self.stats.tokens += int(n_tokens)
        self.stats.seconds = now - self.t0
        if now - self.last >= self.min_interval:
            self.last = now
            self.callback(self.stats)


_current: contextvars.ContextVar[_Block | None] = contextvars.ContextVar("tl_steering_progress", default=None)


@contextlib.contextmanager
def reporting(callback: Callable[[ForwardStats], None], min_interval: float = 0.5) -> Iterator[ForwardStats]:
    """Report every forward pass run inside the block to ``callback``, yielding the live :class:`ForwardStats`
    (docs/suite.md, "Progress")."""
    block = _Block(callback, min_interval, _current.get())
    token = _current.set(block)
    try:
        yield block.stats
    finally:
        _current.reset(token)
        if block.stats.forwards and block.last < block.t0 + block.stats.seconds:
            block.callback(block.stats)


def forward_done(n_tokens: int) -> None:
    """Count one forward pass of ``n_tokens`` tokens in every open :func:`reporting` block (no-op if none)."""
    block = _current.get()
    while block is not None:
        block.add(n_tokens)
        block = block.parent


__all__ = ["ForwardStats", "forward_done", "reporting"]
