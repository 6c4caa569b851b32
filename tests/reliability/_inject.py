"""Deterministic interrupt injection: deliver a real SIGINT (Ctrl-C) at a chosen bytecode of a call.

A signal's Python handler runs between two bytecodes of whatever frame is executing; a timer cannot choose which,
so a failure it finds cannot be replayed. Here a trace function counts the bytecodes ("opcode" trace events; also
"call"/"line"/"return") executed in the frames of the files that decide a model's hook state, and at event number
``k`` sends the process a SIGINT with ``signal.raise_signal``: the installed SIGINT handler (Python's default one
raises KeyboardInterrupt, a handler of tl_steering's restores the model first) runs right there, exactly as for a
Ctrl-C arriving between those two bytecodes. Events inside the handler itself are not traced (Python does not trace
a trace function's callees), and a trace function that raises is switched off: one interrupt per run.

``count(fn)`` runs ``fn`` once traced and returns its number of events; ``profile(fn)`` also returns the indices of
the "boundary" events (see :func:`_kind`), where a scope changes a model's hook state or enters / leaves (the bulk of
the events are the snapshot loops, which a uniform draw would hit almost every time), and of the first event of
every ``__exit__`` among them. ``interrupt(fn, k)``
runs ``fn`` with the SIGINT at event ``k`` and says whether a KeyboardInterrupt came out. The same ``k`` replays the
same point.
"""

import inspect
import os
import signal
import sys
from collections.abc import Callable
from typing import NamedTuple

# frames whose bytecodes are counted (and may be interrupted): the code that changes a model's hook state or runs
# its hooks -- our lifecycle and hook factories, TransformerLens's hook points and hooks() contexts, torch's hook
# registration / removal and module call path, contextlib (generator-based context managers). A Ctrl-C landing
# elsewhere (inside the arithmetic of a forward or a protocol) is, for the hook state, the same as one landing at
# the next of these events, and tracing everything costs ten times more.
_SEP = os.sep
_TRACED = (
    f"{_SEP}tl_steering{_SEP}backends{_SEP}lifecycle.py",
    f"{_SEP}tl_steering{_SEP}backends{_SEP}interrupts.py",
    f"{_SEP}tl_steering{_SEP}hooks.py",
    f"{_SEP}tl_steering{_SEP}probing{_SEP}trace.py",
    f"{_SEP}transformer_lens{_SEP}hook_points.py",
    f"{_SEP}transformer_lens{_SEP}model_bridge{_SEP}bridge_core.py",  # TL 4.x: the bridge's hooks() / add_hook
    f"{_SEP}transformer_lens{_SEP}model_bridge{_SEP}bridge.py",  # TL 3.x: the same
    f"{_SEP}transformer_lens{_SEP}HookedRootModule.py",
    f"{_SEP}torch{_SEP}nn{_SEP}modules{_SEP}module.py",
    f"{_SEP}torch{_SEP}utils{_SEP}hooks.py",
    f"{_SEP}contextlib.py",
)
_SKIP = (f"{_SEP}tests{_SEP}reliability{_SEP}",)


# bytecode-level in the files whose every bytecode may matter (dict swaps, handle removal, context exits); line
# level in the others
_OPCODES = (
    f"{_SEP}tl_steering{_SEP}backends{_SEP}lifecycle.py",
    f"{_SEP}tl_steering{_SEP}backends{_SEP}interrupts.py",
    f"{_SEP}transformer_lens{_SEP}hook_points.py",
    f"{_SEP}torch{_SEP}utils{_SEP}hooks.py",
    f"{_SEP}contextlib.py",
)


# the functions of lifecycle.py whose events are not "boundary" events: the snapshot's per-module loops (most of
# all events, and each of them equivalent for the hook state: the snapshot is only read until it is complete) and
# the orphan check every factory hook runs when it fires (it reads the hook point's dicts)
_BULK = ("_Snapshot.", "hook_points", "is_owned", "hook_state", "owned_hooks", "orphan_safe", "_drop_orphans",
         "_wraps")
_LIFECYCLE = f"{_SEP}tl_steering{_SEP}backends{_SEP}lifecycle.py"
_MODULE = f"{_SEP}torch{_SEP}nn{_SEP}modules{_SEP}module.py"


site = [""]  # where the last interrupt() delivered its SIGINT: "file:line function (event)"


# torch's own mode-stack context managers (``handle_torch_function`` enters ``_pop_mode_temporarily`` around every
# torch call while a TorchFunctionMode is active): not hook state, and not interrupt-safe in torch itself -- a
# SIGINT there is reproduced on its own by ``test_interrupts.test_ctrl_c_inside_torch_function_mode_dispatch``
_TORCH_MODE_GENS = frozenset({"_pop_mode_temporarily"})
_CM_METHODS = frozenset({"__enter__", "__exit__"})


def _gen_name(frame) -> str | None:  # noqa: ANN001
    """The generator function's name of a contextlib ``_GeneratorContextManager`` method frame."""
    if "contextlib" not in frame.f_code.co_filename:
        return None
    gen = getattr(frame.f_locals.get("self"), "gen", None)
    code = getattr(gen, "gi_code", None)
    return None if code is None else code.co_name


def _torch_mode_cm(frame) -> bool:  # noqa: ANN001
    return _gen_name(frame) in _TORCH_MODE_GENS


def interrupt_at_exit_of(fn: Callable[[], object], gen_name: str, nth: int = 1) -> bool | None:
    """Run ``fn`` with a SIGINT at the first event of the ``nth`` ``__exit__`` of a ``@contextmanager`` whose
    generator function is ``gen_name``: the window between its block's end and its exit. None when the run has
    fewer such exits; else whether a KeyboardInterrupt came out of ``fn``."""
    seen = [0]

    def tracer(frame, event, arg):  # noqa: ANN001
        if event == "call" and frame.f_code.co_name == "__exit__" and _gen_name(frame) == gen_name:
            seen[0] += 1
            if seen[0] == nth:
                sys.settrace(None)
                signal.raise_signal(signal.SIGINT)
        return None

    old = sys.gettrace()
    try:
        sys.settrace(tracer)
        try:
            fn()
        finally:
            sys.settrace(old)
    except KeyboardInterrupt:
        return True
    return None if seen[0] < nth else False


def _kind(code) -> int:  # noqa: ANN001 - a code object
    """0: not traced; 1: line events; 2: bytecode events; 3: bytecode events that are "boundary" events (the
    bytecode-traced files -- scope entry / exit, handle removal, dict swaps, the SIGINT handler's registry --
    except the snapshot loops of lifecycle.py).

    torch's module iterators (``parameters()``, ``named_modules()``... generators) are not traced: they change no
    hook state, and a suspended one is finalized whenever the garbage collector gets to it, so its events would
    make the event count of a call vary between runs (and an interrupt delivered inside a finalizer is dropped by
    Python: "Exception ignored in ...")."""
    fn = code.co_filename
    if not any(s in fn for s in _TRACED) or any(s in fn for s in _SKIP):
        return 0
    if _MODULE in fn and code.co_flags & inspect.CO_GENERATOR:
        return 0
    if not any(s in fn for s in _OPCODES):
        return 1
    if _LIFECYCLE in fn and getattr(code, "co_qualname", code.co_name).startswith(_BULK):
        return 2
    return 3


#: the files of torch's autodiff transforms (functorch's eager transforms, vmap and interpreter stack, forward AD)
#: and contextlib (their generator context managers): ``kind=autodiff_kind`` counts every bytecode there, to deliver
#: a signal at any moment inside a ``torch.func`` transform (tests/reliability/test_autodiff_interrupts.py)
_AUTODIFF = (
    f"{_SEP}torch{_SEP}_functorch{_SEP}",
    f"{_SEP}torch{_SEP}autograd{_SEP}forward_ad.py",
    f"{_SEP}contextlib.py",
)


def autodiff_kind(code) -> int:  # noqa: ANN001 - a code object
    """A :func:`_kind` for ``kind=``: bytecode events in torch's autodiff transforms and contextlib, nothing else."""
    fn = code.co_filename
    return 2 if any(s in fn for s in _AUTODIFF) else 0


_GRAD_MODE = f"{_SEP}torch{_SEP}autograd{_SEP}grad_mode.py"


def grad_mode_kind(code) -> int:  # noqa: ANN001 - a code object
    """A :func:`_kind` for ``kind=``: bytecode events in torch's grad-mode switches (``torch.no_grad()``,
    ``torch.enable_grad()``, ``torch.set_grad_enabled``: their entries and exits), nothing else."""
    return 2 if _GRAD_MODE in code.co_filename else 0


class _Counter:
    def __init__(self, at: int | None, marks: list[int] | None = None, sig: int = signal.SIGINT,
                 kind: Callable = _kind):
        self.exits: list[int] = []  # with marks: the indices of the "call" events of boundary ``__exit__``s
        self.n = 0
        self.at = at
        self.sig = sig
        self.fired = False
        self.marks = marks  # when a list: the indices of the boundary events are appended
        self._kind: dict[object, int] = {}
        self._kind_of = kind

    def local(self, frame, event, arg):  # noqa: ANN001 - sys.settrace protocol
        self.n += 1
        if self.at is not None and self.n == self.at and not self.fired:
            self.fired = True
            code = frame.f_code
            site[0] = (f"{os.path.basename(code.co_filename)}:{frame.f_lineno} "
                       f"{getattr(code, 'co_qualname', code.co_name)} ({event})")
            sys.settrace(None)
            signal.raise_signal(self.sig)  # the handler runs here (and may raise)
        return self.local

    def marked(self, frame, event, arg):  # noqa: ANN001
        self.n += 1
        self.marks.append(self.n)
        return self.marked

    def call(self, frame, event, arg):  # noqa: ANN001
        code = frame.f_code
        kind = self._kind.get(code)
        if kind is None:
            kind = self._kind[code] = self._kind_of(code)
        if not kind or (code.co_name in _CM_METHODS and _torch_mode_cm(frame)):
            return None
        frame.f_trace_opcodes = kind >= 2
        if self.marks is not None and kind == 3:
            if code.co_name == "__exit__":
                self.exits.append(self.n + 1)
            return self.marked(frame, event, arg)
        return self.local(frame, event, arg)


def _run(fn: Callable[[], object], at: int | None, marks: list[int] | None = None, sig: int = signal.SIGINT,
         exc: type[BaseException] = KeyboardInterrupt, kind: Callable = _kind) -> tuple[_Counter, bool]:
    c = _Counter(at, marks, sig, kind)
    old = sys.gettrace()
    interrupted = False
    try:
        sys.settrace(c.call)
        try:
            fn()
        finally:
            sys.settrace(old)
    except exc:
        interrupted = True
    return c, interrupted


def count(fn: Callable[[], object], kind: Callable = _kind) -> int:
    """Number of traced events of one clean run of ``fn`` (``kind``: which frames are traced, see :func:`_kind`)."""
    c, interrupted = _run(fn, None, kind=kind)
    if interrupted:
        raise RuntimeError("the counting run was interrupted")
    return c.n


class Profile(NamedTuple):
    n: int  # traced events of the run
    boundary: list[int]  # indices of its boundary events
    exits: list[int]  # indices of the first event of every ``__exit__`` among them: a signal there lands in the
    # window between a ``with`` block's end and its exit's first bytecode, which no try/finally can cover


def profile(fn: Callable[[], object]) -> Profile:
    """The events of one clean run of ``fn`` (see :class:`Profile`)."""
    marks: list[int] = []
    c, interrupted = _run(fn, None, marks)
    if interrupted:
        raise RuntimeError("the profiling run was interrupted")
    return Profile(c.n, marks, c.exits)


def interrupt(fn: Callable[[], object], at: int, sig: int = signal.SIGINT,
              exc: type[BaseException] = KeyboardInterrupt, kind: Callable = _kind) -> bool:
    """Run ``fn`` with signal ``sig`` (SIGINT) delivered at traced event ``at`` (1-based); True when an ``exc``
    (KeyboardInterrupt; for another signal, what its installed handler raises) came out of it. False: the run
    ended first, or the exception was raised where Python drops it (a finalizer). ``site[0]`` then says where the
    signal was delivered."""
    site[0] = "(not reached)"
    _, interrupted = _run(fn, at, sig=sig, exc=exc, kind=kind)
    return interrupted
