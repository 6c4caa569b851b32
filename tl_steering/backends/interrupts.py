"""Signal safety for a model's hook state: every registered scope is restored before a signal's exception (Ctrl-C
above all) propagates. See docs/hooks.md, "Interrupts"."""

import contextlib
import signal
import threading
from typing import Any, Protocol

from _signal import getsignal as _getsignal  # the C function under signal.getsignal: no enum conversion

from .hookbase import shielded


class Restorer(Protocol):
    """A scope that can put a model's hook state back; ``restore`` is idempotent and may run re-entrantly (inside
    itself, when a second signal lands while it runs)."""

    interrupted: bool

    def restore(self) -> None: ...


_SIGNALS = tuple(sorted(int(s) for s in signal.valid_signals()
                       - {getattr(signal, n, None) for n in ("SIGKILL", "SIGSTOP")}))
_local = threading.local()
_previous: dict[int, Any] = {}  # signal number -> the Python handler ours replaced (main thread only)
_installed = [False]


def _registry() -> list[Restorer]:
    reg = getattr(_local, "registry", None)
    if reg is None:
        reg = _local.registry = []
    return reg


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _on_signal(signum: int, frame: Any) -> None:
    prev = _previous.get(signum)
    try:
        if callable(prev):
            prev(signum, frame)
        elif signum == signal.SIGINT:  # pragma: no cover - installed only over a callable
            signal.default_int_handler(signum, frame)
    except BaseException:
        reg = _registry()
        for r in reversed(list(reg)):
            r.interrupted = True  # first: a restore may undo more after an interrupt (ownership._Token)
            with contextlib.suppress(BaseException):  # a nested handler call restored everything itself
                shielded(r.restore)
        reg.clear()
        _uninstall()
        raise


def _unsupported(e: BaseException) -> bool:
    """Whether ``e`` says that signal handlers cannot be set here (not the main thread), rather than being a signal
    handler's own exception (``signal.signal`` runs pending handlers first)."""
    return isinstance(e, ValueError) and "main" in str(e)


def _install() -> None:
    if _installed[0] or not _main_thread():
        return
    try:
        for sig in _SIGNALS:
            cur = _getsignal(sig)
            if cur is _on_signal or not callable(cur):
                continue
            _previous[sig] = cur  # set before the swap: a signal right after it finds the handler to call
            signal.signal(sig, _on_signal)
        _installed[0] = True
    except BaseException as e:  # noqa: BLE001 - a signal handler's exception: undo the swaps, then re-raise
        _uninstall()
        if not _unsupported(e):
            raise


def _uninstall() -> None:
    """Put every replaced handler back (where ours is still installed); a signal handler's exception raised
    meanwhile is re-raised once all are back."""
    if not _main_thread():
        return
    _installed[0] = False

    def put_back() -> None:
        for sig, prev in list(_previous.items()):
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, prev)
            for section in _sections:  # a deferred section holding this signal puts prev back, not ours
                if section._saved.get(sig) is _on_signal:
                    section._saved[sig] = prev
            _previous.pop(sig, None)

    shielded(put_back)


def register(r: Restorer) -> None:
    """Register ``r`` until :func:`unregister`: a signal whose handler raises meanwhile restores it before the
    exception propagates. Call it after taking the snapshot and before the first change to the model."""
    _install()  # first: a signal between the two finds r registered or not yet changed anything
    _registry().append(r)


def unregister(r: Restorer) -> None:
    """Remove ``r`` (and any scope registered after it that is still listed) after its final restore."""
    reg = _registry()
    for i in range(len(reg) - 1, -1, -1):
        if reg[i] is r:
            del reg[i:]
            break
    if not reg:
        _uninstall()


# the deferred sections open on the main thread, outermost first: a signal that lands while one swaps its handlers
# (on entry or exit) runs our handler at once, whose _uninstall must then hand the section the handler to put back
_sections: list["deferred_signals"] = []


class deferred_signals:  # noqa: N801 - used like a function: ``with deferred_signals(): ...``
    """Hold every signal that has a Python handler while the block runs; deliver each held one on exit through the
    handler installed on entry. For short sections no Python-level cleanup can make safe (docs/hooks.md,
    "Interrupts"). Main thread only; nested sections hold for the outermost one."""

    def __init__(self) -> None:
        self._saved: dict[int, Any] = {}
        self._pending: list[tuple[int, Any]] = []

    def _hold(self, signum: int, frame: Any) -> None:
        self._pending.append((signum, frame))

    def __enter__(self) -> "deferred_signals":
        if not _main_thread():
            return self
        _sections.append(self)  # before the first swap: _uninstall finds what this section will put back
        try:
            for sig in _SIGNALS:
                cur = _getsignal(sig)
                if callable(cur):
                    self._saved[sig] = cur  # before the swap: __exit__ puts back exactly what it replaced
                    signal.signal(sig, self._hold)
        except BaseException as e:  # noqa: BLE001 - a handler's exception while swapping: undo, re-raise
            self.__exit__()
            if not _unsupported(e):
                raise
        return self

    def __exit__(self, *exc: Any) -> None:
        saved = self._saved  # the same dict _uninstall may update while the handlers are put back

        def put_back() -> None:  # a handler put back may run (and raise) before the others are: shielded finishes
            for sig in list(saved):
                if _getsignal(sig) == self._hold:  # a handler the block installed stays (it restores its own)
                    signal.signal(sig, saved[sig])

        try:
            shielded(put_back)
        except BaseException:  # that signal's handler already ran: it is the interrupt the caller gets
            self._pending = []
            raise
        finally:
            self._saved = {}
            if self in _sections:
                _sections.remove(self)
        pending, self._pending = self._pending, []
        for signum, frame in pending:  # delivered now, outside the section; the first raising one propagates
            handler = saved.get(signum)
            if callable(handler):
                handler(signum, frame)
        return None


def registered() -> int:
    """How many scopes are registered on this thread (0 outside every tl_steering call; tests check it)."""
    return len(_registry())


__all__ = ["Restorer", "deferred_signals", "register", "registered", "unregister"]
