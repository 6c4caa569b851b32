"""The tags and hook-dict vocabulary shared by :mod:`.lifecycle`, :mod:`.captures` and :mod:`.ownership`
(docs/hooks.md): which torch dicts hold hooks, how a hook of ours is tagged and recognised, :func:`shielded`."""

from collections.abc import Callable
from typing import Any

import torch

from transformer_lens.hook_points import HookPoint

# torch's per-module hook dicts (attribute names of torch.nn.Module); the *_with_kwargs / *_always_called
# dicts are keyed like their main dict and only hold flags
_FLAG_DICTS = {
    "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
    "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
    "_backward_hooks": (),
    "_backward_pre_hooks": (),
}
_HOOK_DICTS = tuple(_FLAG_DICTS)
_SILENCED = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")
_OWNED_ATTR = "_tl_steering_owned"
_INTERVENTION_ATTR = "_tl_steering_intervention"


def modules_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``list(model.modules())`` (same modules, same order) without building every dotted name; walked anew on
    each call, so a replaced submodule is never missed."""
    out: list[torch.nn.Module] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        children = [c for c in m._modules.values() if c is not None]
        children.reverse()
        stack.extend(children)
    return out


def hook_points(model: torch.nn.Module) -> list[HookPoint]:
    """Every TransformerLens HookPoint inside ``model`` (a whole model or one block)."""
    return [m for m in modules_of(model) if isinstance(m, HookPoint)]


def drop_hook(module: torch.nn.Module, attr: str, key: Any) -> None:
    """Remove entry ``key`` from ``module``'s torch hook dict ``attr`` and from its flag dicts."""
    for a in (attr, *_FLAG_DICTS[attr]):
        d = getattr(module, a, None)
        if d is not None:
            d.pop(key, None)


def _tag(fn: Callable, attr: str, value: Any) -> Callable:
    """``fn`` itself with ``attr`` set to ``value`` (no wrapper: it stays on a hot path), or a tagged wrapper when
    ``fn`` takes no attribute."""
    try:
        setattr(fn, attr, value)
        return fn
    except (AttributeError, TypeError):
        def hook(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        setattr(hook, attr, value)
        hook.__name__ = f"tl_steering:{getattr(fn, '__name__', 'hook')}"
        return hook


def is_owned(fn: Any) -> bool:
    return bool(getattr(fn, _OWNED_ATTR, False))


def mark_owned(fn: Callable) -> Callable:
    """Tag ``fn`` as tl_steering's (:func:`_tag`): a guard removes it from any module it finds it on, and a
    user-hook scan (:mod:`.ownership`) does not count it, also through TL's ``add_hook`` wrapper (:func:`is_ours`)."""
    return _tag(fn, _OWNED_ATTR, True)


def _wrapped(f: Any) -> list[Any]:
    """Torch hook ``f`` and the functions its closure holds (TransformerLens's ``HookPoint.add_hook`` registers a
    ``full_hook`` that closes over the function it was given)."""
    out = [f]
    for cell in getattr(f, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return out


def wraps_any(f: Any, pred: Callable[[Any], bool]) -> bool:
    """Whether ``pred`` holds for torch hook ``f`` or for a function its closure holds."""
    return any(pred(g) for g in _wrapped(f))


def is_ours(f: Any) -> bool:
    """Whether torch hook ``f`` is tagged as ours, or is TransformerLens's wrapper of a function tagged as ours."""
    return wraps_any(f, is_owned)


def mark_intervention(fn: Callable, desc: str) -> Callable:
    """Tag a hook factory's hook with what it does: the user's to place (a guard keeps it), recorded as ``desc`` in a
    result's provenance (``interventions``) instead of warned about (docs/hooks.md, "The user's own hooks")."""
    return _tag(fn, _INTERVENTION_ATTR, desc)


def intervention_of(f: Any) -> str | None:
    """The description of a factory-made hook (:func:`mark_intervention`), also through TransformerLens's
    ``add_hook`` wrapper; None for any other hook."""
    descs = [getattr(g, _INTERVENTION_ATTR, None) for g in _wrapped(f)]
    return next((d for d in descs if isinstance(d, str)), None)


def shielded(restore: Callable[[], None]) -> None:
    """Run an idempotent ``restore`` to completion even if interrupts land inside it (it is retried until it
    completes, up to 20 times); then re-raise the first interrupt."""
    pending: BaseException | None = None
    for _ in range(20):
        try:
            restore()
            break
        except BaseException as e:  # noqa: BLE001 - deferred, re-raised below
            if pending is None:
                pending = e
    if pending is not None:
        raise pending


__all__ = ["drop_hook", "hook_points", "intervention_of", "is_ours", "is_owned", "mark_intervention", "mark_owned",
           "modules_of", "shielded", "wraps_any"]
