"""Unit tests of tl_steering.critical on the tiny models (every arch x backend), docs/critical_points.md.

Everything is float64 on a private copy of one block; tolerances are stated per comparison.
"""

import plotly.graph_objects as go
import pytest
import torch

import tl_steering as ts

from tests.helpers import hook_count
from tl_steering.backends import adapt, weights_fingerprint
from tl_steering.backends.field64 import Float64Block
from tl_steering.critical import (
    CriticalPointsResult,
    EquilibriaResult,
    critical_field,
    critical_points,
    relative_residual,
)
from tl_steering.errors import InputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

F64 = torch.float64
FAST = {"max_iter": 30, "landscape_solves": 32}  # keeps each finder call ~1-3 s on the tiny models


def _rand_unit(d: int, seed: int, n: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(n, d, generator=g, dtype=F64)
    return u / u.norm(dim=-1, keepdim=True)


def test_float64_block_reproduces_the_model_and_is_exact(tiny):
    """Float64Block: ffn/attention equal the adapter's float32 callables to float32 rounding (rel. 1e-6 measured
    ~3e-7), and are float64 all the way through: central differences at h = 1e-6 match the JVP to 1e-7 (one
    float32 step inside would give ~1e-2). No process-wide patch: F.softmax is the same object afterwards."""
    softmax = torch.nn.functional.softmax
    ad = adapt(tiny)
    blk = Float64Block(ad, 1)
    g = torch.Generator().manual_seed(0)
    x = 5 * torch.randn(2, 7, ad.d_model, generator=g, dtype=F64)
    with torch.no_grad():
        ref_f = ad.ffn(1)(x.to(ad.dtype)).to(F64)
        ref_a = ad.attention(1)(x.to(ad.dtype)).to(F64)
    got_f, got_a = blk.ffn(x), blk.attention(x)
    assert got_f.dtype == got_a.dtype == F64
    assert float((got_f - ref_f).norm() / ref_f.norm()) < 1e-6
    assert float((got_a - ref_a).norm() / ref_a.norm()) < 1e-6
    u, v, h = x[0, 0], x[1, 0], 1e-6
    fd = (blk.ffn(u + h * v) - blk.ffn(u - h * v)) / (2 * h)
    jv = torch.func.jvp(blk.ffn, (u,), (v,))[1]
    assert float((fd - jv).norm() / jv.norm()) < 1e-7
    fa = lambda y: blk.attention(y[None])[0]  # noqa: E731
    fd = (fa(x[0] + h * x[1]) - fa(x[0] - h * x[1])) / (2 * h)
    jv = torch.func.jvp(fa, (x[0],), (x[1],))[1]
    assert float((fd - jv).norm() / jv.norm()) < 1e-7
    assert torch.nn.functional.softmax is softmax
    assert not blk.has_post_ffn_norm  # pre-norm tiny models
    assert hook_count(tiny) == 0


def _structured_against_jacrev(model, expect_structured: bool) -> None:
    """Float64Block.ffn_jacobian (the MLP's own matrices) against torch.func.jacrev of the float64 FFN, both float64
    at 3 random points: equal to 1e-12 relative (measured ~1e-15); the finder's Jacobians (_FieldAdapter.jacobians,
    structured or autograd) equal jacrev of the field to the same tolerance, and in float32 to float32 rounding."""
    from tl_steering.critical.fields import _FieldAdapter

    blk = Float64Block(adapt(model), 0)
    x = 4.0 * _rand_unit(blk.d_model, 5)
    jac = blk.ffn_jacobian(x)
    assert (jac is not None) == expect_structured
    ref = torch.func.vmap(torch.func.jacrev(blk.ffn))(x)
    if jac is not None:
        assert float((jac - ref).abs().max()) <= 1e-12 * float(ref.abs().max())
    fld = critical_field(model, 0)
    ad = _FieldAdapter(fld, fld.dim, F64, torch.device("cpu"))
    ad.probe(x[:2] / 4.0)
    want = torch.func.vmap(torch.func.jacrev(fld))(x / 4.0)
    assert float((ad.jacobians(x / 4.0) - want).abs().max()) <= 1e-12 * float(want.abs().max())
    low = ad.jacobians(x / 4.0, dtype=torch.float32)  # float32 (the landscape's early Newton steps): within the
    bound = model.cfg.d_mlp * 2.0 ** -24 * float(want.abs().max())  # rounding bound of a d_mlp-term float32 sum
    assert low.dtype == torch.float32 and float((low.double() - want).abs().max()) <= bound  # measured <= 6e-7 rel


def test_structured_ffn_jacobian(tiny):
    """Gated Hugging Face MLPs (bridge llama) and every HookedTransformer MLP take the structured path (RMS
    pre-norm folded on llama); the bridge's GPT-2 and NeoX MLPs are differentiated by autograd."""
    from tl_steering.backends.sublayers import unwrap

    blk = adapt(tiny).model.blocks[0]
    _structured_against_jacrev(tiny, adapt(tiny).backend == "hooked" or hasattr(unwrap(blk.mlp), "gate_proj"))


def test_structured_ffn_jacobian_post_ffn_norm():
    """Gemma 3 (bridge): RMS pre-norm with weight 1 + w folded, the post-FFN norm's Jacobian composed."""
    _structured_against_jacrev(ts.tiny_model("gemma3", backend="bridge", seed=0), True)


def test_ffn_field_equals_model_ffn(tiny, tiny_tokens):
    """F(u) = Phi(ρu): the float64 copy agrees with the model's own (float32) ad.ffn to float32 rounding."""
    ad = adapt(tiny)
    fld = critical_field(tiny, 1, "ffn", tokens=tiny_tokens)
    u = _rand_unit(ad.d_model, 1)
    got = fld(u)
    assert got.dtype == F64
    with torch.no_grad():
        ref = ad.ffn(1)((fld.radius * u).to(ad.dtype)[None])[0].to(F64)
    assert float((got - ref).norm() / ref.norm()) < 1e-5
    # ρ = median ||FFN input|| over positions >= 1
    _, cache = ad.run_with_cache(tiny_tokens, [ad.hook_name(1, "ffn_input")])
    rho = cache[ad.hook_name(1, "ffn_input")][:, 1:].to(F64).norm(dim=-1).median()
    assert fld.radius == pytest.approx(float(rho), rel=1e-12)


@pytest.mark.parametrize("kind", ["attention", "block"])
def test_attention_field_is_attention_on_modified_matrix(tiny, tiny_tokens, kind):
    """F_i(u) = row i of ad.attention(X') with X' = resid_pre[seq, :i+1] whose row i is ρu (+ Phi(ρu) for block)."""
    ad = adapt(tiny)
    i = 9
    fld = critical_field(tiny, 1, kind, tokens=tiny_tokens, token_index=i, sequence=1)
    _, cache = ad.run_with_cache(tiny_tokens, [ad.hook_name(1, "resid_pre")])
    x = cache[ad.hook_name(1, "resid_pre")][1, : i + 1].to(F64)
    assert fld.radius == pytest.approx(float(cache[ad.hook_name(1, "resid_pre")][:, 1:].to(F64).norm(dim=-1).median()))
    u = _rand_unit(ad.d_model, 2)
    got = fld(u)
    for r in range(u.shape[0]):
        xm = x.clone()
        xm[i] = fld.radius * u[r]
        with torch.no_grad():
            ref = ad.attention(1)(xm[None].to(ad.dtype))[0, i].to(F64)
            if kind == "block":
                ref = ref + ad.ffn(1)((fld.radius * u[r]).to(ad.dtype)[None, None])[0, 0].to(F64)
        assert float((got[r] - ref).norm() / ref.norm()) < 2e-5, r
    # the single-vector call agrees with the batched one
    assert torch.allclose(fld(u[0]), got[0], rtol=1e-12, atol=1e-14)
    # the clean row is reproduced: u = direction of x_i at ρ = ||x_i|| gives the model's attn_out row
    fld_i = critical_field(tiny, 1, "attention", tokens=tiny_tokens, token_index=i, sequence=1,
                           radius=float(x[i].norm()))
    _, c2 = ad.run_with_cache(tiny_tokens, [ad.hook_name(1, "attn_out")])
    a_model = c2[ad.hook_name(1, "attn_out")][1, i].to(F64)
    assert float((fld_i(x[i] / x[i].norm()) - a_model).norm() / a_model.norm()) < 2e-5


def test_field_is_float64_exact(tiny, tiny_tokens):
    """Central differences at h = 1e-6 match the JVP to ~1e-8: no float32 step inside the field (HF RMSNorm and
    float32 softmax are made float64 on the copy). A float32 step would give errors of order 1e-2..1."""
    ad = adapt(tiny)
    fld = critical_field(tiny, 1, "block", tokens=tiny_tokens, token_index=7)
    u = _rand_unit(ad.d_model, 3, n=1)
    v = _rand_unit(ad.d_model, 4, n=1)
    h = 1e-6
    fd = (fld(u + h * v) - fld(u - h * v)) / (2 * h)
    jv = torch.func.jvp(fld, (u,), (v,))[1]
    assert float((fd - jv).norm() / jv.norm()) < 1e-6


def test_radius_matters_through_ln_eps(tiny, tiny_tokens):
    """At ||x|| = 1 the LN/RMS eps is not negligible (variance 1/d ~ 1.6e-2 against eps = 1e-5 or 1e-6): F at ρ = 1
    differs from F at ρ = median; at large norms eps is negligible and the field is scale invariant."""
    ad = adapt(tiny)
    u = _rand_unit(ad.d_model, 5)
    f_med = critical_field(tiny, 0, "ffn", tokens=tiny_tokens)
    f_one = f_med.with_radius(1.0)
    rel = float((f_med(u) - f_one(u)).norm() / f_med(u).norm())
    assert rel > 1e-5, rel
    big1, big2 = f_med.with_radius(1e3), f_med.with_radius(2e3)
    assert float((big1(u) - big2(u)).norm() / big1(u).norm()) < 1e-6


def _check_ffn_points(model, tokens, layer, **kw):
    ad = adapt(model)
    fp = weights_fingerprint(model)
    out = critical_points(model, layer, "ffn", n_starts=8, tokens=tokens, **kw)
    assert isinstance(out, CriticalPointsResult) and out.layers == [layer]
    res = out.result(layer)
    assert isinstance(res, EquilibriaResult)
    assert res.n_points >= 1
    assert float(res.residuals.max()) <= 1e-10
    # the points are equilibria of the model's own FFN at ρu* too (float32 field: residual ~1e-6)
    fld = critical_field(model, layer, "ffn", tokens=tokens)
    with torch.no_grad():
        f32 = ad.ffn(layer)((fld.radius * res.points).to(ad.dtype)[None])[0].to(F64)
    assert float(relative_residual(res.points, f32).max()) < 1e-4
    assert res.options["layer"] == layer and res.options["field"] == "ffn"
    assert res.options["radius"] == pytest.approx(fld.radius)
    assert res.options["n_token_starts"] == 4
    assert res.provenance.backend == ad.backend and res.provenance.n_tokens == tokens.numel()
    assert res.provenance.extra["field"] == "ffn"
    assert weights_fingerprint(model) == fp
    assert hook_count(model) == 0
    return res


def test_ffn_critical_points_converge(tiny, tiny_tokens):
    """The FFN field's equilibria are found to relative residual <= 1e-10 on every tiny arch x backend."""
    _check_ffn_points(tiny, tiny_tokens, 0, options=FAST)


def test_user_hooks_kept_and_ignored(tiny, tiny_tokens):
    """A user's hook inside the block neither leaks into the field nor gets removed."""
    ad = adapt(tiny)
    u = _rand_unit(ad.d_model, 6)
    before = critical_field(tiny, 1, "ffn", tokens=tiny_tokens, radius=3.0)(u)
    name = ad.hook_name(1, "mlp_out")
    handle_fn = lambda act, hook: act * 0.0  # noqa: E731
    tiny.add_hook(name, handle_fn)
    try:
        after = critical_field(tiny, 1, "ffn", tokens=tiny_tokens, radius=3.0)(u)
        assert torch.equal(before, after)
        assert len(tiny.hook_dict[name]._forward_hooks) == 1
    finally:
        tiny.reset_hooks()


def test_attention_field_and_radius_scales(tiny_tokens):
    import tl_steering as ts

    model = ts.tiny_model("llama", backend="bridge", seed=0)
    fp = weights_fingerprint(model)
    res = critical_points(model, 0, "attention", n_starts=4, tokens=tiny_tokens, token_index=5,
                          radius_scales=(0.5, 1, 2), options=FAST).results[0]
    assert res.n_points >= 1 and float(res.residuals.max()) <= 1e-10
    sens = res.options["radius_sensitivity"]
    assert set(sens) == {"0.5", "1", "2"}
    assert sens["1"]["n_points"] == res.n_points  # re-running at the same ρ from the points finds them all
    assert sens["1"]["counts"] == res.counts()
    assert sens["2"]["radius"] == pytest.approx(2 * res.options["radius"])
    assert res.options["token_index"] == 5 and res.options["sequence"] == 0
    assert weights_fingerprint(model) == fp and hook_count(model) == 0


def test_the_landscape_phase_is_capped_on_a_model(tiny_tokens):
    """critical_points' default on a model: the one finder with DEFAULT_OPTIONS, whose landscape phase runs at most
    40 Newton solves; a landscape_solves in options wins, and the rows run never exceed it."""
    import tl_steering as ts
    from tl_steering.critical import DEFAULT_OPTIONS

    model = ts.tiny_model("gpt2", backend="bridge", seed=0)
    res = critical_points(model, 0, n_starts=4, tokens=tiny_tokens, options={"max_iter": 30}).results[0]
    assert res.method == "landscape" and DEFAULT_OPTIONS.landscape_solves == 40
    assert res.options["landscape_solves"] == 40 and res.options["landscape_rows"] <= 40
    few = critical_points(model, 0, n_starts=4, tokens=tiny_tokens, options={"max_iter": 30, "landscape_solves": 2})
    assert few.results[0].options["landscape_solves"] == 2 and few.results[0].options["landscape_rows"] <= 2


def test_all_layers_summary(tmp_path, tiny_tokens):
    import tl_steering as ts

    model = ts.tiny_model("gpt2", backend="bridge", seed=0)
    s = critical_points(model, n_starts=4, tokens=tiny_tokens, options=FAST)
    assert isinstance(s, CriticalPointsResult)
    assert s.layers == [0, 1] and tuple(s.counts.shape) == (2, 4)
    assert s.counts.sum(1).tolist() == s.n_points.tolist() == [r.n_points for r in s.results]
    assert (s.seconds > 0).all()
    summ = s.summary()
    assert summ["equilibria"] == int(s.counts.sum())
    # the starts asked for, not the rows the finder added; one type per key
    assert summ["starts_per_layer"] == 4 and summ["solver_rows"] == int(s.n_starts.sum()) >= 2 * 4
    assert all(isinstance(k, int) and isinstance(v, int) for k, v in summ["morse_histogram"].items())
    assert isinstance(summ["missed_at_least"], float) and isinstance(summ["saddle_share"], float)
    assert isinstance(s.plot(), go.Figure)
    assert set(summ["mostly_saddles_in_found_set"].split()) <= {"supported", "rejected", "undecided", "no", "equilibria"}
    back = CriticalPointsResult.load(s.save(tmp_path / "crit.json"))
    assert torch.equal(back.counts, s.counts) and back.results[0].labels == s.results[0].labels


def test_bad_inputs(tiny_tokens):
    import tl_steering as ts

    model = ts.tiny_model("gpt2", backend="bridge", seed=0)
    with pytest.raises(InputError, match="field"):
        critical_points(model, 0, field="mlp", tokens=tiny_tokens)
    with pytest.raises(InputError, match="radius"):
        critical_points(model, 0, radius=-1.0, tokens=tiny_tokens)
    with pytest.raises(InputError, match="radius"):
        critical_points(model, 0, radius="mean", tokens=tiny_tokens)
    with pytest.raises(InputError, match="token_index"):
        critical_points(model, 0, field="attention", token_index=99, tokens=tiny_tokens)
    with pytest.raises(InputError, match="radius_scales"):
        critical_points(model, 0, radius_scales=(0.0,), tokens=tiny_tokens)
    with pytest.raises(TypeError, match="starts"):  # critical_points chooses its starts itself
        critical_points(model, 0, starts=torch.ones(1, 64), tokens=tiny_tokens)
    with pytest.raises(InputError, match="unknown finder options"):
        critical_points(model, 0, tokens=tiny_tokens, options={"method": "lm"})


def test_no_grad_field_equals_field(tiny, tiny_tokens):
    """The recorded float64 FFN of the first-order phases gives the eager field's values (1e-12 relative) on
    batches of sizes it was not recorded with; recording works on every tiny arch x backend."""
    fld = critical_field(tiny, 0, "ffn", tokens=tiny_tokens)
    for n in (1, 4, 7):
        u = _rand_unit(fld.dim, n, n)
        want = fld(u)
        got = fld.evaluate_no_grad(u)
        assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())
    assert fld.block._traced is not False
    assert hook_count(tiny) == 0


def test_the_finder_on_a_model_finds_equilibria_of_its_own_ffn():
    """critical_points on a tiny model (d = 64): its points are equilibria of the model's own float32 FFN, the result
    says which sample it is, and the model keeps its weights and hooks."""
    model = ts.tiny_model("gpt2", backend="bridge", seed=0)
    tokens = torch.randint(1, 257, (3, 16), generator=torch.Generator().manual_seed(0))
    fp = weights_fingerprint(model)
    out = critical_points(model, 0, "ffn", n_starts=4, tokens=tokens, options=FAST)
    res = out.result(0)
    assert res.n_points >= 1 and float(res.residuals.max()) <= 1e-10
    ad = adapt(model)
    fld = critical_field(model, 0, "ffn", tokens=tokens)
    with torch.no_grad():
        f32 = ad.ffn(0)((fld.radius * res.points).to(ad.dtype)[None])[0].to(F64)
    assert float(relative_residual(res.points, f32).max()) < 1e-4
    s = out.sample()
    assert s["methods"] == ["landscape"] and s["token_starts_per_layer"] == [2] and "solution landscape" in s["note"]
    assert res.options["power_rows"] == 8 and res.options["landscape_jacobians"] >= 0
    assert weights_fingerprint(model) == fp and hook_count(model) == 0


def test_without_tokens_the_provenance_names_the_corpus_drawn():
    """No tokens passed: the call draws pydoc windows and its provenance says so (not 'user tokens')."""
    model = ts.tiny_model("gpt2", backend="bridge", seed=0)
    s = critical_points(model, layers=[0], n_starts=2, options=FAST)
    assert s.provenance.corpus == "pydoc:4x64:seed0" and s.provenance.n_sequences == 4
    assert s.results[0].provenance.corpus == "pydoc:4x64:seed0"
