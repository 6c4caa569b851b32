"""The claim a result judges (:class:`Claim`, every protocol result's ``claim()``; docs/suite.md, "Claims") and the
short number words of its sentences (:func:`fmt`, :func:`sgn`, :func:`pct`, :func:`span`, :func:`plural`)."""

import dataclasses
import math
from typing import Any

from ..errors import InputError


def as_number(x: Any) -> float:
    """``x`` as a float (NaN for None, a bool or anything that is not a number)."""
    if x is None or isinstance(x, bool):
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def fmt(x: Any, digits: int = 3) -> str:
    """A number as short text: ``digits`` significant digits, ``n/a`` for NaN / None."""
    v = as_number(x)
    return "n/a" if not math.isfinite(v) else f"{v:.{digits}g}"


def sgn(x: Any) -> str:
    """A signed number (a loss change): ``+0.123``, ``-0.0456``, ``n/a``."""
    v = as_number(x)
    return "n/a" if not math.isfinite(v) else f"{v:+.3g}"


def pct(x: Any) -> str:
    """A fraction as a whole percentage: ``83%``, ``n/a``."""
    v = as_number(x)
    return f"{100 * v:.0f}%" if math.isfinite(v) else "n/a"


def span(lo: Any, hi: Any) -> str:
    """``lo–hi``, ``≥ lo`` or ``≤ hi`` (a band or range with an open end)."""
    if lo is None and hi is None:
        return "any value"
    if hi is None:
        return f"≥ {fmt(lo, 4)}"
    return f"≤ {fmt(hi, 4)}" if lo is None else f"{fmt(lo, 4)}–{fmt(hi, 4)}"


def plural(k: int, noun: str) -> str:
    """``1 layer``, ``3 layers``."""
    return f"{k} {noun}" + ("" if k == 1 else "s")


#: the verdicts a :class:`Claim` can carry
VERDICTS = ("holds", "partly holds", "does not hold", "undecided", "not judged")


@dataclasses.dataclass(frozen=True)
class Claim:
    """One claim judged on one result: what is claimed, our number with its interval, the verdict (one of
    :data:`VERDICTS`) and why (every protocol result's ``claim()``; fields: docs/suite.md, "Claims")."""

    statement: str
    verdict: str
    why: str
    value: Any = None
    interval: tuple[float, float] | None = None
    by: str = "paper"
    parts: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise InputError(f"Claim verdict must be one of {VERDICTS}, got {self.verdict!r}")

    @property
    def ok(self) -> bool | None:
        """True when it holds, False when it does not, None otherwise (partly, undecided, not judged)."""
        return {"holds": True, "does not hold": False}.get(self.verdict)

    def sentence(self) -> str:
        """The claim in one sentence, as the report shows it."""
        if not self.statement:
            return f"No verdict: {self.why}."
        head = "The paper" if self.by == "paper" else "Ours, not the paper's claim [ours]"
        return f"{head}: {self.statement}; here {self.why}."


__all__ = ["VERDICTS", "Claim", "as_number", "fmt", "pct", "plural", "sgn", "span"]
