"""Interrupt-safe ``torch.func`` transforms: every package call of ``jvp``, ``linearize``, ``vmap``, ``jacrev`` and
``jacfwd`` goes through here, inside an :class:`autodiff_section` (why and how: docs/hooks.md, "Interrupts",
autodiff transforms). Nothing is patched: the functions call ``torch.func``'s inside a section; ``vmap(jacrev(f))``
composes as in ``torch.func`` and runs as one section."""

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.autograd.forward_ad as _fwad
from torch._functorch import eager_transforms as _eager

from .hookbase import shielded
from .interrupts import _main_thread, deferred_signals

_functorch = torch._C._functorch


class AutodiffState(NamedTuple):
    """torch's autodiff state that a transform enters and must leave."""

    depth: int  # functorch's dynamic layer stack (this thread)
    jvp_nesting: int  # torch._functorch.eager_transforms.JVP_NESTING
    fwd_level: int  # torch.autograd.forward_ad._current_level (-1: no forward-AD level)
    fwd_grad: bool  # forward gradients enabled (torch._C._is_fwd_grad_enabled)
    grad: bool  # torch.is_grad_enabled()
    inplace_requires_grad: bool  # functorch's inplace-requires-grad switch


def autodiff_state() -> AutodiffState:
    """The current :class:`AutodiffState` (cheap: a few C calls)."""
    return AutodiffState(
        depth=int(_functorch.get_dynamic_layer_stack_depth()),
        jvp_nesting=int(_eager.JVP_NESTING),
        fwd_level=int(_fwad._current_level),
        fwd_grad=bool(torch._C._is_fwd_grad_enabled()),
        grad=torch.is_grad_enabled(),
        inplace_requires_grad=bool(_functorch.get_inplace_requires_grad_allowed()))


def _exit_forward_levels(above: int) -> bool:
    """Exit every forward-AD level above ``above`` in torch's C++ registry (by index, newest first: the Python
    mirror may not show one) and in the mirror; whether one was left (idempotent)."""
    left = int(_fwad._current_level) != above
    top = max(int(_fwad._current_level), above + 1)  # torch allows one level (no nesting): index 0 at most
    for level in range(top, above, -1):
        try:
            torch._C._exit_dual_level(level=level)
            left = True
        except RuntimeError:
            pass
    _fwad._current_level = above
    return left


def restore_autodiff_state(to: AutodiffState) -> bool:
    """Unwind torch's autodiff state to ``to`` (idempotent: what a transform left entered is exited); whether
    anything had been left."""
    left = autodiff_state() != to
    if _functorch.get_dynamic_layer_stack_depth() > to.depth:
        _functorch.pop_dynamic_layer_stack_and_undo_to_depth(to.depth)
    _eager.JVP_NESTING = to.jvp_nesting
    left = _exit_forward_levels(to.fwd_level) or left
    torch._C._set_fwd_grad_enabled(to.fwd_grad)
    torch.set_grad_enabled(to.grad)
    _functorch.set_inplace_requires_grad_allowed(to.inplace_requires_grad)
    return left


class autodiff_section:  # noqa: N801 - used like a function: ``with autodiff_section(): ...``
    """Run a ``torch.func`` transform so that no interrupt can leave torch's autodiff state half-entered
    (docs/hooks.md, "Interrupts"). Nested sections hold for the outermost one."""

    def __init__(self) -> None:
        self._hold = deferred_signals()
        self._entry: AutodiffState | None = None
        self.unwound = False  # whether an exit found state to unwind (tests read it)

    def __enter__(self) -> "autodiff_section":
        self._hold.__enter__()  # first: a signal after this is held until the transform is done
        self._entry = autodiff_state()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        entry, self._entry = self._entry, None
        try:
            if exc_type is not None and entry is not None and _main_thread():
                shielded(lambda: self._unwind(entry))
        finally:
            self._hold.__exit__(exc_type, exc, tb)  # delivers a held signal: its exception propagates from here
        return None

    def _unwind(self, entry: AutodiffState) -> None:
        self.unwound = restore_autodiff_state(entry) or self.unwound


class Transformed:
    """A ``torch.func`` transform of a function (``vmap(f)``, ``jacrev(f)``...): calling it runs the transform inside
    an :class:`autodiff_section`. ``raw`` is torch's transformed function (what an enclosing transform composes)."""

    __slots__ = ("raw",)

    def __init__(self, raw: Callable) -> None:
        self.raw = raw

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with autodiff_section():
            return self.raw(*args, **kwargs)


def _raw(func: Callable) -> Callable:
    return func.raw if isinstance(func, Transformed) else func


def _transform(torch_fn: Callable) -> Callable[..., Transformed]:
    def transform(func: Callable, *args: Any, **kwargs: Any) -> Transformed:
        return Transformed(torch_fn(_raw(func), *args, **kwargs))

    transform.__name__ = torch_fn.__name__
    transform.__doc__ = f"``torch.func.{torch_fn.__name__}(func, ...)``, called inside an :class:`autodiff_section`."
    return transform


vmap = _transform(torch.func.vmap)
jacrev = _transform(torch.func.jacrev)
jacfwd = _transform(torch.func.jacfwd)


def jvp(func: Callable, primals: Any, tangents: Any, **kwargs: Any) -> Any:
    """``torch.func.jvp(func, primals, tangents, ...)`` inside an :class:`autodiff_section`."""
    with autodiff_section():
        return torch.func.jvp(_raw(func), primals, tangents, **kwargs)


def linearize(func: Callable, *primals: Any) -> tuple[Any, Callable]:
    """``torch.func.linearize(func, *primals)`` inside an :class:`autodiff_section` (the tracing runs forward AD
    under ``make_fx``). The returned ``jvp_fn`` replays a traced graph and enters no autodiff state."""
    with autodiff_section():
        return torch.func.linearize(_raw(func), *primals)


__all__ = ["AutodiffState", "Transformed", "autodiff_section", "autodiff_state", "jacfwd", "jacrev", "jvp",
           "linearize", "restore_autodiff_state", "vmap"]
