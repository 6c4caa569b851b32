"""One caller per model at a time: :func:`exclusive` and the guards claim the model for their thread. See
docs/hooks.md, "One caller per model" and "The user's own hooks"."""

import functools
import inspect
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from . import interrupts as _interrupts
from .hookbase import _SILENCED, hook_points, intervention_of, is_ours
from ..errors import ModelBusyError

F = TypeVar("F", bound=Callable[..., Any])

_lock = threading.RLock()  # re-entrant: the signal handler may release a claim while its thread holds the lock
_claims: "weakref.WeakKeyDictionary[Any, _Claim]" = weakref.WeakKeyDictionary()


class _Claim:
    """Who holds a model: the thread, the call, since when, and the user's hook points at entry."""

    __slots__ = ("thread", "call", "since", "user_hooks")

    def __init__(self, call: str, user_hooks: tuple[str, ...]):
        self.thread = threading.current_thread()
        self.call = call
        self.since = time.monotonic()
        # the user's hook points at the entry of the outermost call, then of each nested call that records them
        # (a protocol inside a probe sees the hooks the user added after the probe opened)
        self.user_hooks: list[tuple[str, ...]] = [user_hooks]

    def describe(self) -> str:
        return (f"{self.call} on thread {self.thread.name!r} (ident {self.thread.ident}), running for "
                f"{time.monotonic() - self.since:.1f} s")


class _Token:
    """One outermost claim, registered with the interrupt registry: ``restore`` releases it (idempotent), and after an
    interrupt puts autograd back as at entry (docs/hooks.md, "Interrupts")."""

    __slots__ = ("model", "claim", "interrupted", "grad")

    def __init__(self, model: Any):
        self.model = model
        self.claim: _Claim | None = None
        self.interrupted = False
        self.grad = torch.is_grad_enabled()

    def restore(self) -> None:
        if self.interrupted:
            torch.set_grad_enabled(self.grad)
        claim = self.claim
        if claim is None:
            return
        with _lock:
            if _claims.get(self.model) is claim:
                del _claims[self.model]


def _key(model: Any) -> Any:
    """The object claims are keyed by: the TransformerLens model behind an adapter."""
    return model.model if type(model).__name__ == "ModelAdapter" else model


def _busy(model: Any, call: str, cur: _Claim) -> ModelBusyError:
    return ModelBusyError(
        f"{call}: this {type(model).__name__} is in use by {cur.describe()}. tl_steering runs one call per model at "
        "a time (a call adds hooks to the model and reads them back; two at once would measure each other's "
        "hooks). Wait for that call to return (join its thread), or give each thread its own model (load it "
        "again, or copy.deepcopy(model)).")


class claim:  # noqa: N801 - used like a function: ``with claim(model, "name"):``
    """Hold ``model`` for this thread while the block runs (re-entrant); :class:`ModelBusyError` when another live
    thread holds it (docs/hooks.md, "One caller per model"). ``record_hooks``: record the user's hook points at
    entry of an outermost claim; ``refresh``: record them again when nested (a public call inside a probe)."""

    __slots__ = ("model", "call", "record_hooks", "refresh", "_token", "_nested")

    def __init__(self, model: Any, call: str, record_hooks: bool = True, refresh: bool = False):
        self.model = _key(model)
        self.call = call
        self.record_hooks = record_hooks
        self.refresh = refresh
        self._token: _Token | None = None
        self._nested: tuple[_Claim, tuple[str, ...]] | None = None

    def __enter__(self) -> "claim":
        model = self.model
        cur = _claims.get(model)
        me = threading.current_thread()
        if cur is not None and cur.thread is me:  # re-entrant: the outer call's claim covers this one
            if self.refresh:  # a nested public call: the user's hooks as they are now (e.g. added inside a probe)
                hooks = user_hook_points(model)
                cur.user_hooks.append(hooks)
                self._nested = (cur, hooks)
            return self
        if cur is not None and cur.thread.is_alive():
            raise _busy(model, self.call, cur)
        hooks = user_hook_points(model) if self.record_hooks else ()
        token = _Token(model)
        _interrupts.register(token)  # before the claim is recorded: a Ctrl-C from here on releases it
        try:
            with _lock:
                cur = _claims.get(model)
                if cur is not None and cur.thread is not me and cur.thread.is_alive():
                    raise _busy(model, self.call, cur)
                token.claim = _Claim(self.call, hooks)  # before the store: a restore finds what to release
                _claims[model] = token.claim
        except BaseException:
            token.restore()
            _interrupts.unregister(token)
            raise
        self._token = token
        return self

    def __exit__(self, *exc: Any) -> None:
        nested, self._nested = self._nested, None
        if nested is not None:
            stack = nested[0].user_hooks
            if len(stack) > 1 and stack[-1] is nested[1]:
                stack.pop()
        token, self._token = self._token, None
        if token is not None:
            try:
                token.restore()
            finally:
                _interrupts.unregister(token)
        return None


def exclusive(fn: F) -> F:
    """Decorate a public entry point that takes a model: the call holds it for its thread (:class:`claim`)."""
    params = list(inspect.signature(fn).parameters)  # the model: the parameter named ``model``, else the first one
    arg = "model" if "model" in params else (params[0] if params else None)
    index = params.index(arg) if arg is not None else None
    name = f"tl_steering.{fn.__name__}"

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        model = kwargs.get(arg, args[index] if index is not None and index < len(args) else None)
        if model is None or not hasattr(_key(model), "modules"):  # not a model: the call's own checks say so
            return fn(*args, **kwargs)
        with claim(model, name, refresh=True):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def named_hook_points(model: Any, hook_dict: Any = None) -> dict[Any, tuple[str, ...]]:
    """Each hook point of ``model`` once, with every name it has in ``model.hook_dict`` (a bridge's legacy aliases
    included); ``hook_dict``: a snapshot of it the caller took already (a bridge rebuilds it on every access). One
    dict, not a pair per point: a probe keeps it for its whole block (tracked objects: see lifecycle._Snapshot)."""
    named = getattr(model, "hook_dict", None) if hook_dict is None else hook_dict
    if not isinstance(named, dict) or not named:
        return {hp: (str(getattr(hp, "name", "?")),) for hp in hook_points(model)}
    out: dict[Any, tuple[str, ...]] = {}
    for name, hp in named.items():
        out[hp] = (*out[hp], name) if hp in out else (name,)
    return out


def hooks_among(points: dict[Any, tuple[str, ...]]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """One scan of ``points`` (from :func:`named_hook_points`): ``(user hook points, interventions)``, both sorted:
    the names of the points carrying a hook neither ours nor factory-made, and the descriptions of the factory-made
    hooks found (docs/hooks.md, "The user's own hooks, and the package's hook factories")."""
    users: list[str] = []
    found: set[str] = set()
    for hp, names in points.items():
        md = hp.__dict__  # torch keeps the hook dicts there; most points carry none
        if not any(map(md.get, _SILENCED)):
            continue
        descs = [intervention_of(f) for attr in _SILENCED for f in (md.get(attr) or {}).values() if not is_ours(f)]
        found.update(d for d in descs if d is not None)
        if None in descs:  # a hook neither ours nor factory-made: the user's
            users.extend(names)
    return tuple(sorted(users)), tuple(sorted(found))


def user_hook_points(model: Any) -> tuple[str, ...]:
    """The user hook points of :func:`hooks_among` on ``model`` now."""
    return hooks_among(named_hook_points(model))[0]


def active_interventions(model: Any) -> tuple[str, ...]:
    """The tl_steering hook factories whose hooks are on ``model`` now (their descriptions, sorted)."""
    return hooks_among(named_hook_points(_key(model)))[1]


def active_user_hooks(model: Any) -> tuple[str, ...]:
    """The user's hook points for a result's provenance: those recorded when this thread's call claimed the model
    (before any hook of ours), else the ones on the model now."""
    c = _claims.get(_key(model))
    if c is not None and c.thread is threading.current_thread():
        return c.user_hooks[-1]
    return user_hook_points(_key(model))


__all__ = ["active_interventions", "active_user_hooks", "claim", "exclusive", "hooks_among",
           "named_hook_points", "user_hook_points"]
