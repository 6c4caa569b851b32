"""Assertions shared by test modules (import as ``from tests.helpers import ...``)."""

from transformer_lens.hook_points import HookPoint


def _hook_points(model):
    """(name, HookPoint) for every hook point of ``model``, each once (``named_modules`` drops aliases)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, HookPoint)]


def hook_count(model) -> int:
    """Hooks that would fire: torch's forward, forward-pre and backward hook dicts of every HookPoint."""
    return sum(len(hp._forward_hooks) + len(hp._forward_pre_hooks) + len(hp._backward_hooks)
               for _, hp in _hook_points(model))


def assert_no_hooks(model) -> None:
    """Every HookPoint is back to no hooks at all (TL bookkeeping and torch's own dicts)."""
    for name, hp in _hook_points(model):
        assert not hp.fwd_hooks and not hp.bwd_hooks, f"{name} kept TL hooks"
        assert not (hp._forward_hooks or hp._forward_pre_hooks or hp._backward_hooks), f"{name} kept torch hooks"


def claim_holder(model):
    """The live tl_steering claim on ``model`` (None when no tl_steering call is using it)."""
    from tl_steering.backends import ownership

    c = ownership._claims.get(ownership._key(model))
    return None if c is None or not c.thread.is_alive() else c


def assert_no_grads(model) -> None:
    """No weight carries a ``.grad`` (a stray ``.backward()`` on a shared session model pollutes later tests)."""
    stray = [name for name, p in model.named_parameters() if p.grad is not None]
    assert not stray, f"{len(stray)} parameters carry .grad, e.g. {stray[:2]}"


def first_output(out):
    """Hidden states of a TL component's output (bridge components may return tuples). Written here, not taken
    from the adapter, so that the tests' independent reference computations do not share its code."""
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out
