"""KV-cache decode (tl_steering.backends.decoding) on both model classes and the executor's models: a cached greedy
decode gives the logits of the full forward on the growing sequence (docs/parallel.md, "Masks and KV cache")."""

import importlib.util
from pathlib import Path

import pytest
import torch

from tl_steering.backends import adapt
from tl_steering.backends.decoding import cache_routing, decode_step, freeze_kv_cache, kv_cache, kv_cache_length
from tl_steering.parallel.apply import parallelize


def _lean_sequential_copy(model, layers):
    """The benchmark's sequential control (benchmarks/parallel_speedup.py), loaded from the script."""
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "parallel_speedup.py"
    spec = importlib.util.spec_from_file_location("_parallel_speedup", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.lean_sequential_copy(model, layers)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 1e-4  # float32 logits
PROMPT, STEPS = 6, 6


@pytest.fixture(scope="module")
def copies():
    return {}


def _model(tiny, kind, copies):
    """The plain model, the executor's parallel copy (blocks 0, 1 fused) or the benchmark's lean SEQUENTIAL copy."""
    if kind == "plain":
        return tiny
    if adapt(tiny).any_parallel:
        pytest.skip("NeoX blocks are parallel already: the executor leaves them as they are")
    key = (id(tiny), kind)
    if key not in copies:
        copies[key] = parallelize(tiny, [0, 1]) if kind == "par" else _lean_sequential_copy(tiny, [0, 1])
    return copies[key]


@pytest.mark.parametrize("kind", ["plain", "par", "seq"])
def test_cached_greedy_decode_equals_full_forward(tiny, tiny_tokens, kind, copies):
    m = _model(tiny, kind, copies)
    seq = tiny_tokens[:2, :PROMPT]
    with torch.no_grad():
        cache = kv_cache(m, batch=2)
        out = decode_step(m, seq, cache)
        assert torch.allclose(out, m(seq), atol=ATOL, rtol=0)
        assert kv_cache_length(cache) == PROMPT
        for step in range(STEPS):
            nxt = out[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            out = decode_step(m, nxt, cache)
            full = m(seq)
            assert out.shape[1] == 1
            err = float((out[:, -1] - full[:, -1]).abs().max())
            assert err < ATOL, f"step {step}: cached logits differ from the full forward by {err:.3g}"
        assert kv_cache_length(cache) == PROMPT + STEPS
    with torch.no_grad():
        diff = float((m(seq) - tiny(seq)).abs().max())
    if kind == "par":  # not vacuous: the parallel model is not the plain one
        assert diff > 1e-3
    elif kind == "seq":  # the lean sequential control computes the plain (sequential) model
        assert diff < ATOL


def test_frozen_cache_keeps_the_prefix(tiny, tiny_tokens, copies):
    m = _model(tiny, "par", copies)
    prefix = tiny_tokens[:1, :10]
    with torch.no_grad():
        cache = kv_cache(m, batch=1)
        decode_step(m, prefix, cache)
        freeze_kv_cache(cache)
        for tok in (tiny_tokens[:1, 10:11], tiny_tokens[:1, 11:12]):  # each step sees the same 10-token prefix
            got = decode_step(m, tok, cache)[:, -1]
            ref = m(torch.cat([prefix, tok], dim=1))[:, -1]
            assert torch.allclose(got, ref, atol=ATOL, rtol=0)
            assert kv_cache_length(cache) == 10


def _pre_hooks(model) -> int:
    return sum(len(mod._forward_pre_hooks) for mod in model.modules())


def test_cache_routing_is_removed(tiny, tiny_tokens):
    before = _pre_hooks(tiny)
    with torch.no_grad():
        decode_step(tiny, tiny_tokens[:1, :4], kv_cache(tiny, batch=1))
    assert _pre_hooks(tiny) == before
    with pytest.raises(RuntimeError, match="boom"):
        with cache_routing(tiny):
            if adapt(tiny).backend == "bridge":
                assert _pre_hooks(tiny) > before
            raise RuntimeError("boom")
    assert _pre_hooks(tiny) == before


def test_generate_with_cache_routing(tiny, tiny_tokens, copies):
    """TL's own generate(use_past_kv_cache=True) on the bridge decodes right inside cache_routing (parallel copy)."""
    if adapt(tiny).backend != "bridge" or adapt(tiny).any_parallel:
        pytest.skip("bridge, sequential blocks only")
    m = _model(tiny, "par", copies)
    prompt = tiny_tokens[:1, :8]
    ref = m.generate(prompt, max_new_tokens=5, do_sample=False, use_past_kv_cache=False, verbose=False)
    with cache_routing(m):
        got = m.generate(prompt, max_new_tokens=5, do_sample=False, use_past_kv_cache=True, verbose=False)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_sandwich_blocks_decode(arch, tiny_tokens):
    """Gemma 3 / 2 (sliding window 4 < the 12 positions, QK-norm / softcapping) through the fused blocks."""
    import tl_steering as ts

    m = parallelize(ts.tiny_model(arch, seed=0), [0, 1])
    seq = tiny_tokens[:1, :4]
    with torch.no_grad():
        cache = kv_cache(m, batch=1)
        out = decode_step(m, seq, cache)
        for _ in range(8):
            nxt = out[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            out = decode_step(m, nxt, cache)
            assert torch.allclose(out[:, -1], m(seq)[:, -1], atol=ATOL, rtol=0)
