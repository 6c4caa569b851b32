"""Adapter: hook names, parallel detection, pure sublayer callables, identity check, hook hygiene."""

import pytest
import torch

import tl_steering as ts
from tests.helpers import assert_no_hooks
from tl_steering.backends import adapt, hook_guard, hooked_available, weights_fingerprint
from tl_steering.errors import (
    InputError,
    LayerIndexError,
    ModelNotSupportedError,
    ParallelBlockError,
    ResidualIdentityError,
)


def test_hook_names_and_ffn_input_site(tiny):
    ad = adapt(tiny)
    arch = ad.info.name.removeprefix("tiny-")
    parallel = arch == "neox"
    assert [ad.is_parallel(l) for l in range(ad.n_layers)] == [parallel] * ad.n_layers
    for layer in range(ad.n_layers):
        assert ad.hook_name(layer, "resid_pre") == f"blocks.{layer}.hook_resid_pre"
        assert ad.hook_name(layer, "attn_out") == f"blocks.{layer}.hook_attn_out"
        assert ad.hook_name(layer, "mlp_out") == f"blocks.{layer}.hook_mlp_out"
        assert ad.hook_name(layer, "resid_post") == f"blocks.{layer}.hook_resid_post"
        assert ad.hook_name(layer, "ln2_normalized") == f"blocks.{layer}.ln2.hook_normalized"
        if parallel:
            assert ad.ffn_input_site(layer) == "resid_pre"
            assert ad.hook_name(layer, "ffn_input") == f"blocks.{layer}.hook_resid_pre"
            with pytest.raises(ParallelBlockError, match="parallel attention/MLP block"):
                ad.hook_name(layer, "resid_mid")
            with pytest.raises(ParallelBlockError):
                ad.hook_name(layer, "mlp_in")
        else:
            assert ad.ffn_input_site(layer) == "resid_mid"
            assert ad.hook_name(layer, "ffn_input") == f"blocks.{layer}.hook_resid_mid"
            assert ad.hook_name(layer, "mlp_in") == f"blocks.{layer}.hook_mlp_in"


def test_pure_callables_reproduce_cache(tiny, tiny_tokens):
    """attention(layer)(resid_pre) == attn_out and ffn(layer)(ffn_input) == mlp_out to 1e-5 (fp32)."""
    ad = adapt(tiny)
    _, cache = tiny.run_with_cache(tiny_tokens)
    for layer in range(ad.n_layers):
        x = cache[ad.hook_name(layer, "resid_pre")]
        a = ad.attention(layer)(x)
        ref_a = cache[ad.hook_name(layer, "attn_out")]
        assert (a - ref_a).abs().max() <= 1e-5 * ref_a.abs().max()
        y = cache[ad.hook_name(layer, "ffn_input")]
        phi = ad.ffn(layer)(y)
        ref_phi = cache[ad.hook_name(layer, "mlp_out")]
        assert (phi - ref_phi).abs().max() <= 1e-5 * ref_phi.abs().max()
        # positionwise: a single vector and a [pos, d] matrix give the same rows
        assert torch.allclose(ad.ffn(layer)(y[0, 3]), phi[0, 3], atol=1e-6)
        assert torch.allclose(ad.ffn(layer)(y[1]), phi[1], atol=1e-6)
    assert_no_hooks(tiny)


def test_ffn_callable_works_under_torch_func(tiny, tiny_tokens):
    ad = adapt(tiny)
    _, cache = tiny.run_with_cache(tiny_tokens)
    y = cache[ad.hook_name(0, "ffn_input")][0, 1:4]
    phi = ad.ffn(0)
    v = torch.randn_like(y)
    _, jv = torch.func.jvp(phi, (y,), (v,))
    eps = 1e-3
    fd = (phi(y + eps * v) - phi(y - eps * v)) / (2 * eps)
    assert (jv - fd).abs().max() <= 2e-2 * fd.abs().max()
    jac = torch.func.jacfwd(phi)(y[0])
    assert jac.shape == (ad.d_model, ad.d_model)
    assert torch.allclose(jac @ v[0], jv[0], rtol=1e-4, atol=1e-5)
    batched = torch.func.vmap(phi)(y)
    assert torch.allclose(batched, phi(y), atol=1e-6)


def test_user_hooks_do_not_fire_inside_pure_callables(tiny, tiny_tokens):
    """A permanent steering hook of the user's must not contaminate Phi or a Jacobian, and must survive."""
    ad = adapt(tiny)
    _, cache = tiny.run_with_cache(tiny_tokens)
    y = cache[ad.hook_name(0, "ffn_input")]
    clean = ad.ffn(0)(y)
    calls = []

    def steer(act, hook):
        calls.append(hook.name)
        return act * 0.0

    tiny.add_hook("blocks.0.mlp.hook_post", steer, is_permanent=True)
    tiny.add_hook("blocks.0.ln1.hook_normalized", steer, is_permanent=True)
    try:
        assert torch.equal(ad.ffn(0)(y), clean)
        a = ad.attention(0)(cache["blocks.0.hook_resid_pre"])
        assert torch.allclose(a, cache["blocks.0.hook_attn_out"], atol=1e-5)
        assert calls == []
        tiny(tiny_tokens)  # the hooks are still attached and fire in a normal forward
        assert len(calls) >= 2
    finally:
        tiny.reset_hooks(including_permanent=True)
    assert_no_hooks(tiny)


def test_identity_check_passes_and_fails_loudly(tiny, tiny_tokens):
    ad = adapt(tiny)
    _, cache = ad.run_with_cache(tiny_tokens, ad.identity_names())
    errs = ad.check_residual_identity(cache)
    assert max(errs.values()) < 1e-6
    broken = dict(cache)
    name = ad.hook_name(1, "mlp_out")
    broken[name] = broken[name] * 1.01 + 0.1
    with pytest.raises(ResidualIdentityError, match="layer 1"):
        ad.check_residual_identity(broken)


def test_identity_check_catches_a_rewriting_hook(tiny, tiny_tokens):
    """A deliberately broken hook: hook_mlp_out reports one value but the residual gets another."""
    ad = adapt(tiny)
    names = ad.identity_names()
    store = {}

    def save(name):
        def fn(act, hook):
            store[name] = act.detach().clone()
        return fn

    def report_wrong(act, hook):  # observe-only hook that records a corrupted copy
        store["blocks.0.hook_mlp_out"] = act.detach() + 1.0

    hooks = [(n, save(n)) for n in names] + [("blocks.0.hook_mlp_out", report_wrong)]
    ad.run_with_hooks(tiny_tokens, hooks)
    with pytest.raises(ResidualIdentityError, match="layer 0"):
        ad.check_residual_identity(store)
    assert_no_hooks(tiny)


def test_hook_guard_removes_hooks_even_on_error_and_keeps_user_hooks(tiny, tiny_tokens):
    kept = []
    tiny.add_hook("blocks.0.hook_resid_pre", lambda act, hook: kept.append(1), is_permanent=True)
    before = weights_fingerprint(tiny)
    try:
        for exc in (RuntimeError("boom"), KeyboardInterrupt()):
            def bad(act, hook, exc=exc):
                raise exc

            with pytest.raises(type(exc)):
                with hook_guard(tiny):
                    tiny.add_hook("blocks.1.hook_resid_post", bad)
                    tiny(tiny_tokens)
            assert len(tiny.hook_dict["blocks.1.hook_resid_post"].fwd_hooks) == 0
            assert len(tiny.hook_dict["blocks.0.hook_resid_pre"].fwd_hooks) == 1
        assert weights_fingerprint(tiny) == before
    finally:
        tiny.reset_hooks(including_permanent=True)


def test_hook_guard_restores_the_hook_points_it_recorded_and_one_made_inside(tiny):
    """The restore's fast path skips modules with no hook then and none now, and still puts back a HookPoint's
    swapped hook dict and clears a handle TL lists without its hook, on a HookPoint recorded at entry and on one
    made inside the block."""
    from transformer_lens.hook_points import HookPoint

    hp = tiny.hook_dict["blocks.0.hook_resid_pre"]
    orig = hp._forward_hooks
    made = HookPoint()
    try:
        with hook_guard(tiny):
            tiny.blocks[0].extra_point = made  # a submodule: the restore's walk finds it
            for point in (hp, made):
                point.add_hook(lambda act, hook: None)
                point.fwd_hooks[0].hook.remove()  # the torch hook gone, TL's handle still listed
                assert point.fwd_hooks and not point._forward_hooks
            hp._forward_hooks = type(orig)()  # an empty dict swapped in
        assert hp._forward_hooks is orig and not hp.fwd_hooks and not made.fwd_hooks
    finally:
        if hasattr(tiny.blocks[0], "extra_point"):
            del tiny.blocks[0].extra_point
        hp._forward_hooks = orig
        tiny.reset_hooks(including_permanent=True)


def test_dtype_device_from_parameters(tiny):
    ad = adapt(tiny)
    assert ad.dtype == torch.float32
    assert ad.device == torch.device("cpu")


def test_bad_inputs(tiny):
    ad = adapt(tiny)
    with pytest.raises(ModelNotSupportedError, match="HookedTransformer or TransformerBridge"):
        adapt(torch.nn.Linear(2, 2))
    with pytest.raises(LayerIndexError, match="out of range"):
        ad.hook_name(5, "resid_pre")
    with pytest.raises(InputError, match="unknown site"):
        ad.hook_name(0, "resid_middle")
    with pytest.raises(InputError, match="empty batch"):
        ad.validate_tokens(torch.zeros(0, 5, dtype=torch.long))
    with pytest.raises(InputError, match="too short"):
        ad.validate_tokens(torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(InputError, match="integer ids"):
        ad.validate_tokens(torch.zeros(2, 4))
    with pytest.raises(InputError, match=r"must lie in \[0, 257\)"):
        ad.validate_tokens(torch.full((1, 4), 300))


def test_same_weights_both_backends_agree(tiny_tokens):
    """HookedTransformer and TransformerBridge built from the same HF weights agree (rtol 1e-4)."""
    if not hooked_available():
        pytest.skip("TransformerLens 4.x has no HookedTransformer: nothing to compare with the bridge")
    for arch in ("gpt2", "llama", "neox"):
        b = ts.tiny_model(arch, backend="bridge", seed=3)
        h = ts.tiny_model(arch, backend="hooked", seed=3)
        lb, cb = b.run_with_cache(tiny_tokens)
        lh, ch = h.run_with_cache(tiny_tokens)
        assert torch.allclose(lb, lh, rtol=1e-4, atol=1e-5), arch
        for layer in range(2):
            for site in ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post"):
                k = f"blocks.{layer}.{site}"
                assert torch.allclose(cb[k], ch[k], rtol=1e-4, atol=1e-5), (arch, k)


def test_hooked_backend_on_tl4_is_a_clear_error():
    if hooked_available():
        pytest.skip("TransformerLens 3.9 has HookedTransformer: the TL 4.x error path does not apply")
    with pytest.raises(ModelNotSupportedError, match="transformer-lens 3.9"):
        ts.tiny_model("gpt2", backend="hooked")
    with pytest.raises(ModelNotSupportedError, match="use backend='bridge'|Use backend='bridge'"):
        ts.load_model("smollm2-135m", backend="hooked")


def test_tl_processing_changes_geometry_not_logits(tiny_tokens):
    """processing='tl' (LN folded, centred writes) keeps logits but moves residual vectors (GPT-2 arch)."""
    raw = ts.tiny_model("gpt2", backend="bridge", seed=1)
    tl = ts.tiny_model("gpt2", backend="bridge", seed=1, processing="tl")
    lr, cr = raw.run_with_cache(tiny_tokens)
    lt, ct = tl.run_with_cache(tiny_tokens)
    assert torch.allclose(torch.log_softmax(lr, -1), torch.log_softmax(lt, -1), atol=1e-4)
    k = "blocks.1.hook_resid_pre"
    assert (cr[k] - ct[k]).abs().max() > 1e-3  # centring changed the residual vectors
    assert ct[k].mean(-1).abs().max() < 1e-4  # ... by removing their mean over d_model


def test_tiny_model_is_deterministic():
    a = ts.tiny_model("llama", seed=7)
    b = ts.tiny_model("llama", seed=7)
    c = ts.tiny_model("llama", seed=8)
    assert weights_fingerprint(a) == weights_fingerprint(b)
    assert weights_fingerprint(a) != weights_fingerprint(c)


def test_shared_clean_forwards_run_once_and_give_the_same_numbers(tiny, tiny_tokens):
    """Inside shared_clean_forwards a hook-free forward of a batch seen before runs no forward and returns copies of
    the first one's logits and activations, equal to a fresh forward's; a batch of windows a kept run holds (in any
    order) is cut from it (equal to its own forward up to float32 rounding); hooked forwards and other batches run; a
    batch over the budget runs as an ordinary forward each time."""
    from tl_steering._util.progress import reporting
    from tl_steering.backends.adapter import shared_clean_forwards
    from tl_steering.hooks import attention_gain

    ad = adapt(tiny)
    name = ad.hook_name(1, "resid_post")
    fresh_logits, fresh = ad.run_with_cache(tiny_tokens, [name])
    fresh_row, fresh_part = ad.run_with_cache(tiny_tokens[1:2], [name])
    assert tiny_tokens.shape[0] > 2
    for budget, runs in ((1 << 30, 3), (0, 5)):
        with shared_clean_forwards(tiny, max_bytes=budget), reporting(lambda _: None) as fw:
            logits = ad.run_with_hooks(tiny_tokens, [])
            logits[:] = 0  # a caller writing into its copy changes nothing shared
            again, cache = ad.run_with_cache(tiny_tokens, [name])
            ad.run_with_hooks(tiny_tokens, attention_gain(tiny, 2.0))
            row, part = ad.run_with_cache(tiny_tokens[1:2], [name])
            _, shuffled = ad.run_with_cache(tiny_tokens[[2, 0]], [name])
            ad.run_with_cache(tiny_tokens.flip(-1), [name])
        assert fw.forwards == runs + (budget == 0)
        torch.testing.assert_close(shuffled[name], fresh[name][[2, 0]])
        assert torch.equal(again, fresh_logits) and torch.equal(cache[name], fresh[name])
        torch.testing.assert_close(row, fresh_row)
        torch.testing.assert_close(part[name], fresh_part[name])
    assert_no_hooks(tiny)


def test_shared_clean_forwards_budget_counts_a_replaced_run_once(tiny, tiny_tokens):
    """A batch asked again for a name its kept run lacks is run again and replaces that run: the replaced run's bytes
    come back to the budget, so a budget that holds the larger run alone keeps it (2 forwards for 4 calls)."""
    from tl_steering._util.progress import reporting
    from tl_steering.backends.adapter import shared_clean_forwards

    ad = adapt(tiny)
    extra = "ln_final.hook_normalized"  # not among the identity names every kept run holds
    assert extra in tiny.hook_dict and extra not in ad.identity_names()
    bits = torch.finfo(ad.dtype).bits
    bigger = tiny_tokens.numel() * (int(ad.cfg.d_vocab) + (len(ad.identity_names()) + 1) * ad.d_model) * bits // 8
    with shared_clean_forwards(tiny, max_bytes=bigger), reporting(lambda _: None) as fw:
        ad.run_with_hooks(tiny_tokens, [])  # kept: the identity names
        _, first = ad.run_with_cache(tiny_tokens, [extra])  # replaces it, with the extra name
        _, second = ad.run_with_cache(tiny_tokens, [extra])  # shared
        ad.run_with_hooks(tiny_tokens, [])  # shared
    assert fw.forwards == 2
    assert torch.equal(first[extra], second[extra])
