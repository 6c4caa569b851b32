"""The parallel executor: fused parallel blocks equal the hook-based surrogate (docs/defect.md)."""

import warnings

import pytest
import torch

import tl_steering as ts
from tl_steering.backends import adapt, hooked_available, weights_fingerprint
from tl_steering.errors import InputError, LayerIndexError
from tl_steering.hooks import parallel_blocks
from tl_steering.backends.sublayers import unwrap as _raw
from tl_steering.backends.copying import deepcopy_module
from tl_steering.parallel.apply import parallel_layers, parallelize, unfused

RTOL = 1e-4  # fp32, relative to the largest entry


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _arch(model) -> str:
    return model._tl_steering_info.name.removeprefix("tiny-")


@pytest.fixture
def seq_tiny(tiny):
    if adapt(tiny).any_parallel:
        pytest.skip("NeoX blocks are parallel already (see test_neox_is_a_noop_copy)")
    return tiny


@pytest.fixture(scope="module")
def par_cache():
    return {}


def _par(model, layers, par_cache, **kw):
    key = (id(model), tuple(layers), tuple(sorted(kw.items())))
    if key not in par_cache:
        par_cache[key] = parallelize(model, layers, **kw)
    return par_cache[key]


@pytest.mark.parametrize("layers", [[0], [1], [0, 1]])
def test_fused_equals_surrogate(seq_tiny, tiny_tokens, layers, par_cache):
    m = seq_tiny
    p = _par(m, layers, par_cache)
    ad_m, ad_p = adapt(m), adapt(p)
    names = [ad_m.hook_name(lay, "resid_post") for lay in range(ad_m.n_layers)]
    ref_logits, ref = ad_m.run_with_cache(tiny_tokens, names, fwd_hooks=parallel_blocks(m, layers))
    logits, got = ad_p.run_with_cache(tiny_tokens, names)  # boundary hooks only: the fused path runs
    for lay in layers:
        assert rel(got[names[lay]], ref[names[lay]]) < RTOL, f"layer {lay}"
    assert rel(logits, ref_logits) < RTOL
    # and it differs from the sequential model (the test is not vacuous)
    assert rel(logits, ad_m.run_with_hooks(tiny_tokens)) > 1e-3


def test_unfused_option_equals_surrogate(seq_tiny, tiny_tokens, par_cache):
    m = seq_tiny
    p = _par(m, [0, 1], par_cache, fuse=False)
    ref = adapt(m).run_with_hooks(tiny_tokens, parallel_blocks(m, [0, 1]))
    assert rel(adapt(p).run_with_hooks(tiny_tokens), ref) < 1e-6


def test_no_layers_gives_the_original(tiny, tiny_tokens):
    p = parallelize(tiny, [])
    assert p is not tiny and parallel_layers(p) == []
    assert torch.equal(p(tiny_tokens), tiny(tiny_tokens))


def test_original_untouched(seq_tiny, tiny_tokens, par_cache):
    m = seq_tiny
    fp = weights_fingerprint(m)
    before = m(tiny_tokens)
    p = parallelize(m, [0, 1])
    p.run_with_cache(tiny_tokens)  # hooks everywhere on the copy
    assert weights_fingerprint(m) == fp
    assert torch.equal(m(tiny_tokens), before)
    assert all(not hp._forward_hooks for hp in m.hook_dict.values())
    assert not adapt(m).any_parallel
    assert {id(t) for t in m.parameters()}.isdisjoint({id(t) for t in p.parameters()})


def test_copy_shares_the_weights_and_leaves_the_original(seq_tiny, tiny_tokens):
    """The copy's parameters sit on the original's storage (no second copy of the model), tied ones stay tied,
    and converting the copy or its grad flags leaves the original as it is."""
    m = seq_tiny
    before, fp = m(tiny_tokens), weights_fingerprint(m)
    p = parallelize(m, [0])
    ptr = lambda model: [t.untyped_storage().data_ptr() for t in model.parameters()]  # noqa: E731
    assert ptr(p) == ptr(m) and len(list(p.parameters())) == len(list(m.parameters()))
    out = p(tiny_tokens)
    p.double().requires_grad_(False)
    assert all(t.dtype == torch.float32 and t.requires_grad for t in m.parameters())
    assert weights_fingerprint(m) == fp and torch.equal(m(tiny_tokens), before)
    assert rel(p(tiny_tokens.clone()), out) < 1e-5  # the float64 copy computes the same model


def test_adapter_sees_parallel_blocks(seq_tiny, par_cache):
    p = _par(seq_tiny, [1], par_cache)
    ad = adapt(p)
    assert [ad.is_parallel(i) for i in range(ad.n_layers)] == [False, True]
    assert ad.hook_name(1, "ffn_input") == "blocks.1.hook_resid_pre"
    assert parallel_layers(p) == [1]


def test_block_boundary_hooks_fire_and_patch(seq_tiny, tiny_tokens, par_cache):
    p = _par(seq_tiny, [0, 1], par_cache)
    fired = []
    hooks = [(f"blocks.{i}.hook_resid_{s}", lambda act, hook, i=i, s=s: fired.append((i, s)))
             for i in (0, 1) for s in ("pre", "post")]
    p.run_with_hooks(tiny_tokens, fwd_hooks=hooks)
    assert sorted(fired) == [(0, "post"), (0, "pre"), (1, "post"), (1, "pre")]
    # a patching hook at resid_pre of a fused block is honoured
    zero = p.run_with_hooks(tiny_tokens, fwd_hooks=[("blocks.1.hook_resid_pre", lambda a, hook: a * 0.5)])
    assert rel(zero, p(tiny_tokens)) > 1e-3
    with unfused(p):
        zero_ref = p.run_with_hooks(tiny_tokens, fwd_hooks=[("blocks.1.hook_resid_pre", lambda a, hook: a * 0.5)])
    assert rel(zero, zero_ref) < RTOL


def test_inner_hooks_use_the_unfused_path(seq_tiny, tiny_tokens, par_cache):
    """A full cache needs hooks inside the block: those blocks run unfused, with parallel semantics."""
    p = _par(seq_tiny, [1], par_cache)
    logits, cache = p.run_with_cache(tiny_tokens)
    assert "blocks.1.hook_attn_out" in cache and "blocks.1.hook_mlp_out" in cache
    assert rel(logits, p(tiny_tokens)) < RTOL
    ad = adapt(p)
    _, c = ad.run_with_cache(tiny_tokens, ad.identity_names())
    errs = ad.check_residual_identity(c)  # layer 1 checked as resid_pre + attn + mlp = resid_post
    assert max(errs.values()) < 1e-5
    assert all(not hp._forward_hooks for hp in p.hook_dict.values())


def test_loss(seq_tiny, tiny_tokens, par_cache):
    m = seq_tiny
    p = _par(m, [0, 1], par_cache)
    ref = m.run_with_hooks(tiny_tokens, fwd_hooks=parallel_blocks(m, [0, 1]), return_type="loss")
    got = p(tiny_tokens, return_type="loss")
    assert torch.isfinite(got) and abs(float(got) - float(ref)) < 1e-5 * abs(float(ref))


def test_neox_is_a_noop_copy(tiny_tokens):
    m = ts.tiny_model("neox", backend="bridge", seed=0)
    with pytest.warns(UserWarning, match="parallel attention/MLP blocks already"):
        p = parallelize(m, [0, 1])
    assert p is not m and parallel_layers(p) == []
    assert torch.equal(p(tiny_tokens), m(tiny_tokens))


def test_bad_layers(seq_tiny):
    with pytest.raises(LayerIndexError):
        parallelize(seq_tiny, [7])
    with pytest.raises(InputError):
        parallelize(seq_tiny, "0")


def test_eps_mismatch_falls_back_unfused(seq_tiny, tiny_tokens):
    m = deepcopy_module(seq_tiny)
    blk = m.blocks[0]
    ln2 = blk.ln2 if adapt(m).backend == "hooked" else _raw(blk.ln2)
    if hasattr(ln2, "variance_epsilon"):
        ln2.variance_epsilon = 1e-3
    else:
        ln2.eps = 1e-3
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p = parallelize(m, [0])
    assert any("not fused" in str(x.message) for x in w)
    ref = m.run_with_hooks(tiny_tokens, fwd_hooks=parallel_blocks(m, [0]))
    assert rel(p(tiny_tokens), ref) < 1e-6


@pytest.mark.skipif(not hooked_available(), reason="HookedTransformer needs TransformerLens 3.x")
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hooked_kv_cache_decode(arch, tiny_tokens):
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    m = ts.tiny_model(arch, backend="hooked", seed=0)
    p = parallelize(m, [1])
    with torch.no_grad():
        full = p(tiny_tokens)
        cache = TransformerLensKeyValueCache.init_cache(p.cfg, "cpu", tiny_tokens.shape[0])
        pre = p(tiny_tokens[:, :-1], past_kv_cache=cache)
        step = p(tiny_tokens[:, -1:], past_kv_cache=cache)
    assert rel(pre, full[:, :-1]) < RTOL
    assert rel(step[:, -1], full[:, -1]) < RTOL


@pytest.mark.skipif(not hooked_available(), reason="HookedTransformer needs TransformerLens 3.x")
def test_hooked_padding_falls_back(tiny_tokens):
    m = ts.tiny_model("llama", backend="hooked", seed=0)
    p = parallelize(m, [0])
    mask = torch.ones_like(tiny_tokens)
    mask[0, :3] = 0  # left padding on the first sequence
    ref = m.run_with_hooks(tiny_tokens, fwd_hooks=parallel_blocks(m, [0]), attention_mask=mask)
    assert rel(p(tiny_tokens, attention_mask=mask)[:, 3:], ref[:, 3:]) < RTOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("streams", [False, True])
def test_cuda_equivalence(seq_tiny, tiny_tokens, streams):
    m = deepcopy_module(seq_tiny).to("cuda")
    toks = tiny_tokens.to("cuda")
    p = parallelize(m, [0, 1], streams=streams)
    ref = m.run_with_hooks(toks, fwd_hooks=parallel_blocks(m, [0, 1]))
    assert rel(p(toks), ref) < RTOL


# -- sandwich-norm blocks (Gemma 3 / Gemma 2) on tiny random models: window 4 < 16 tokens, softcapping (Gemma 2)


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def gemma_tiny(request):
    return ts.tiny_model(request.param, seed=0)


def test_sandwich_sublayers_match_hooks(gemma_tiny, tiny_tokens):
    """A = post_attn(attn(ln1 x)) and Phi = post_ffn(mlp(ln2 y)) reproduce hook_attn_out / hook_mlp_out exactly,
    on a sliding-window layer longer than its window and on a global layer."""
    ad = adapt(gemma_tiny)
    _, cache = ad.run_with_cache(tiny_tokens, ad.identity_names())
    assert max(ad.check_residual_identity(cache).values()) < 1e-6
    for lay in range(ad.n_layers):
        assert ad.sublayer_norms(lay).post_attn is not None  # a sandwich block
        with torch.no_grad():
            phi = ad.ffn(lay)(cache[ad.hook_name(lay, "resid_mid")])
            a = ad.attention(lay)(cache[ad.hook_name(lay, "resid_pre")])
        assert rel(phi, cache[ad.hook_name(lay, "mlp_out")]) < 1e-6
        assert rel(a, cache[ad.hook_name(lay, "attn_out")]) < 1e-6


def test_sandwich_parallelize_equals_surrogate(gemma_tiny, tiny_tokens):
    fp = weights_fingerprint(gemma_tiny)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fused: no "not fused" note
        p = parallelize(gemma_tiny, [0, 1])
    ref = adapt(gemma_tiny).run_with_hooks(tiny_tokens, parallel_blocks(gemma_tiny, [0, 1]))
    with torch.no_grad():
        assert rel(p(tiny_tokens), ref) < RTOL
        with unfused(p):
            assert rel(p(tiny_tokens), ref) < RTOL
    fw = [m for m in p.modules() if type(m).__name__ == "FusedWeights"]
    qk_norm = adapt(gemma_tiny).info.name == "tiny-gemma3"  # Gemma 3 has QK-norm, Gemma 2 softcapping
    assert len(fw) == 2 and all(f.sandwich and (f.q_norm_g is not None) == qk_norm for f in fw)
    assert all((f.softcap is not None) != qk_norm for f in fw) and {f.window for f in fw} == {4, None}
    assert weights_fingerprint(gemma_tiny) == fp


def test_sandwich_hooked_tiny_is_refused():
    if not hooked_available():
        pytest.skip("HookedTransformer needs TransformerLens 3.x")
    with pytest.raises(ts.errors.ModelNotSupportedError, match="bridge only"):
        ts.tiny_model("gemma3", backend="hooked")


def test_post_norm_only_olmo2_sublayers(tiny_tokens):
    """OLMo 2 (bridge): norms only AFTER each sublayer; A = post_attn(attn(x)), Phi = post_ffn(mlp(y)) reproduce
    the hooks; the executor refuses the block with a clear error (not fused wrongly)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM, PreTrainedTokenizerFast

    from tl_steering.backends import wrap_hf
    from tl_steering.backends.loading import _byte_tokenizer_dir

    torch.manual_seed(0)
    cfg = Olmo2Config(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)
    hf = Olmo2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    m = wrap_hf(hf, PreTrainedTokenizerFast.from_pretrained(_byte_tokenizer_dir()), "bridge", "raw", "cpu",
                label="tiny-o2")
    ad = adapt(m)
    norms = ad.sublayer_norms(0)
    assert norms.pre_attn is None and norms.pre_ffn is None
    assert norms.post_attn is not None and norms.post_ffn is not None
    _, cache = ad.run_with_cache(tiny_tokens, ad.identity_names())
    for lay in range(2):
        with torch.no_grad():
            assert rel(ad.ffn(lay)(cache[ad.hook_name(lay, "resid_mid")]), cache[ad.hook_name(lay, "mlp_out")]) < 1e-6
            assert rel(ad.attention(lay)(cache[ad.hook_name(lay, "resid_pre")]),
                       cache[ad.hook_name(lay, "attn_out")]) < 1e-6
    with pytest.raises(ts.errors.ModelNotSupportedError, match="Gemma-style"):
        parallelize(m, [0])
