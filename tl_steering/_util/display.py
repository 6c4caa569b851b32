"""The short printed form of a result (``Result.__repr__``): a few lines, never tensor contents."""

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


__all__ = ["short_value", "wrap_items"]
