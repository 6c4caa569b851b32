"""Which torch dicts hold hooks, how a hook of ours is tagged and recognised, :func:`shielded`, and the hooks of ours
that the guards of :mod:`.lifecycle` remove: kept last, one-shot captures, orphan-safe (docs/hooks.md, "Interrupts")."""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from transformer_lens.hook_points import HookPoint

from .. import validation

# torch's per-module hook dicts (attribute names of torch.nn.Module); the *_with_kwargs / *_always_called
# dicts are keyed like their main dict and only hold flags
_FLAG_DICTS = {
    "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
    "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
    "_backward_hooks": (),
    "_backward_pre_hooks": ()}
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
    pop, push, add, append = stack.pop, stack.extend, seen.add, out.append
    while stack:
        m = pop()
        if id(m) in seen:
            continue
        add(id(m))
        append(m)
        if m._modules:  # most modules (every HookPoint) are leaves
            push(reversed([c for c in m._modules.values() if c is not None]))
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


def add_hook_last(model: Any, name: str, fn: Callable, hook_dict: Any = None) -> list[Any]:
    """Add ``fn`` at hook point ``name`` (TransformerLens API) so that it always runs after every other hook
    of that point, also hooks added later (e.g. by ``run_with_hooks`` inside a probe). Returns the torch handles
    to remove (the TL handle is removed by a guard or ``reset_hooks``). ``hook_dict``: a snapshot of
    ``model.hook_dict`` (a bridge rebuilds it on every access; a caller adding many hooks takes it once)."""
    hp = (model.hook_dict if hook_dict is None else hook_dict)[name]
    before = {id(h) for h in hp.fwd_hooks}
    model.add_hook(name, mark_owned(fn))
    hook_ids = [h.hook.id for h in hp.fwd_hooks if id(h) not in before and hasattr(h, "hook")]

    def last(module: Any, args: Any, hook_ids: list = hook_ids) -> None:
        hooks = module._forward_hooks  # an OrderedDict
        for i in hook_ids:
            if i in hooks:
                hooks.move_to_end(i)

    return [hp.register_forward_pre_hook(mark_owned(last))]


def _drop_orphans(hp: HookPoint, fn: Callable) -> bool:
    """Remove from ``hp``'s torch forward hooks every wrapper of ``fn`` that TransformerLens does not list in
    ``hp.fwd_hooks``; True when there was one."""
    d = hp._forward_hooks
    listed = {getattr(getattr(h, "hook", None), "id", None) for h in hp.fwd_hooks}
    orphans = [k for k, f in list(d.items()) if k not in listed and wraps_any(f, lambda g: g is fn)]
    for k in orphans:
        drop_hook(hp, "_forward_hooks", k)
    return bool(orphans)


def orphan_safe(fn: Callable) -> Callable:
    """Wrap a hook factory's ``fn(act, hook)`` so that a copy of it that TransformerLens lost track of (docs/hooks.md,
    "Interrupts") removes itself at its first firing and leaves the activation unchanged (the oldest copy fires
    first; torch runs a forward's hooks from a snapshot of the dict, so every listed copy still runs)."""

    def hook_fn(act: Any, hook: Any) -> Any:
        hp = getattr(hook, "_target", hook)  # TransformerLens's _AliasedHookPoint delegates to the point
        if isinstance(hp, HookPoint) and _drop_orphans(hp, hook_fn):
            return None
        return fn(act, hook)

    hook_fn.__name__ = getattr(fn, "__name__", "hook")
    hook_fn.__qualname__ = getattr(fn, "__qualname__", hook_fn.__name__)
    hook_fn.__wrapped__ = fn  # type: ignore[attr-defined]
    return hook_fn


def _detach(module: torch.nn.Module, attr: str, fn: Callable) -> None:
    """Remove every entry of ``fn`` from ``module``'s torch hook dict ``attr`` (and its flag dicts)."""
    for k in [k for k, f in list((getattr(module, attr, None) or {}).items()) if f is fn]:
        drop_hook(module, attr, k)


def capture_input_once(module: torch.nn.Module, store: Callable[[Tensor], None]) -> Any:
    """Register a one-shot forward-pre-hook on ``module`` that hands its first tensor input to ``store`` and removes
    itself by identity (so one left by a Ctrl-C outside any guard still does); tagged as ours."""

    def grab(mod: Any, args: tuple, kwargs: dict) -> None:
        _detach(mod, "_forward_pre_hooks", tagged)
        x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x", kwargs.get("input")))
        if isinstance(x, Tensor):
            store(x)

    tagged = mark_owned(grab)
    return module.register_forward_pre_hook(tagged, with_kwargs=True)


def capture_output_once(hp: torch.nn.Module, store: Callable[[Tensor], None]) -> list[Any]:
    """Register a one-shot forward hook on hook point ``hp`` that always runs after every other hook of that
    point and hands ``store`` the point's final output (the value the model goes on with). Tagged as ours; it
    removes itself (and its ordering pre-hook) by identity, as :func:`capture_input_once`."""

    def grab(mod: Any, args: Any, out: Any) -> None:
        # the ordering pre-hook first: an interrupt between the two leaves the capture, which fires once on the
        # next forward and removes itself (a pre-hook left alone removes itself too, see ``last``)
        _detach(mod, "_forward_pre_hooks", tagged_last)
        _detach(mod, "_forward_hooks", tagged)
        if isinstance(out, Tensor):
            store(out)

    def last(mod: Any, args: Any) -> None:
        hooks = mod._forward_hooks
        if not any(f is tagged for f in hooks.values()):  # its capture is gone (an interrupt inside grab)
            _detach(mod, "_forward_pre_hooks", tagged_last)
            return
        for k in [k for k, f in hooks.items() if f is tagged]:
            hooks.move_to_end(k)

    tagged, tagged_last = mark_owned(grab), mark_owned(last)
    fwd = hp.register_forward_hook(tagged)
    return [fwd, hp.register_forward_pre_hook(tagged_last)]


def capture_site(ad: Any, layer: int, site: str, store: Callable[[Tensor], None]) -> list[Any]:
    """Arm, from a hook that fires earlier in the running forward, a one-shot capture of the value block ``layer``
    really uses at ``site`` (after every hook on that point): ``"resid_pre"``, the input of ``ln1``; ``"resid_mid"``,
    the final output of the resid_mid hook point (on bridges an alias of ``ln2.hook_in``)."""
    blk = ad.model.blocks[layer]
    if site == "resid_pre":
        return [capture_input_once(blk.ln1, store)]
    if site == "resid_mid":
        return capture_output_once(ad.model.hook_dict[ad.hook_name(layer, "resid_mid")], store)
    raise ValueError(f"capture_site: site must be 'resid_pre' or 'resid_mid', got {site!r}")


def refuse_meta_inputs(model: torch.nn.Module) -> Any:
    """A forward-pre-hook of ours on the whole model refusing ``meta`` tokens with a clear
    :class:`~tl_steering.errors.DeviceMismatchError` (for the probe, whose forwards the user runs)."""

    def check(mod: Any, args: tuple, kwargs: dict) -> None:
        validation.check_not_meta(args[0] if args else kwargs.get("input", kwargs.get("tokens")))

    return model.register_forward_pre_hook(mark_owned(check), with_kwargs=True)



__all__ = ["add_hook_last", "capture_input_once", "capture_output_once", "capture_site", "drop_hook", "hook_points",
           "intervention_of", "is_ours", "is_owned", "mark_intervention", "mark_owned", "modules_of", "orphan_safe",
           "refuse_meta_inputs", "shielded", "wraps_any"]
