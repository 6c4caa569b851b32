"""Bad input gets a clear error naming what is wrong and what to do; the model stays intact."""

import pytest
import torch

import tl_steering as ts
from tl_steering import errors as E
from tl_steering.backends import adapt, hooked_available, weights_fingerprint
from tests.helpers import assert_no_hooks

from ._calls import FORWARD_CALLS, PUBLIC_CALLS, tokens_for

# calls that take a token batch (all but parallelize, which takes layers and returns a model)
TOKEN_CALLS = [k for k in FORWARD_CALLS if k not in ("parallelize", "probe") and not k.startswith("hooks.")]


@pytest.fixture(scope="module")
def model():
    return ts.tiny_model("gpt2", backend="bridge", seed=0)


@pytest.fixture(scope="module")
def neox():
    return ts.tiny_model("neox", backend="bridge", seed=0)


@pytest.mark.parametrize("name", list(PUBLIC_CALLS))
def test_not_a_transformerlens_model(name):
    with pytest.raises(E.ModelNotSupportedError, match="HookedTransformer or TransformerBridge"):
        PUBLIC_CALLS[name](torch.nn.Linear(4, 4), torch.zeros(2, 8, dtype=torch.long))


@pytest.mark.parametrize("name", TOKEN_CALLS)
@pytest.mark.parametrize("bad,match", [
    (torch.zeros(0, 8, dtype=torch.long), "empty batch"),
    (torch.zeros(2, 1, dtype=torch.long), "too short"),
    (torch.zeros(2, 8), "integer ids"),
    (torch.full((2, 8), 10_000), "must lie in"),
    ("some text", "torch.Tensor"),
])
def test_bad_tokens(model, name, bad, match):
    before = weights_fingerprint(model)
    with pytest.raises((E.InputError, E.TLSteeringError), match=match):
        PUBLIC_CALLS[name](model, bad)
    assert weights_fingerprint(model) == before


@pytest.mark.parametrize("name", TOKEN_CALLS)
def test_tokens_on_another_device(model, name):
    tokens = tokens_for(model).to("meta")  # the one other device of a CPU-only machine: shapes, no values
    with pytest.raises(E.DeviceMismatchError, match="tokens are on the 'meta' device: a meta tensor has a shape"):
        PUBLIC_CALLS[name](model, tokens)


def test_layer_out_of_range(model):
    t = tokens_for(model)
    for call in (lambda: ts.angular_deficit(model, t, layers=[7]), lambda: ts.critical_points(model, 9, n_starts=2, tokens=t),
                 lambda: ts.prefix_sensitivity(model, t, layer=-9, position=3), lambda: ts.parallelize(model, [2]),
                 lambda: ts.hooks.ffn_gate(model, {5: 1.0}), lambda: ts.parallel_defect(model, t, layers=[3], timing=False)):
        with pytest.raises(E.LayerIndexError, match="out of range"):
            call()


def test_parallel_model_has_no_resid_mid(neox):
    ad = adapt(neox)
    with pytest.raises(E.ParallelBlockError, match="no resid_mid"):
        ad.hook_name(0, "resid_mid")
    # everything else treats the FFN input as resid_pre on parallel blocks, so the protocols run
    res = ts.angular_deficit(neox, tokens_for(neox), n_bootstrap=10)
    assert torch.isfinite(res.deficit).all()


def test_missing_and_never_firing_hooks(model):
    ad = adapt(model)
    # hook_mlp_in is listed in hook_dict but does not fire unless use_hook_mlp_in is on
    with pytest.raises(E.HookNotFoundError, match="never fire"):
        ad.run_with_cache(tokens_for(model), ["blocks.0.hook_mlp_in"])


@pytest.mark.skipif(not hooked_available(), reason="attention-only models: HookedTransformer (TL 3.x) only")
def test_attention_only_model_named_when_the_ffn_is_measured():
    """An attention-only model (TL's attn-only-2l kind) has no FFN: a measurement that hooks it says so before its
    forward (before, the mlp hooks never fired, or autograd found the gate unused); the probe still measures its
    attention (FFN quantities NaN)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    import tl_steering as ts

    model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=32, n_ctx=32, d_head=8, n_heads=4,
                                                      d_vocab=50, attn_only=True, normalization_type="LN"))
    tokens = torch.randint(1, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    for call in (ts.parallel_defect, ts.ffn_ablation, ts.calibrate_gates):  # hooks reading / changing the FFN output
        with pytest.raises(E.ModelNotSupportedError, match="no MLP blocks .cfg.attn_only."):
            call(model, tokens)
    assert_no_hooks(model)
    with ts.probe(model) as trace:
        model(tokens)
    res = trace.result()
    assert torch.isnan(res.get("radial_coef_ffn")).all() and torch.isfinite(res.get("radial_coef_attn")).all()


def test_nan_in_activations_names_layer_and_site(model):
    t = tokens_for(model)

    def poison(act, hook):
        act = act.clone()
        act[0, 3, 0] = float("nan")
        return act

    model.add_hook("blocks.1.hook_attn_out", poison, is_permanent=True)
    try:
        with pytest.raises(E.NonFiniteError, match="layer 1"):
            ts.angular_deficit(model, t, n_bootstrap=10)
    finally:
        model.reset_hooks(including_permanent=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_give_float64_geometry(dtype):
    m = ts.tiny_model("llama", backend="bridge", seed=0).to(dtype)
    assert adapt(m).dtype == dtype
    t = tokens_for(m)
    res = ts.angular_deficit(m, t, n_bootstrap=10)
    assert res.deficit.dtype == torch.float64 and torch.isfinite(res.deficit).all()
    ref = ts.angular_deficit(ts.tiny_model("llama", backend="bridge", seed=0), t, n_bootstrap=10)
    assert (res.deficit - ref.deficit).abs().max() < 0.05  # half precision forward, same geometry to ~1e-2
    logits = m.run_with_hooks(t, fwd_hooks=ts.hooks.ffn_component(m, "tangential"))
    assert logits.dtype == dtype and torch.isfinite(logits).all()  # written back in the model dtype


def test_zero_norm_residuals_are_masked_not_nan():
    from tl_steering import geometry as geo

    x = torch.randn(2, 5, 8)
    x[0, 2] = 0.0
    u = geo.normalize(x)
    assert torch.isfinite(u).all() and u[0, 2].abs().max() == 0
    assert geo.degenerate_mask(x)[0, 2] and geo.degenerate_mask(x).sum() == 1
    assert torch.isfinite(geo.tangential_part(torch.randn(2, 5, 8), x)).all()


def test_bad_options(model):
    t = tokens_for(model)
    with pytest.raises(E.InputError, match="keep"):
        ts.hooks.ffn_component(model, keep="sideways")
    with pytest.raises(E.InputError, match="processing"):
        ts.load_model("smollm2-135m", processing="folded")
    with pytest.raises(E.InputError, match="backend"):
        ts.load_model("smollm2-135m", backend="jax")
    with pytest.raises(E.InputError):
        ts.hooks.ffn_gate(model, [1.0])
    with pytest.raises(E.InputError):
        ts.hooks.attention_gain(model, float("nan"))
    with pytest.raises(E.InputError):
        ts.ffn_ablation(model, t, scope="everything")
