"""Interrupt stress: every public call on a tiny model, interrupted by a real SIGINT (Ctrl-C) at seeded random
points, leaves the model exactly as it was (docs/hooks.md, "Interrupts").

The interrupts are deterministic (``tests/reliability/_inject.py``): a clean traced run counts the bytecode / line
events of the files that decide a model's hook state, then each run delivers a SIGINT with ``signal.raise_signal``
at one chosen event -- the first and last few events, events drawn uniformly over the whole call, events drawn
among the "boundary" events (scope entry / exit, handle removal, the handler's registry), and first events of an
``__exit__`` (the window between a ``with`` block's end and its exit, which no try/finally covers). A failure names
its call, event index and source line, and replays exactly.

After each interrupted run: the user's permanent hook (on ``blocks.1.hook_resid_post``) fires exactly once per clean
forward; no hook of ours is attached to any module (torch's own hook dicts included); the hook state equals the
baseline taken after one clean run of every call (TransformerBridge/transformers wire capture hooks of their own on
a first forward: never "zero hooks"); autograd is on and no torch function mode is left pushed; the weights are
unchanged; no scope of ours is registered and our signal handler is uninstalled (Python's own is back).

Bounded: 15 calls (every public call that runs a forward and TransformerLens's own ``run_with_hooks`` with our
factories) x 16 interrupts (3 first + 3 last + 4 uniform + 3 boundary + 3 exits), on a 2-layer d_model=32 model
with the smallest settings (``public_calls("tiny")``): about 25 s on TL 4.3, 40 s on TL 3.9 (loaded 2-core machine).
Also here: a KeyboardInterrupt raised by the user's own hook inside each call; the hooks that TransformerLens loses
when a Ctrl-C lands inside its ``HookPoint.add_hook`` (they remove themselves, ``lifecycle.orphan_safe``); a stale
one-shot capture (removed, not put back); a SIGALRM handler that raises, at scope exits; and, as a strict xfail, a
known leak outside the hook lifecycle (torch function mode dispatch inside ``critical_points``).

No random-delay timer variant (the issue's repro): where it lands cannot be chosen or replayed, and whether it lands
inside short calls at all depends on the machine's load (it missed 5 of 8 in ``parallel_defect`` on a loaded 2-core
machine); every point it could hit is an event counted here, and the SIGALRM test delivers it deterministically.
"""

import gc
import signal
import threading
import zlib

import numpy as np
import pytest
import torch

import tl_steering as ts
from tl_steering import hooks as H
from tl_steering.backends import adapt, interrupts, weights_fingerprint
from tl_steering.backends.lifecycle import capture_site

from tests.helpers import claim_holder
from tests.reliability import _inject
from tests.reliability._calls import handler_installed, hook_state, owned_hooks, public_calls

SEED = 16
N_ENDS = 3  # the first and the last N_ENDS events of every call
N_UNIFORM = 4  # events drawn over the whole call (one per equal stratum)
N_BOUNDARY = 3  # events drawn among the boundary events (one per equal stratum of them)
N_EXITS = 3  # first events of an __exit__ (the window between a block's end and its exit), one per stratum
N_HOOK_RAISES = 3  # KeyboardInterrupts raised by the user's hook per call: first firing, last, one drawn between
N_ALARMS = 5  # SIGALRMs per call of ALARM_CALLS, at exits' first events
MIN_LANDED = 0.8  # of the injected interrupts, the share that must come out as KeyboardInterrupt


def _tl_run_with_hooks(m, t):
    # TransformerLens's own run_with_hooks with our factories (TL's hooks() context, not a guard of ours)
    return m.run_with_hooks(t, fwd_hooks=H.parallel_blocks(m, [0, 1]) + H.ffn_component(m, "tangential"))


CALLS = {k: v for k, v in public_calls("tiny").items() if k != "text_tokens"}  # text_tokens runs no forward
TL_RUN = "transformer_lens.run_with_hooks"
ALL_CALLS = {**CALLS, TL_RUN: _tl_run_with_hooks}


class _Model:
    """The tiny model with the user's permanent hook, the baseline after a clean run of every call, and counters."""

    def __init__(self):
        self.m = ts.tiny_model("gpt2", backend="bridge", seed=0, n_layers=2, d_model=32, n_heads=2, n_ctx=32)
        self.tokens = torch.randint(1, 257, (2, 10), generator=torch.Generator().manual_seed(0))
        self.fired = 0
        self.raise_at: int | None = None  # the user's hook raises KeyboardInterrupt on this firing
        self.m.add_hook("blocks.1.hook_resid_post", self._user_hook, is_permanent=True)
        for call in ALL_CALLS.values():  # TL/transformers wire their own lazy hooks: part of the baseline
            call(self.m, self.tokens)
        self.m(self.tokens)
        self.baseline = hook_state(self.m)
        self.weights = weights_fingerprint(self.m)
        self.sigint = signal.getsignal(signal.SIGINT)
        self.stats: dict[str, tuple[int, int]] = {}

    def _user_hook(self, act, hook):
        self.fired += 1
        if self.raise_at is not None and self.fired == self.raise_at:
            self.raise_at = None
            raise KeyboardInterrupt("raised by the user's hook")

    def fn(self, name):
        call, m, t = ALL_CALLS[name], self.m, self.tokens
        return lambda: call(m, t)

    def check_clean(self, where):
        m = self.m
        assert interrupts.registered() == 0, f"{where}: a scope of ours is still registered"
        assert claim_holder(m) is None, f"{where}: the model is still claimed by {claim_holder(m).call}"
        assert not handler_installed(), f"{where}: our signal handler is still installed"
        assert signal.getsignal(signal.SIGINT) is self.sigint, f"{where}: the SIGINT handler was not put back"
        assert torch.is_grad_enabled(), f"{where}: autograd was left switched off for the process"
        assert torch._C._len_torch_function_stack() == 0, f"{where}: a torch function mode was left pushed"
        assert owned_hooks(m) == [], f"{where}: a hook of ours stayed attached: {owned_hooks(m)}"
        assert hook_state(m) == self.baseline, f"{where}: the hook state differs from the clean baseline"
        n = self.fired
        m(self.tokens)
        assert self.fired == n + 1, f"{where}: the user's permanent hook fired {self.fired - n} times, not once"
        assert weights_fingerprint(m) == self.weights, f"{where}: the weights changed"
        assert m.cfg.use_hook_mlp_in in (False, None)


@pytest.fixture(scope="module", autouse=True)
def _python_sigint_handler():
    """These tests deliver SIGINT and expect Python's own handler (KeyboardInterrupt). A process started in the
    background by a non-interactive shell (``cmd &``) inherits SIGINT ignored (POSIX), and Python then installs no
    handler: set it for this module, put the inherited one back after."""
    old = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture(scope="module")
def _state():
    if threading.current_thread() is not threading.main_thread():  # pragma: no cover - pytest runs tests there
        pytest.fail("signals are delivered to the main thread only: run this file there")
    state = _Model()
    yield state
    state.m.reset_hooks(including_permanent=True)
    landed = sum(a for a, _ in state.stats.values())
    total = sum(b for _, b in state.stats.values())
    print(f"\ninterrupt stress: {landed} of {total} injected interrupts landed over {len(state.stats)} calls")


@pytest.fixture
def model(_state):
    yield _state
    if hook_state(_state.m) != _state.baseline or owned_hooks(_state.m) or interrupts.registered():
        # a failed test left the shared model dirty: start the next test on a fresh one (no cascade of failures)
        stats = _state.stats
        interrupts._registry().clear()  # a stale scope would be restored by the next Ctrl-C
        interrupts._uninstall()
        _state.__init__()
        _state.stats = stats


def _strata(idx: list[int], k: int, rng: np.random.Generator) -> set[int]:
    """One draw from each of ``k`` equal consecutive chunks of ``idx``."""
    if not idx:
        return set()
    return {int(rng.choice(c)) for c in np.array_split(np.asarray(idx), min(k, len(idx)))}


def _points(prof: _inject.Profile, rng: np.random.Generator) -> list[int]:
    """Event indices to interrupt at (1-based): the first and last N_ENDS, one uniform draw in each of N_UNIFORM
    equal strata of [1, n], and stratified draws among the boundary events and among the exits' first events."""
    n = prof.n
    pts = set(range(1, N_ENDS + 1)) | set(range(n - N_ENDS + 1, n + 1))
    edges = np.linspace(1, n + 1, N_UNIFORM + 1).astype(int)
    pts |= {int(rng.integers(lo, max(hi, lo + 1))) for lo, hi in zip(edges[:-1], edges[1:])}
    pts |= _strata(prof.boundary, N_BOUNDARY, rng) | _strata(prof.exits, N_EXITS, rng)
    return sorted(p for p in pts if 1 <= p <= n)


def _rng(name: str, salt: int = 0) -> np.random.Generator:
    return np.random.default_rng([SEED, salt, zlib.crc32(name.encode())])


@pytest.mark.parametrize("name", list(ALL_CALLS))
def test_sigint_at_random_points_leaves_model_clean(model, name):
    fn = model.fn(name)
    fn()  # warm: the bridge rebuilds lazy caches (block aliases) after another call changed the model
    handler = signal.getsignal(signal.SIGINT)  # a handler left by an earlier test would swallow every SIGINT
    assert handler is signal.default_int_handler, f"{name}: SIGINT handler on entry is {handler!r}, not Python's"
    prof = _inject.profile(fn)
    n = prof.n
    assert n > 100 and prof.boundary and prof.exits, f"{name}: {prof.n} events, {len(prof.exits)} exits"
    model.check_clean(f"{name}, after the profiling run")
    pts = _points(prof, _rng(name))
    landed, missed = 0, []
    for k in pts:
        hit = _inject.interrupt(fn, k)
        if not hit and _inject.site[0] == "(not reached)" and (now := _inject.count(fn)) < n:
            # a run shorter than the profiled one (seen on TL 3.9 at torch's default threads: a few hundred to a few
            # thousand events fewer, from run to run): the point at the same distance from the end of a run
            k = k - (n - now)
            hit = _inject.interrupt(fn, k)
        landed += hit
        where = f"{name}, SIGINT at event {k} of {n} in {_inject.site[0]}"
        if not hit:
            missed.append(where)
        if name == TL_RUN:
            # TransformerLens's hooks() context is not ours: an interrupt in its add / remove bookkeeping may
            # leave TL's (non-permanent) hook handles behind, which the user clears with reset_hooks(). Every
            # hook of ours must go: the one-shot captures a factory hook arms fire on the next forward and
            # remove themselves, and a plain forward must run (not raise "did not fire")
            model.m.reset_hooks()
            model.m(model.tokens)
        model.check_clean(where)
    model.stats[name] = (landed, len(pts))
    print(f"\n{name}: {landed} of {len(pts)} landed; missed: {missed}")
    assert len(pts) >= 2 * N_ENDS + N_UNIFORM + N_EXITS
    assert landed >= MIN_LANDED * len(pts), f"only {landed} of {len(pts)} interrupts raised; missed: {missed}"


@pytest.mark.parametrize("name", list(CALLS))
def test_keyboard_interrupt_from_users_hook_leaves_model_clean(model, name):
    """A KeyboardInterrupt raised by the user's own hook (an exception, not a signal: our handler does not run)
    on its first, last and a random firing inside the call: the guards' exits restore the model."""
    fn = model.fn(name)
    n0 = model.fired
    fn()
    firings = model.fired - n0
    assert firings >= 1, f"{name}: the user's hook never fired inside the call"
    rng = _rng(name, 1)
    ats = sorted({1, firings, int(rng.integers(1, firings + 1))})[:N_HOOK_RAISES]
    for j in ats:
        model.raise_at = model.fired + j
        with pytest.raises(KeyboardInterrupt, match="user's hook"):
            fn()
        assert model.raise_at is None
        model.check_clean(f"{name}, KeyboardInterrupt from the user's hook on firing {j} of {firings}")


@pytest.mark.parametrize("factory", ["parallel_blocks", "ffn_component", "ffn_gate", "attention_gain"])
def test_hook_that_transformerlens_lost_removes_itself(model, factory):
    """A Ctrl-C inside TransformerLens's ``HookPoint.add_hook``, between torch's registration and TL's handle
    list append (TL's own ``run_with_hooks``: no guard of ours there), leaves a torch hook that ``reset_hooks()``
    cannot remove. Simulated exactly: add every hook of a factory through TL, then drop TL's handles from the
    lists as the interrupted append would. The orphans must remove themselves on the next forward and change
    nothing (before the fix, an orphaned ``parallel_blocks`` swap raised "did not fire" on every forward)."""
    m, t = model.m, model.tokens
    hooks = {"parallel_blocks": lambda: H.parallel_blocks(m, [0, 1]),
             "ffn_component": lambda: H.ffn_component(m, "tangential"),
             "ffn_gate": lambda: H.ffn_gate(m, {0: 0.5, 1: 0.0}),
             "attention_gain": lambda: H.attention_gain(m, 1.5)}[factory]()
    with torch.no_grad():
        plain = m(t)
    for name, fn in hooks:
        hp = m.hook_dict[name]
        n = len(hp.fwd_hooks)
        m.add_hook(name, fn)
        assert len(hp.fwd_hooks) == n + 1
        del hp.fwd_hooks[n]  # TL's bookkeeping never happened: reset_hooks() cannot see this hook
    assert hook_state(m) != model.baseline
    m.reset_hooks()
    assert hook_state(m) != model.baseline, "reset_hooks() removed the orphan: the simulation is wrong"
    with torch.no_grad():
        out = m(t)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    model.check_clean(f"orphaned {factory} hooks")


# not critical_points: its solver catches Exception from torch.func transforms to try the next mode, and a handler's
# TimeoutError is an Exception (a Ctrl-C's KeyboardInterrupt is not)
ALARM_CALLS = ["probe", "parallel_defect", "hooks.parallel_blocks", "hooks.ffn_component", TL_RUN]


class _Timeout(TimeoutError):
    """What the user's SIGALRM handler raises (a timeout, not a KeyboardInterrupt)."""


def _on_alarm(signum, frame):
    raise _Timeout("alarm")


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="SIGALRM is POSIX-only")
@pytest.mark.parametrize("name", ALARM_CALLS)
def test_raising_alarm_handler_at_boundaries_leaves_model_clean(model, name):
    """The issue's repro interrupted calls with a SIGALRM timer whose handler raises: any Python signal handler that
    raises is intercepted like Ctrl-C. Delivered deterministically at the first event of scope exits (the window
    no try/finally covers) of a few calls: the user's handler raises ``TimeoutError``; the model is clean after."""
    old = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        fn = model.fn(name)
        fn()
        prof = _inject.profile(fn)
        n = prof.n
        pts = sorted(_strata(prof.exits, N_ALARMS, _rng(name, 2)))
        landed, missed = 0, []
        for k in pts:
            hit = _inject.interrupt(fn, k, sig=signal.SIGALRM, exc=_Timeout)
            landed += hit
            if not hit:
                missed.append(f"event {k} in {_inject.site[0]}")
            assert signal.getsignal(signal.SIGALRM) is _on_alarm, f"{name}: the user's SIGALRM handler was lost"
            if name == TL_RUN:
                model.m.reset_hooks()
                model.m(model.tokens)
            model.check_clean(f"{name}, SIGALRM at event {k} of {n} in {_inject.site[0]}")
        assert landed >= MIN_LANDED * len(pts), f"only {landed} of {len(pts)} alarms raised; missed: {missed}"
        print(f"\n{name}: {landed} of {len(pts)} alarms landed")
    finally:
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("site", ["resid_pre", "resid_mid"])
def test_stale_capture_is_removed_not_put_back(model, site):
    """A one-shot capture that a factory hook armed right before a Ctrl-C in TransformerLens's own run_with_hooks
    (no guard of ours there) stays on the block until a forward reaches it. Simulated by arming one and running
    no forward. The next guarded call's forward fires it (it removes itself, by identity); the guard must not put
    it back on exit as if it were the user's hook (before the fix every later call re-added it)."""
    m, t = model.m, model.tokens
    got = []
    capture_site(adapt(m), 1, site, got.append)
    assert owned_hooks(m), "the simulated stale capture is not attached"
    model.fn("hooks.ffn_gate")()  # a guarded call: its forward fires the stale capture
    assert len(got) == 1, f"the stale capture fired {len(got)} times"
    model.check_clean(f"stale {site} capture, after a guarded call")


def test_ctrl_c_inside_torch_function_mode_dispatch(model):
    """A SIGINT at the exit of torch's ``_pop_mode_temporarily`` (``handle_torch_function`` pops the active mode
    around every torch call and pushes it back on exit) inside ``critical_points``' float64 field computation.
    Before ``float64_compute`` held signals (backends/interrupts.deferred_signals) the mode was not pushed back,
    its ``__exit__`` raised "trying to pop from empty mode stack" in place of the KeyboardInterrupt (which the
    solver's ``except Exception`` fallback could swallow), and the abandoned generator later pushed the float64 mode
    back for good (float64 tensors never downcast again in the thread). Now the Ctrl-C is delivered right after
    the float64 section: a KeyboardInterrupt comes out and no mode is left pushed."""
    fn = model.fn("critical_points")
    fn()
    try:
        out = _inject.interrupt_at_exit_of(fn, "_pop_mode_temporarily", 1)
    except Exception as e:  # noqa: BLE001 - what replaced the KeyboardInterrupt
        out = e
    gc.collect()
    left = torch._C._len_torch_function_stack()
    while torch._C._len_torch_function_stack():  # test-side cleanup: the next tests need a clean mode stack
        torch._C._pop_torch_function_stack()
    assert out is True and left == 0, f"Ctrl-C came out as {out!r}; {left} torch function mode(s) left pushed"


def test_ctrl_c_at_exit_of_transformerlens_hooks_context(model):
    """A SIGINT on the first bytecode of the ``__exit__`` of TransformerLens's ``hooks()`` context (a generator
    context manager) inside our ``run_with_hooks``: the generator is left suspended at its ``yield``. Its cleanup
    (``context_level -= 1``, removing the hooks of its level) used to run whenever the garbage collector finalized it,
    inside a later call: it removed the hooks that call had just added at the same level, mid-forward ("hook(s)
    ['blocks.0.hook_resid_post', ...] exist but never fired"), and left ``context_level`` at -1. Found by the random
    interrupt stress once a change of allocation pattern moved the collections. Now ``run_with_hooks`` closes the
    suspended generator before its guard restores the model."""
    m = model.m
    gen_name = m.hooks().gen.gi_code.co_name  # created, never started: changes nothing
    fn = model.fn("prefix_sensitivity")
    fn()
    level = m.context_level
    out = _inject.interrupt_at_exit_of(fn, gen_name, 1)
    gc.collect()  # an abandoned generator's cleanup would run here
    assert out is True, f"no KeyboardInterrupt came out ({out!r})"
    assert m.context_level == level, f"context_level {m.context_level}, was {level}"
    fn()  # every hook it adds fires
    model.check_clean("Ctrl-C at the exit of TransformerLens's hooks()")
