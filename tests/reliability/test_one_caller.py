"""One caller per model (docs/hooks.md, "One caller per model"), with two real threads.

Thread A runs a protocol inside the user's ``hooks()`` context; the user's hook (identity) blocks at its first firing
until the main thread has tried every public entry point on the same model, so the overlap is certain (events, not
timing). Every call of the main thread must raise ModelBusyError naming A's call and thread before touching the
model; A's numbers must equal a run without a second thread; no hook and no claim may be left afterwards."""

import contextlib
import threading
import warnings

import pytest
import torch

import tl_steering as ts
from tl_steering.backends import adapt, hooked_available, ownership
from tl_steering.errors import ModelBusyError, UserHooksWarning

from tests.helpers import claim_holder

from ._calls import hook_state, owned_hooks, public_calls, tokens_for

BACKENDS = ["bridge", "hooked"] if hooked_available() else ["bridge"]
USER_POINT = "blocks.0.hook_resid_pre"
CALLS = {k: v for k, v in public_calls("tiny").items() if k != "text_tokens"}  # text_tokens runs no forward
# the adapter's pure sublayer paths (no hook, but they swap the hook dicts of a block: A's hooks would vanish)
CALLS["ModelAdapter.ffn"] = lambda m, t: adapt(m).ffn(0)(torch.zeros(1, 3, int(m.cfg.d_model)))
CALLS["ModelAdapter.attention"] = lambda m, t: adapt(m).attention(0)(torch.zeros(1, 3, int(m.cfg.d_model)))
CALLS["ModelAdapter.run_blocks"] = lambda m, t: adapt(m).run_blocks(torch.zeros(1, 3, int(m.cfg.d_model)), 0)


@pytest.fixture(scope="module", params=BACKENDS)
def model(request):
    m = ts.tiny_model("gpt2", backend=request.param, seed=0, n_layers=2, d_model=32, n_heads=2, n_ctx=32)
    m(tokens_for(m))  # TL/transformers wire their own lazy hooks on a first forward: part of the baseline
    return m


@contextlib.contextmanager
def held_by_thread(model, call):
    """Run ``call()`` on a thread named 'worker-A' inside the user's ``hooks()`` context; yield once its first
    forward is in progress (the user's hook blocks there until the block ends). Yields the dict that receives
    ``result`` or ``error``."""
    inside, release, out = threading.Event(), threading.Event(), {}

    def gate(act, hook):  # the user's hook: identity; blocks A's first forward until the main thread is done
        if not inside.is_set():
            inside.set()
            release.wait(60)
        return act

    def run():
        try:
            with model.hooks(fwd_hooks=[(USER_POINT, gate)]):
                out["result"] = call()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out["error"] = e

    th = threading.Thread(target=run, name="worker-A")
    th.start()
    try:
        assert inside.wait(60), "thread A never reached its first forward"
        yield out
    finally:
        release.set()
        th.join(60)
    assert not th.is_alive()
    assert "error" not in out, f"thread A failed: {out.get('error')!r}"


def test_second_thread_gets_clear_error_first_caller_right(model):
    tokens = tokens_for(model)
    baseline = hook_state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = ts.ffn_ablation(model, tokens, n_bootstrap=20)
    busy: dict[str, str] = {}
    with held_by_thread(model, lambda: ts.ffn_ablation(model, tokens, n_bootstrap=20)) as out:
        assert claim_holder(model).call == "tl_steering.ffn_ablation"
        for name, call in CALLS.items():
            state = hook_state(model)
            with pytest.raises(ModelBusyError) as e:
                call(model, tokens)
            busy[name] = str(e.value)
            assert hook_state(model) == state, f"{name}: the refused call touched the model's hooks"
    for name, msg in busy.items():
        assert "in use by tl_steering.ffn_ablation on thread 'worker-A'" in msg, (name, msg)
        assert "one call per model at a time" in msg and "its own model" in msg, (name, msg)
    res = out["result"]
    # A's numbers are those of a run alone (its user hook is the identity), to float64 round-off
    for key, value in reference.summary().items():
        got = res.summary()[key]
        assert got == pytest.approx(value, rel=1e-12, abs=1e-15) if isinstance(value, float) else got == value, key
    assert res.provenance.user_hooks and USER_POINT in res.provenance.user_hooks
    assert reference.provenance.user_hooks == []
    assert hook_state(model) == baseline and owned_hooks(model) == []
    assert claim_holder(model) is None


def test_refused_while_a_probe_is_open_on_another_thread(model):
    tokens = tokens_for(model)
    opened, done, errors = threading.Event(), threading.Event(), []

    def user():  # the main thread holds the probe open; another thread calls a protocol meanwhile
        opened.wait(60)
        try:
            ts.angular_deficit(model, tokens, n_bootstrap=4)
        except ModelBusyError as e:
            errors.append(str(e))
        finally:
            done.set()

    th = threading.Thread(target=user, name="worker-B")
    th.start()
    with ts.probe(model, metrics="resid_norm") as trace:
        model(tokens)
        opened.set()
        assert done.wait(60)
    th.join(60)
    assert len(errors) == 1 and "in use by tl_steering.probe on thread 'MainThread'" in errors[0]
    assert trace.result().n_forwards == 1
    assert owned_hooks(model) == [] and claim_holder(model) is None


def test_reentrant_on_one_thread(model):
    tokens = tokens_for(model)
    POINT = "blocks.1.hook_resid_pre"  # a set of user hook points not warned about yet on this model
    # a protocol inside the user's hooks() context, inside a probe: one thread, three levels
    with ts.probe(model, metrics="resid_norm") as trace, warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with model.hooks(fwd_hooks=[(POINT, lambda act, hook: act)]):
            r1 = ts.angular_deficit(model, tokens, n_bootstrap=4)
            r2 = ts.angular_deficit(model, tokens, n_bootstrap=4)
    assert POINT in r1.provenance.user_hooks and r1.provenance.user_hooks == r2.provenance.user_hooks
    user = [x for x in w if issubclass(x.category, UserHooksWarning)]
    assert len(user) == 1 and POINT in str(user[0].message)  # warned once for this set of hook points
    assert len(str(user[0].message)) < 400  # one short warning: how many, a few names, how to silence it
    assert trace.result().n_forwards > 0
    assert claim_holder(model) is None and owned_hooks(model) == []
    plain = ts.angular_deficit(model, tokens, n_bootstrap=4)
    assert plain.provenance.user_hooks == []
    assert plain.summary() == r1.summary() | {k: v for k, v in plain.summary().items() if not isinstance(v, float)}


def test_claim_of_an_ended_thread_is_taken_over(model):
    def leak():  # a claim whose exit never ran (an exception injected by other means), on a thread that ends
        ownership.claim(model, "tl_steering.leaked").__enter__()

    th = threading.Thread(target=leak, name="worker-C")
    th.start()
    th.join(60)
    assert claim_holder(model) is None  # the thread ended: its claim does not count
    res = ts.angular_deficit(model, tokens_for(model), n_bootstrap=4)
    assert res.provenance.user_hooks == []
    assert claim_holder(model) is None


def test_probe_records_the_users_hooks_seen_during_its_forwards(model):
    """A steered forward inside the probe (the hooks live only for that forward) is recorded, also when
    ``result()`` is read after the hooks are gone: the package's own hook factories as interventions (no warning),
    a hook of the user's own as a user hook point (one short warning); the probe's own hooks as neither."""
    from tl_steering import hooks as H

    tokens = tokens_for(model)
    with ts.probe(model, metrics="resid_norm") as plain:
        model(tokens)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert plain.result().provenance.user_hooks == []
        assert plain.result().provenance.interventions == []
        with ts.probe(model, metrics="resid_norm") as steered:
            model.run_with_hooks(tokens, fwd_hooks=H.ffn_gate(model, {1: 0.5}))
            model.run_with_hooks(tokens, fwd_hooks=H.ffn_component(model, keep="radial", layers=[0]))
        prov = steered.result().provenance
    assert prov.user_hooks == []
    assert prov.interventions == ["ffn_component(keep='radial', layers=[0])", "ffn_gate(layers=[1])"]
    assert not [x for x in w if issubclass(x.category, UserHooksWarning)]
    point = "blocks.1.hook_mlp_out"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with ts.probe(model, metrics="resid_norm") as foreign:
            model.run_with_hooks(tokens, fwd_hooks=[(point, lambda act, hook: act * 0.5)])
        prov = foreign.result().provenance
    assert point in prov.user_hooks and prov.interventions == []
    user = [x for x in w if issubclass(x.category, UserHooksWarning)]
    assert len(user) == 1 and point in str(user[0].message) and "UserHooksWarning" in str(user[0].message)
    assert owned_hooks(model) == [] and claim_holder(model) is None
