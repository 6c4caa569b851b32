"""Assertions shared by test modules (import as ``from tests.helpers import ...``)."""

from transformer_lens.hook_points import HookPoint


def hook_count(model) -> int:
    """Every hook on every HookPoint: TL's bookkeeping (fwd/bwd) and torch's own hook dicts."""
    n = 0
    for hp in {id(m): m for m in model.modules() if isinstance(m, HookPoint)}.values():
        n += len(hp.fwd_hooks) + len(hp.bwd_hooks)
        n += len(hp._forward_hooks) + len(hp._forward_pre_hooks) + len(hp._backward_hooks)
    return n


def assert_no_hooks(model) -> None:
    """Every HookPoint is back to no hooks at all (TL bookkeeping and torch's own dicts)."""
    for name, hp in model.named_modules():
        if isinstance(hp, HookPoint):
            assert not hp.fwd_hooks and not hp.bwd_hooks, f"{name} kept TL hooks"
            assert len(hp._forward_hooks) == 0 and len(hp._forward_pre_hooks) == 0, f"{name} kept torch hooks"


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
