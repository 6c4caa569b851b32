"""Gemma-3-270M, the sandwich-norm family (a norm before AND after each sublayer; see docs/gemma.md).

One load per session (the ``gemma`` fixture, integration backend: bridge on TL 4.x, HookedTransformer on TL 3.9),
2 x 64 tokens. Cost on 2 shared CPU cores: the load (~40 s from the dequantized-weights cache, minutes on the first
run) plus ~40 s of forwards; the cross-backend test loads the bridge a second time on TL 3.9.
"""

import warnings

import pytest
import torch

import tl_steering as ts
from tests.helpers import assert_no_hooks
from tl_steering.backends import adapt, hooked_available, weights_fingerprint
from tl_steering.hooks import attention_gain, ffn_component, ffn_gate, parallel_blocks
from tl_steering.parallel import parallelize

pytestmark = pytest.mark.integration


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# -- an independent Gemma-3 recomputation from the raw Hugging Face modules (plain torch, float64) -------------


def _raw(m):
    while isinstance(m, torch.nn.Module) and "_original_component" in m._modules:
        m = m._modules["_original_component"]
    return m


def _rms(x, norm):
    n = _raw(norm)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + n.eps) * (1.0 + n.weight.double())  # Gemma: 1 + w


def _phi_ref(layer, y):
    mlp = _raw(layer.mlp)
    h = _rms(y.double(), layer.pre_feedforward_layernorm)
    g, u = h @ _raw(mlp.gate_proj).weight.double().T, h @ _raw(mlp.up_proj).weight.double().T
    z = torch.nn.functional.gelu(g, approximate="tanh") * u
    return _rms(z @ _raw(mlp.down_proj).weight.double().T, layer.post_feedforward_layernorm)


def _attn_ref(layer, x):
    at = _raw(layer.self_attn)
    b, s, _ = x.shape
    dh = at.head_dim
    h = _rms(x.double(), layer.input_layernorm)
    proj = lambda lin: (h @ _raw(lin).weight.double().T).view(b, s, -1, dh).transpose(1, 2)  # noqa: E731
    q, k, v = _rms(proj(at.q_proj), at.q_norm), _rms(proj(at.k_proj), at.k_norm), proj(at.v_proj)
    theta = at.config.rope_parameters[at.layer_type]["rope_theta"]  # local and global layers: own base
    inv = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = lambda t: torch.cat([-t[..., dh // 2:], t[..., :dh // 2]], -1)  # noqa: E731
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    rep = q.shape[1] // k.shape[1]  # grouped-query attention
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    sc = (q @ k.transpose(-1, -2)) * at.scaling
    i = torch.arange(s)
    allowed = (i[:, None] - i[None]) >= 0
    if at.sliding_window:
        allowed &= (i[:, None] - i[None]) < at.sliding_window
    z = (sc.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
    return _rms(z @ _raw(at.o_proj).weight.double().T, layer.post_attention_layernorm)


def _check_against_hf(model, tokens, layers):
    ad = adapt(model)
    names = [ad.hook_name(lay, s) for lay in layers for s in ("resid_pre", "attn_out", "resid_mid", "mlp_out")]
    _, cache = ad.run_with_cache(tokens, names)
    for lay in layers:
        layer = model.blocks[lay]._original_component
        g = lambda s: cache[ad.hook_name(lay, s)]  # noqa: E731,B023
        with torch.no_grad():
            assert rel(_phi_ref(layer, g("resid_mid")), g("mlp_out")) < 1e-5, lay
            assert rel(_attn_ref(layer, g("resid_pre")), g("attn_out")) < 1e-5, lay


# -- tests ----------------------------------------------------------------------------------------------------


def test_bos_convention(gemma, gemma_tokens):
    assert adapt(gemma).info.prepend_bos
    bos = gemma.tokenizer.bos_token_id
    assert bos is not None and (gemma_tokens[:, 0] == bos).all()
    assert (gemma_tokens[:, 1:] != bos).all()


def test_sandwich_norms_and_identities_every_layer(gemma, gemma_tokens):
    """resid identities, Phi(resid_mid) == hook_mlp_out and A(resid_pre) == hook_attn_out on all 18 layers."""
    ad = adapt(gemma)
    assert ad.n_layers == 18
    for lay in range(ad.n_layers):
        norms = ad.sublayer_norms(lay)
        assert norms.sandwich and None not in (norms.pre_attn, norms.post_attn, norms.pre_ffn, norms.post_ffn)
    names = ad.identity_names()
    _, cache = ad.run_with_cache(gemma_tokens, names)
    worst = ad.check_residual_identity(cache)
    assert max(worst.values()) < 1e-6
    for lay in range(ad.n_layers):
        mid, pre = cache[ad.hook_name(lay, "resid_mid")], cache[ad.hook_name(lay, "resid_pre")]
        with torch.no_grad():
            assert rel(ad.ffn(lay)(mid), cache[ad.hook_name(lay, "mlp_out")]) < 1e-5, lay
            assert rel(ad.attention(lay)(pre), cache[ad.hook_name(lay, "attn_out")]) < 1e-5, lay
    # leaving the post-FFN norm out (the pre-norm Phi) is far off: the norm is what the fix is about
    blk = gemma.blocks[0]
    with torch.no_grad():
        pre_norm_only = blk.mlp(ad.sublayer_norms(0).pre_ffn(cache[ad.hook_name(0, "resid_mid")]))
        pre_norm_only = pre_norm_only[0] if isinstance(pre_norm_only, tuple) else pre_norm_only
    assert rel(pre_norm_only, cache[ad.hook_name(0, "mlp_out")]) > 0.5
    assert_no_hooks(gemma)


@pytest.mark.skipif(hooked_available(), reason="on TL 3.9 the integration model is a HookedTransformer; "
                                                "test_backends_agree checks its bridge against Hugging Face")
def test_independent_hf_recomputation(gemma, gemma_tokens):
    _check_against_hf(gemma, gemma_tokens, [0, 5, 17])  # local, global, last


def test_parallelize_equals_surrogate(gemma, gemma_tokens):
    layers = [3, 5, 11]  # one local, two global (sliding-window vs full attention, different rotary bases)
    fp = weights_fingerprint(gemma)
    ad = adapt(gemma)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        par = parallelize(gemma, layers)
    notes = [str(w.message) for w in caught if "not fused" in str(w.message)]
    if ad.backend == "bridge":
        assert not notes  # Gemma blocks are fused on the bridge
    adp = adapt(par)
    with torch.no_grad():
        ref = ad.run_with_hooks(gemma_tokens, parallel_blocks(gemma, layers))
        got = par(gemma_tokens, return_type="logits")
    assert rel(got, ref) < 1e-4
    assert [adp.is_parallel(i) for i in layers] == [True] * 3 and not ad.any_parallel
    assert weights_fingerprint(gemma) == fp
    assert_no_hooks(gemma)
    del par


def test_protocols_and_hook_factories_run(gemma, gemma_tokens):
    """Every public protocol and hook factory runs on Gemma and gives finite numbers of the right shape (small
    variant sets: ~12 forwards of 2 x 64 tokens)."""
    fp = weights_fingerprint(gemma)
    ad = adapt(gemma)
    d = ts.angular_deficit(gemma, gemma_tokens, n_bootstrap=0)
    assert d.deficit.shape == (18,) and torch.isfinite(d.deficit).all()
    ab = ts.ffn_ablation(gemma, gemma_tokens, keep=("tangential", "radial"), n_bootstrap=0,
                         include_random_tangent=False)
    assert set(ab.delta_loss) >= {"tangential", "radial"} and all(v == v for v in ab.delta_loss.values())
    dv = ts.diversity(gemma, gemma_tokens, layers=[0, 9, 17], ablations=("tangential",), gains=(1.0,))
    assert torch.isfinite(dv.pairwise_cosine).all()
    df = ts.parallel_defect(gemma, gemma_tokens, layers=[0, 5, 17])
    assert torch.isfinite(df.score).all() and not any(df.already_parallel)
    one = gemma_tokens[:1]
    clean = float(ad.loss_per_token(one).mean())
    for hooks in (ffn_component(gemma, keep="tangential", layers=[2]), ffn_gate(gemma, {4: 0.5}),
                  attention_gain(gemma, 1.5, layers=[6]), parallel_blocks(gemma, [8])):
        loss = float(ad.loss_per_token(one, hooks).mean())
        assert loss == loss and abs(loss - clean) > 1e-6  # finite, and the hook really acted
    assert weights_fingerprint(gemma) == fp


@pytest.mark.skipif(not hooked_available(), reason="TL 4.x has no HookedTransformer: one backend only")
def test_backends_agree(gemma, gemma_tokens):
    """TL 3.9: HookedTransformer (the fixture) and the bridge on the same weights: geometry rtol 1e-4, losses
    1e-4 nats; the bridge also agrees with an independent Hugging Face recomputation."""
    bridge = ts.load_model("gemma-3-270m", backend="bridge")
    assert torch.equal(ts.text_tokens(bridge, n_windows=2, length=64), gemma_tokens)
    l_h = adapt(gemma).loss_per_token(gemma_tokens).mean()
    l_b = adapt(bridge).loss_per_token(gemma_tokens).mean()
    assert abs(float(l_h - l_b)) < 1e-4
    d_h = ts.angular_deficit(gemma, gemma_tokens, n_bootstrap=0)
    d_b = ts.angular_deficit(bridge, gemma_tokens, n_bootstrap=0)
    assert torch.allclose(d_h.deficit, d_b.deficit, rtol=1e-4, atol=1e-6)
    f_h = ts.parallel_defect(gemma, gemma_tokens, layers=[0, 5, 17])
    f_b = ts.parallel_defect(bridge, gemma_tokens, layers=[0, 5, 17])
    assert torch.allclose(f_h.score, f_b.score, rtol=1e-4, atol=1e-6)
    _check_against_hf(bridge, gemma_tokens, [0, 5])
