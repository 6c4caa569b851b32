"""Hooks of ours on a model's modules, which the guards of :mod:`.lifecycle` remove (docs/hooks.md, "Interrupts"):
hooks kept last on their point, one-shot captures, the orphan-safe wrapper, the probe's meta-device check."""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from transformer_lens.hook_points import HookPoint

from .. import validation
from .hookbase import drop_hook, mark_owned, wraps_any


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


__all__ = ["add_hook_last", "capture_input_once", "capture_output_once", "capture_site", "orphan_safe",
           "refuse_meta_inputs"]
