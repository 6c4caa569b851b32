"""The short printed form of a result (``Result.__repr__``): a few lines, never tensor contents; and the short
number words of the claims (:func:`fmt`, :func:`sgn`, :func:`span`, :func:`pct`, :func:`plural`)."""

import math
from typing import Any

import torch

WIDTH = 110
LINES = 4


def short_value(v: Any) -> str:
    """One value of a summary, short: floats to 4 significant digits, long lists and dicts elided."""
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, torch.Tensor):
        return f"tensor{list(v.shape)}" if v.numel() > 1 else short_value(v.item())
    if isinstance(v, (list, tuple)):
        inner = ", ".join(short_value(x) for x in v[:6])
        return f"[{inner}{', …' if len(v) > 6 else ''}]"
    if isinstance(v, dict):
        inner = ", ".join(f"{k}: {short_value(x)}" for k, x in list(v.items())[:4])
        return f"{{{inner}{', …' if len(v) > 4 else ''}}}"
    text = str(v)
    return text if len(text) <= 40 else text[:39] + "…"


def wrap_items(items: Any, prefix: str = "", max_lines: int = LINES) -> list[str]:
    """Comma-separated items in lines of at most WIDTH characters, at most ``max_lines`` lines."""
    lines: list[str] = []
    cur = prefix
    items = list(items)
    for i, item in enumerate(items):
        piece = item if cur in ("", prefix) else ", " + item
        if len(cur) + len(piece) > WIDTH and cur not in ("", prefix):
            lines.append(cur + ",")
            if len(lines) == max_lines:
                lines[-1] += f" … (+{len(items) - i} more)"
                return lines
            cur, piece = "", item
        cur += piece
    if cur not in ("", prefix):
        lines.append(cur)
    return lines


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


__all__ = ["as_number", "fmt", "pct", "plural", "sgn", "short_value", "span", "wrap_items"]
