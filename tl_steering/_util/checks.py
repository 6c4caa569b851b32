"""The argument checks the CLI runs before torch is imported (``validation`` re-exports them)."""

import numbers
import sys
from typing import Any

from ..errors import ArgumentTypeError, InputError


def _is_int(v: Any) -> bool:
    """A real integer: Python int, numpy/torch integer scalar; not bool, not float (1.0 is not a layer)."""
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported
    if isinstance(v, bool) or type(v).__name__ in ("bool_", "bool"):  # numpy.bool_
        return False
    if torch is not None and isinstance(v, torch.Tensor):
        return v.dim() == 0 and not v.is_floating_point() and not v.is_complex() and v.dtype != torch.bool
    return isinstance(v, numbers.Integral)


def as_int(value: Any, name: str, *, minimum: int | None = None, maximum: int | None = None,
           where: str = "") -> int:
    """``value`` as an int (rejecting bool, float, str, None), optionally within ``[minimum, maximum]``."""
    name += f" in {where}" if where else ""
    if not _is_int(value):
        raise ArgumentTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    v = int(value)
    if minimum is not None and v < minimum:
        raise InputError(f"{name} must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise InputError(f"{name} must be <= {maximum}, got {v}")
    return v


def check_windows_length(windows: int | None, length: int | None) -> None:
    """The report's limits on ``--windows`` / ``--length`` (None: the default); raises :class:`InputError`."""
    if windows is not None:
        as_int(windows, "--windows (one window is held out for the gates)", minimum=2)
    if length is not None:
        as_int(length, "--length", minimum=16)
