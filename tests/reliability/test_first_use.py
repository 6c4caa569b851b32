"""Rough edges a new user meets first, each a clear error or message: planning on a model whose blocks are
parallel already, a probe on windows too short for statistics, tokens on the meta device, a hub name offline."""

import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

import tl_steering as ts
from tl_steering.backends import adapt
from tl_steering.errors import DeviceMismatchError, InputError, ModelLoadError
from tl_steering.hub import cached_locally, hub_problem

SIZES = dict(n_layers=2, d_model=32, n_heads=2, n_ctx=32)


def _tokens(n=4, length=12):
    return torch.randint(1, 257, (n, length), generator=torch.Generator().manual_seed(0))


def test_plan_on_a_model_whose_blocks_are_parallel_already():
    m = ts.tiny_model("neox", seed=0, **SIZES)
    with pytest.raises(InputError, match=r"k=2: every selected block \(\[0, 1\]\) is a parallel attention/MLP block "
                                         r"already .* nothing to plan"):
        ts.plan_parallel(m, _tokens(), k=2)
    gpt2 = ts.tiny_model("gpt2", seed=0, **SIZES)
    with pytest.raises(InputError, match=r"k must be an int in \[0, 2\]"):  # a sequential model: the range
        ts.plan_parallel(gpt2, _tokens(), k=3)


def test_probe_on_windows_too_short_for_statistics():
    m = ts.tiny_model("gpt2", seed=0, **SIZES)
    with ts.probe(m) as trace:
        m(_tokens(length=1))
    with pytest.raises(InputError, match=r"no position was left for statistics: the longest window has 1 "
                                         r"position\(s\) and exclude_positions=\[0\] excludes them all .* at least 2 "
                                         r"positions per window once position 0 is excluded"):
        trace.result()
    with ts.probe(m, metrics=["resid_norm", "diversity"]) as trace:  # one position left: diversity needs two
        m(_tokens(length=2))
    with pytest.warns(UserWarning, match=r"diversity need at least 2 positions per window .* left 1"):
        res = trace.result()
    assert torch.isfinite(res.get("resid_norm_pre")).all()
    with ts.probe(m, exclude_positions=()) as trace:  # position 0 included: one position is enough for tokens
        m(_tokens(length=1))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert torch.isfinite(trace.result().get("resid_norm_pre")).all()


def test_tokens_on_the_meta_device():
    m = ts.tiny_model("gpt2", seed=0, **SIZES)
    meta = _tokens().to("meta")
    for call in (lambda: ts.angular_deficit(m, meta), lambda: adapt(m).run_with_hooks(meta, []),
                 lambda: adapt(m).validate_tokens(meta)):
        with pytest.raises(DeviceMismatchError, match=r"tokens are on the 'meta' device: a meta tensor has a shape "
                                                      r"but no values"):
            call()
    with pytest.raises(DeviceMismatchError, match="'meta' device"):  # the user's own forward inside a probe
        with ts.probe(m):
            m(meta)
    m(_tokens())  # nothing of ours left on the model


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    """The hub unreachable (a closed local port as its endpoint, no proxy) and an empty Hugging Face cache."""
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path


def test_cli_hub_name_offline_fails_at_once_naming_offline_models(no_hub):
    out = no_hub / "report_out"
    argv = [sys.executable, "-m", "tl_steering", "report", "--model", "gpt2", "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=no_hub, check=False,
                          env=dict(os.environ))
    wall = time.perf_counter() - t0
    print(f"\ntl-steering report --model gpt2, hub unreachable: exit {proc.returncode} after {wall:.2f} s wall")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    msg = lines[0]
    assert "cannot load 'gpt2': the Hugging Face hub is unreachable (127.0.0.1:9: ConnectionRefusedError" in msg
    assert "'gpt2' is not in the local Hugging Face cache" in msg
    assert "Models that load offline: smollm2-135m, gemma-3-270m" in msg
    assert not out.exists()


def test_load_model_hub_name_offline_and_cache_lookup(no_hub, monkeypatch):
    with pytest.raises(ModelLoadError, match=r"cannot load 'pythia-14m': the Hugging Face hub is unreachable .* "
                                             r"Models that load offline: smollm2-135m, gemma-3-270m"):
        ts.load_model("pythia-14m")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_problem("gpt2").startswith("$HF_HUB_OFFLINE is set and 'gpt2' is not in the local Hugging Face cache")
    # a model in the local cache is left to load (here under its organisation, as transformers stores 'gpt2')
    snap = no_hub / "hf-cache" / "models--openai-community--gpt2" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    assert not cached_locally("gpt2")  # no config yet
    (snap / "config.json").write_text("{}")
    assert cached_locally("gpt2") and cached_locally("openai-community/gpt2") and not cached_locally("gpt2-xl")
    assert hub_problem("gpt2") is None
