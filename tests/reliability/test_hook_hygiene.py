"""Hook hygiene under faults: every public call, with an exception or a KeyboardInterrupt injected inside a
forward pass, leaves no hook of ours, keeps the user's permanent hooks, and leaves the weights bit-identical.

"No hook of ours" is checked on every module (torch's own hook dicts, not only TransformerLens's handle lists)
against the hook state after one clean forward: TransformerBridge and transformers wire capture hooks of their
own on a first forward, so the baseline is never "zero hooks"."""

import pytest

import tl_steering as ts
from tl_steering.backends import weights_fingerprint

from ._calls import FORWARD_CALLS, PUBLIC_CALLS, hook_state, owned_hooks, tokens_for


@pytest.fixture(scope="module")
def model():
    return ts.tiny_model("llama", backend="bridge", seed=0)


def _hooks(model):
    """Hook counts per hook point (bridges list a point under its alias and canonical names: count it once)."""
    seen, out = set(), {}
    for name, hp in model.hook_dict.items():
        if id(hp) in seen or not (hp.fwd_hooks or hp.bwd_hooks):
            continue
        seen.add(id(hp))
        out[name] = len(hp.fwd_hooks) + len(hp.bwd_hooks)
    return out


class Injected(Exception):
    pass


@pytest.mark.parametrize("name", FORWARD_CALLS)
@pytest.mark.parametrize("fault", [Injected, KeyboardInterrupt])
def test_fault_mid_forward_leaves_model_clean(model, name, fault):
    tokens = tokens_for(model)
    before = weights_fingerprint(model)
    calls = {"n": 0}

    def user_hook(act, hook):  # the user's own permanent hook: it raises on its 2nd call (mid-call)
        calls["n"] += 1
        if calls["n"] == 2:
            raise fault("injected")
        return act

    model(tokens)  # TL/transformers wire their own lazy hooks on a first forward: part of the baseline
    model.add_hook("blocks.1.hook_resid_pre", user_hook, is_permanent=True)
    baseline = hook_state(model)
    try:
        with pytest.raises(fault):
            # run twice so the fault lands inside the public call even when it runs a single forward
            PUBLIC_CALLS[name](model, tokens)
            PUBLIC_CALLS[name](model, tokens)
        assert list(_hooks(model).values()) == [1], "our hooks must be gone, the user's kept"
        assert owned_hooks(model) == [] and hook_state(model) == baseline
        assert model.hook_dict["blocks.1.hook_resid_pre"].fwd_hooks[0].is_permanent
        assert weights_fingerprint(model) == before
        assert model.cfg.use_hook_mlp_in in (False, None) or model.cfg.use_hook_mlp_in is False
    finally:
        model.reset_hooks(including_permanent=True)
    assert _hooks(model) == {}


@pytest.mark.parametrize("name", list(PUBLIC_CALLS))
def test_clean_call_leaves_no_hooks_and_same_weights(model, name):
    tokens = tokens_for(model)
    before = weights_fingerprint(model)
    model(tokens)
    baseline = hook_state(model)  # after one clean forward (never "zero hooks", see the module docstring)
    PUBLIC_CALLS[name](model, tokens)
    assert _hooks(model) == {}
    assert owned_hooks(model) == [] and hook_state(model) == baseline
    assert weights_fingerprint(model) == before
    assert all(p.grad is None for p in model.parameters())
