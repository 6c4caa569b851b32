"""Hook lifecycle: every hook tl_steering adds to a user's model is gone afterwards, whatever happens (docs/hooks.md,
"Interrupts")."""

import contextlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from transformer_lens.hook_points import HookPoint

from .._util import progress as _progress
from . import interrupts as _interrupts
from . import ownership as _ownership
from .. import validation
from ..errors import HookNotFoundError

from .hookbase import (_FLAG_DICTS, _HOOK_DICTS, _SILENCED, add_hook_last, capture_site, drop_hook, hook_points,
                       is_owned, modules_of, orphan_safe, refuse_meta_inputs, shielded)


_EMPTY: dict = {}  # shared read-only "no hooks" record of the snapshots (never mutated)
_NO_HOOKS: tuple = (None, _EMPTY, _EMPTY)  # (dict at entry, its copy, its flag copies) of a dict not recorded


class _Snapshot:
    """Hook state of one model (what it records, why compact: docs/hooks.md, "Interrupts"). Never mutated after
    construction, so :meth:`restore` can run any number of times, also inside itself."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        # id(HookPoint) -> i: its four hook dicts at entry are dicts[i:i + 4]. Flat, and an int-keyed dict of ints
        # (which the garbage collector does not track): a tuple per point would add ~2,500 tracked objects a call on a
        # bridge, and with them full collections (~0.3 s each) every few dozen calls
        self.at: dict[int, int] = {}
        self.dicts: list[Any] = []
        self.lists: dict[int, tuple] = {}  # id(HookPoint) -> (fwd_hooks, bwd_hooks) as tuples, where TL listed any
        # id(module) -> {attr: (dict at entry, copy, {flag attr: (flag dict, copy)})} for its non-empty dicts
        self.hooked: dict[int, dict[str, tuple]] = {}
        fw, fp, bw, bp = _HOOK_DICTS
        for m in modules_of(model):
            md = m.__dict__  # torch keeps the hook dicts there (plain attribute reads, no generator per module)
            ds = (md.get(fw), md.get(fp), md.get(bw), md.get(bp))
            if isinstance(m, HookPoint):
                self.at[id(m)] = len(self.dicts)
                self.dicts += ds
                if m.fwd_hooks or m.bwd_hooks:
                    self.lists[id(m)] = (tuple(m.fwd_hooks), tuple(m.bwd_hooks))
            if ds[0] or ds[1] or ds[2] or ds[3]:
                self.hooked[id(m)] = {
                    attr: (d, dict(d), {f: (getattr(m, f, None), dict(getattr(m, f, {}) or {}))
                                        for f in _FLAG_DICTS[attr]})
                    for attr, d in zip(_HOOK_DICTS, ds) if d}
        self.context_level = getattr(model, "context_level", None)
        self.mlp_in = getattr(getattr(model, "cfg", None), "use_hook_mlp_in", None)
        # torch's global autograd mode: an interrupt that lands inside a ``torch.no_grad()`` entry or exit (ours or
        # TransformerLens's) would otherwise leave gradients off for the whole process
        self.grad_enabled = torch.is_grad_enabled()

    def restore(self) -> None:
        """Put the state back (idempotent: calling it twice, or after a partial run, gives the same state)."""
        torch.set_grad_enabled(self.grad_enabled)
        fw, fp, bw, bp = _HOOK_DICTS
        at, dicts, lists, hooked_at = self.at, self.dicts, self.lists, self.hooked
        for m in modules_of(self.model):
            md = m.__dict__
            a, b, c, d = (md.get(fw), md.get(fp), md.get(bw), md.get(bp))
            j = at.get(id(m))
            if not (a or b or c or d) and id(m) not in hooked_at:
                # no hook then, none now (most modules): nothing to do unless a HookPoint's dict was swapped, TL
                # listed a handle at entry, or lists one now
                if j is None:  # not a HookPoint at entry: one made in the block may list a stale handle
                    if not isinstance(m, HookPoint) or not (m.fwd_hooks or m.bwd_hooks):
                        continue
                elif (a is dicts[j] and b is dicts[j + 1] and c is dicts[j + 2] and d is dicts[j + 3]
                        and id(m) not in lists and not m.fwd_hooks and not m.bwd_hooks):
                    continue
            hooked = hooked_at.get(id(m), _EMPTY)
            hp = isinstance(m, HookPoint)
            for i, attr in enumerate(_HOOK_DICTS):
                orig, before, flags = hooked.get(attr, _NO_HOOKS)
                if j is not None:
                    orig = dicts[j + i]
                if orig is not None and getattr(m, attr, None) is not orig:
                    # a dict swapped in (hooks_silenced): put the original object back, since torch's and
                    # TransformerLens's handles remove hooks from the object they were registered in
                    setattr(m, attr, orig)
                d = getattr(m, attr, None)
                if d is None or (not d and not before):  # nothing then, nothing now (most modules)
                    continue
                # drop what is new and ours: every new hook on a HookPoint (only TL's hook API and we add
                # there), tagged hooks anywhere; keep the hooks TL/transformers wire on other modules
                extra = [k for k, f in d.items() if k not in before and (hp or is_owned(f))]
                # a hook of ours that went missing is not put back: a one-shot capture that fired and removed
                # itself (also a stale one, left by an interrupted run of TransformerLens's own run_with_hooks)
                missing = [k for k, f in before.items() if k not in d and not is_owned(f)]
                if not extra and not missing:
                    continue
                for k in extra:
                    drop_hook(m, attr, k)
                if missing:  # a user's hook went missing: rebuild in the original order, kept extras last
                    rest = [(k, v) for k, v in d.items() if k not in before]
                    keep = [(k, v) for k, v in before.items() if k in d or not is_owned(v)]
                    d.clear()
                    d.update(keep)
                    d.update(rest)
                    for f, (_, saved) in flags.items():
                        fd = getattr(m, f, None)
                        if fd is not None:
                            fd.update({k: v for k, v in saved.items() if k in d})
            if hp:
                fwd, bwd = lists.get(id(m), ((), ()))
                if tuple(m.fwd_hooks) != fwd:
                    m.fwd_hooks = list(fwd)
                if tuple(m.bwd_hooks) != bwd:
                    m.bwd_hooks = list(bwd)
        if self.context_level is not None and getattr(self.model, "context_level", None) != self.context_level:
            self.model.context_level = self.context_level
        if self.mlp_in is not None and self.model.cfg.use_hook_mlp_in != self.mlp_in:
            self.model.set_use_hook_mlp_in(self.mlp_in)


class hook_guard:  # noqa: N801 - used like a function: ``with hook_guard(model): ...``
    """Remove, on exit, every hook added to ``model`` inside the block; keep (and if need be restore) the user's,
    also on an exception or a Ctrl-C at any moment; hold the model for this thread (``call`` names it in the error
    another thread gets). ``record_hooks``: see :class:`.ownership.claim`; ``interrupted``: a Ctrl-C restored the
    model while the block ran. docs/hooks.md, "Interrupts" and "One caller per model"."""

    def __init__(self, model: torch.nn.Module, call: str = "tl_steering.hook_guard", record_hooks: bool = True):
        self.model = model
        self.record_hooks = record_hooks
        self._snap: _Snapshot | None = None
        self._claim: _ownership.claim | None = None
        self.call = call
        self.interrupted = False

    def __enter__(self) -> "hook_guard":
        if self._snap is not None:
            raise RuntimeError("this hook_guard is active already; use a new one")
        # one caller per model (ownership.py): another thread's call raises ModelBusyError before anything is read
        claim = _ownership.claim(self.model, self.call, record_hooks=self.record_hooks)
        claim.__enter__()
        self._claim = claim
        try:
            self._snap = _Snapshot(self.model)
            _interrupts.register(self)
        except BaseException:
            self._snap = None
            self._release()
            raise
        return self

    def _release(self) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            claim.__exit__(None, None, None)

    def restore(self) -> None:
        """Put the model's hook state back to the snapshot taken on entry (idempotent)."""
        snap = self._snap
        if snap is not None:
            snap.restore()

    def __exit__(self, *exc: Any) -> None:
        try:
            shielded(self.restore)
        finally:
            _interrupts.unregister(self)
            self._snap = None
            self._release()
        return None


class hooks_silenced:  # noqa: N801 - used like a function: ``with hooks_silenced(block):``
    """Temporarily detach every forward/backward hook of the HookPoints inside ``module``; the original dicts (the
    objects the handles point at) are put back idempotently, also on a Ctrl-C (docs/hooks.md, "Interrupts")."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._saved: list[tuple[HookPoint, tuple]] = []

    def __enter__(self) -> "hooks_silenced":
        self._saved = [(hp, tuple(getattr(hp, a) for a in _SILENCED)) for hp in hook_points(self.module)]
        _interrupts.register(self)
        try:
            for hp, dicts in self._saved:
                for attr, d in zip(_SILENCED, dicts):
                    if d:
                        setattr(hp, attr, type(d)())
            return self
        except BaseException:
            self.__exit__()
            raise

    def restore(self) -> None:
        """Put the original dicts back (idempotent); a hook added meanwhile is kept, after the original ones."""
        for hp, dicts in self._saved:
            for attr, d in zip(_SILENCED, dicts):
                cur = getattr(hp, attr)
                if cur is not d:
                    for k, v in list(cur.items()):
                        if k not in d:
                            d[k] = v
                    setattr(hp, attr, d)

    def __exit__(self, *exc: Any) -> None:
        try:
            shielded(self.restore)
        finally:
            _interrupts.unregister(self)
            self._saved = []
        return None


def run_with_hooks(model: Any, tokens: Tensor, fwd_hooks: Sequence[tuple[Any, Callable]] = (),
                   return_type: str | None = "logits", grad: bool = False, **kwargs: Any) -> Any:
    """Forward with hooks under a guard, every hook removed afterwards, also on error or interrupt (docs/hooks.md,
    "Interrupts"). ``grad=True`` keeps autograd on (``torch.autograd.grad`` w.r.t. hooked activations; never
    ``.backward()`` on a user's model); the default runs under ``torch.no_grad()``."""
    validation.check_not_meta(tokens)
    if isinstance(tokens, Tensor) and tokens.dim() in (1, 2) and not tokens.is_floating_point():
        n_ctx = getattr(getattr(model, "cfg", None), "n_ctx", None)
        validation.check_length(int(tokens.shape[-1]), n_ctx if isinstance(n_ctx, int) else None)
    with hook_guard(model, "tl_steering run_with_hooks", record_hooks=False):  # one forward, no provenance
        tl_hooks = model.hooks(fwd_hooks=list(fwd_hooks))  # a generator context, not started: changes nothing yet
        try:
            with (torch.enable_grad() if grad else torch.no_grad()), contextlib.ExitStack() as stack:
                try:
                    stack.enter_context(tl_hooks)
                except ValueError as e:  # the bridge refuses gated hooks (hook_mlp_in with use_hook_mlp_in off)
                    if "Cannot add hook" in str(e):
                        raise HookNotFoundError(f"{e} (this hook point exists but never fires in the current "
                                                "configuration)") from e
                    raise
                out = model(tokens, return_type=return_type, **kwargs)
        finally:
            shielded(lambda: close_suspended(tl_hooks))
        drop_identity_conversions(conversion_records(hook_points(model)))
    _progress.forward_done(tokens.numel() if isinstance(tokens, Tensor) else 0)  # ticks, tokens/s (_util/progress.py)
    return out


def close_suspended(cm: Any) -> None:
    """Run now the cleanup of a generator-based context manager whose exit a Ctrl-C cut short (docs/hooks.md,
    "Interrupts"); a no-op for a generator that finished or never started, and for any other context manager."""
    gen = getattr(cm, "gen", None)
    if gen is not None and inspect.isgenerator(gen) and inspect.getgeneratorstate(gen) == inspect.GEN_SUSPENDED:
        gen.close()


def conversion_records(points: Iterable[HookPoint]) -> list[dict]:
    """TransformerLens's per-tensor conversion records on a model's hook ``points`` (a bridge's attention hook
    points keep one per converted tensor and never drop it: docs/probe.md). Empty for a HookedTransformer."""
    out: dict[int, dict] = {}
    for hp in points:
        state = getattr(getattr(hp, "hook_conversion", None), "_conversion_state", None)
        if isinstance(state, dict):
            out[id(state)] = state
    return list(out.values())


def drop_identity_conversions(records: Sequence[dict]) -> None:
    """Drop the records of tensors that TransformerLens passed through unchanged (``"no_change"``; safe at any
    moment: docs/probe.md); records of real conversions are kept."""
    for state in records:
        stale = [k for k, v in state.items() if isinstance(v, dict) and v.get("conversion_type") == "no_change"]
        for k in stale:
            state.pop(k, None)


__all__ = ["add_hook_last", "capture_site", "conversion_records", "drop_identity_conversions", "hook_guard",
           "hook_points", "hooks_silenced", "orphan_safe", "refuse_meta_inputs", "run_with_hooks", "shielded"]
