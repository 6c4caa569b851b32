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
from tl_steering.parallel.apply import parallelize

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
        assert None not in (norms.pre_attn, norms.post_attn, norms.pre_ffn, norms.post_ffn)
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


# -- every public protocol, hook factory, the probe and the executor, as named numbers -------------------------
# kind: "geometry" (rtol 1e-4, abs floor 1e-6), "loss" (1e-4 nats), "exact" (counts, layer lists), "prefix"
# (the angle / KL of a 1e-2 perturbation, ~1e-4: rtol 1e-2), "finite" (checked finite only: the critical-point
# residuals, ~1e-12, are roundoff of the solver)

PLAN_LAYERS = [0, 5, 17]  # first, a global layer, last


def _every_protocol(model, tokens) -> dict[str, tuple[object, str]]:
    """~30 Gemma forwards (and one backward) of at most 2 x 64 tokens."""
    ad = adapt(model)
    out: dict[str, tuple[object, str]] = {}
    out["clean_loss"] = (float(ad.loss_per_token(tokens).mean()), "loss")
    d = ts.angular_deficit(model, tokens, n_bootstrap=0)
    out["angular_deficit.deficit"] = (d.deficit, "geometry")
    ab = ts.ffn_ablation(model, tokens, keep=("tangential", "radial"), n_bootstrap=0, include_random_tangent=False)
    out.update({f"ffn_ablation.delta_loss.{k}": (float(v), "loss") for k, v in ab.delta_loss.items()})
    dv = ts.diversity(model, tokens, layers=[0, 9, 17], ablations=("tangential",), gains=(1.0,))
    out["diversity.pairwise_cosine"] = (dv.pairwise_cosine, "geometry")
    df = ts.parallel_defect(model, tokens, layers=PLAN_LAYERS)
    out["parallel_defect.C"] = (df.score, "geometry")
    cal = tokens[:1]  # plan_parallel calibrates on the first window and holds out the second
    ps = ts.parallel_scores(model, cal, layers=PLAN_LAYERS, fisher_samples=0)
    out.update({f"parallel_scores.{k}": (v, "geometry") for k, v in ps.scores.items()})
    plan = ts.plan_parallel(model, tokens, 1, strategy="C", layers=PLAN_LAYERS, k_values=[1], refit="none")
    out["plan_parallel.layers"] = (list(plan.layers), "exact")
    out["plan_parallel.held_out_delta_ce"] = (float(plan.held_out_delta_ce), "loss")
    g = ts.calibrate_gates(model, tokens, method="closed_form", plan=[5])
    out["calibrate_gates.closed_form"] = (float(g.gates[5]), "geometry")
    out["calibrate_gates.loss_gated_heldout"] = (float(g.loss_gated_heldout), "loss")
    cp = ts.critical_points(model, 17, n_starts=2, eigensolver="dense", tokens=cal,
                            options={"max_iter": 20, "pre_iter": 20, "landscape_solves": 0}).result(17)
    out["critical_points.radius"] = (float(cp.options["radius"]), "geometry")
    out["critical_points.n_starts"] = (int(cp.n_starts), "exact")
    out["critical_points.residuals"] = (cp.residuals, "finite")
    pr = ts.prefix_sensitivity(model, tokens, 9, 16, eps=1e-2, seed=0)
    out["prefix_sensitivity.prefix_max_angle"] = (float(pr.prefix_max_angle), "finite")
    out["prefix_sensitivity.kl0"] = (float(pr.kl[0]), "prefix")
    out["prefix_sensitivity.angle_final"] = (float(pr.angle_final[1:].nanmean()), "prefix")
    st = ts.prefix_statistics(model, cal, layers=[0, 17], stats=("pairwise_cosine",))
    out["prefix_statistics.pairwise_cosine"] = (st.values["pairwise_cosine"][:, -1], "geometry")
    with ts.probe(model, metrics=("resid_norm", "tangent_alignment"), layers=[0, 9, 17]) as trace:
        with torch.no_grad():
            model(tokens)
    res = trace.result()
    out.update({f"probe.{q}": (res.get(q), "geometry") for q in res.quantities})
    one = tokens[:1]
    for name, hooks in (("ffn_component", ffn_component(model, keep="tangential", layers=[2])),
                        ("ffn_gate", ffn_gate(model, {4: 0.5})),
                        ("attention_gain", attention_gain(model, 1.5, layers=[6])),
                        ("parallel_blocks", parallel_blocks(model, [8]))):
        out[f"hooks.{name}"] = (float(ad.loss_per_token(one, hooks).mean()), "loss")
    out["hooks.clean_one"] = (float(ad.loss_per_token(one).mean()), "loss")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TL 3.9 HookedTransformer: Gemma blocks run the exact unfused path
        par = parallelize(model, [8])
    with torch.no_grad():
        out["parallelize.loss"] = (float(adapt(par).loss_per_token(one).mean()), "loss")
    del par
    return out


@pytest.fixture(scope="module")
def every_protocol(gemma, gemma_tokens):
    fp = weights_fingerprint(gemma)
    out = _every_protocol(gemma, gemma_tokens)
    assert weights_fingerprint(gemma) == fp
    assert_no_hooks(gemma)
    return out


def _finite(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() > 0 and bool(torch.isfinite(v).all())
    if isinstance(v, list):
        return True
    return v == v and abs(v) != float("inf")


def test_protocols_and_hook_factories_run(every_protocol):
    """Every public protocol, hook factory, the probe and parallelize run on Gemma: finite numbers of the right
    shape, hooks that act, the parallel executor equal to its hook surrogate."""
    v = {k: val for k, (val, _) in every_protocol.items()}
    bad = [k for k, val in v.items() if not _finite(val)]
    assert not bad, bad
    assert v["angular_deficit.deficit"].shape == (18,)
    assert set(v) >= {"ffn_ablation.delta_loss.tangential", "ffn_ablation.delta_loss.radial"}
    assert v["parallel_scores.C"].shape == v["parallel_defect.C"].shape == (3,)
    assert len(v["plan_parallel.layers"]) == 1 and v["plan_parallel.layers"][0] in PLAN_LAYERS
    assert v["critical_points.radius"] > 0
    assert v["prefix_sensitivity.prefix_max_angle"] < 1e-6  # causality: positions before j never move
    assert v["prefix_sensitivity.kl0"] > 0
    assert {"probe.resid_norm_pre", "probe.resid_norm_mid", "probe.resid_norm_post"} <= set(v)
    for name in ("ffn_component", "ffn_gate", "attention_gain", "parallel_blocks"):
        assert abs(v[f"hooks.{name}"] - v["hooks.clean_one"]) > 1e-6, name  # the hook really acted
    # the executor (parallelize) against its hook surrogate (parallel_blocks), as a loss: 1e-4 nats
    assert abs(v["parallelize.loss"] - v["hooks.parallel_blocks"]) < 1e-4


BACKEND_TOL = {"geometry": (1e-4, 1e-6), "loss": (0.0, 1e-4), "prefix": (1e-2, 1e-7)}  # (rtol, atol)


def _disagreements(a: dict, b: dict) -> list[str]:
    out = []
    for name, (x, kind) in a.items():
        y = b[name][0]
        if kind == "finite":
            continue
        if kind == "exact":
            if x != y:
                out.append(f"{name}: {x!r} vs {y!r}")
            continue
        rtol, atol = BACKEND_TOL[kind]
        x64, y64 = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
        err = (x64 - y64).abs()
        bound = atol + rtol * y64.abs()
        if not bool((err <= bound).all()):
            out.append(f"{name} ({kind}): worst |diff| {float(err.max()):.3g} > bound {float(bound.min()):.3g}")
    return out


@pytest.mark.skipif(not hooked_available(), reason="TL 4.x has no HookedTransformer: one backend only "
                                                   "(tests/published/test_gemma_pinned.py compares it with TL 3.9)")
def test_backends_agree(gemma, gemma_tokens, every_protocol):
    """TL 3.9: HookedTransformer (the fixture) and the bridge on the same weights agree on every number above:
    geometry rtol 1e-4, losses 1e-4 nats; the bridge also agrees with an independent Hugging Face recomputation."""
    bridge = ts.load_model("gemma-3-270m", backend="bridge")
    assert torch.equal(ts.text_tokens(bridge, n_windows=2, length=64), gemma_tokens)
    other = _every_protocol(bridge, gemma_tokens)
    assert sorted(other) == sorted(every_protocol)
    problems = _disagreements(every_protocol, other)
    assert not problems, "\n".join(problems)
    _check_against_hf(bridge, gemma_tokens, [0, 5])
