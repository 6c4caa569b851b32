"""Hook factories (tl_steering.hooks) against direct computations from cached activations.

Every check reads the activations of the SAME patched forward: a saver placed before a factory's hook on a hook
point sees the FFN write as the model produced it, a saver placed after sees what the factory wrote, and the
FFN-input direction comes from that run's own resid_mid / resid_pre. The checks are functions of (model,
tokens) so that tests/integration/test_hooks_smollm2.py runs them unchanged on SmolLM2.

Tolerances: fp32 activations, geometry in float64; "rel" is max |a - b| / max |b| over the tensor.
"""

import math

import pytest
import torch

from tests.helpers import assert_no_hooks
from tl_steering import geometry as geo
from tl_steering.backends import adapt, hook_guard
from tl_steering.errors import InputError
from tl_steering.hooks import attention_gain, ffn_component, ffn_gate, parallel_blocks

F64 = torch.float64
RTOL = 1e-5  # relative, fp32 forward


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(F64), b.detach().to(F64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def saver(store: dict, key):
    def fn(act, hook):
        store[key] = act.detach().clone()
    return fn


def run_patched(model, tokens, hooks, layers=None):
    """One forward: raw mlp_out (before the factory), FFN input, patched mlp_out, resid_post, all per layer."""
    ad = adapt(model)
    raw, fin, out, post = {}, {}, {}, {}
    before, after = [], []
    for layer in ad.layers(layers):
        before.append((ad.hook_name(layer, "mlp_out"), saver(raw, layer)))
        after += [(ad.hook_name(layer, "ffn_input"), saver(fin, layer)),
                  (ad.hook_name(layer, "mlp_out"), saver(out, layer)),
                  (ad.hook_name(layer, "resid_post"), saver(post, layer))]
    logits = ad.run_with_hooks(tokens, before + hooks + after)
    assert_no_hooks(model)
    return logits, raw, fin, out, post


def _ffn_input_to_post(ad, layer, fin, out, post, model, tokens):
    """resid_post = FFN input + patched write (sequential) - the patch really enters the residual stream."""
    if not ad.is_parallel(layer):
        assert rel(fin[layer] + out[layer], post[layer]) < RTOL


# ----------------------------------------------------------------------------------------------------------
# checks shared with the SmolLM2 tests


def check_tangential(model, tokens) -> None:
    ad = adapt(model)
    _, raw, fin, out, post = run_patched(model, tokens, ffn_component(model, keep="tangential"))
    for layer in ad.layers():
        u = geo.normalize(fin[layer])
        expected = raw[layer].to(F64) - (u * raw[layer].to(F64)).sum(-1, keepdim=True) * u
        assert rel(out[layer], expected) < RTOL, layer
        # orthogonal to the FFN input of the same run (fp32 rounding of the write ~1e-7 of ||phi||)
        radial = (u * out[layer].to(F64)).sum(-1).abs()
        assert float((radial / raw[layer].to(F64).norm(dim=-1).clamp_min(1e-30)).max()) < 1e-5, layer
        _ffn_input_to_post(ad, layer, fin, out, post, model, tokens)
    # the direction was read from the patched run, not from a clean one: layer 1's FFN input moved
    clean = ad.run_with_cache(tokens, [ad.hook_name(1, "ffn_input")])[1][ad.hook_name(1, "ffn_input")]
    assert rel(clean, fin[1]) > 1e-4


def check_radial(model, tokens) -> None:
    ad = adapt(model)
    _, raw, fin, out, post = run_patched(model, tokens, ffn_component(model, keep="radial"))
    for layer in ad.layers():
        u = geo.normalize(fin[layer])
        phi = raw[layer].to(F64)
        expected = (u * phi).sum(-1, keepdim=True) * u
        assert rel(out[layer], expected) < RTOL, layer
        tangent = geo.tangential_part(out[layer], fin[layer]).norm(dim=-1)
        assert float((tangent / phi.norm(dim=-1).clamp_min(1e-30)).max()) < 1e-5, layer
        # parallel to u: |cos(out, u)| = 1 wherever the write is not ~0
        cos = geo.safe_cosine(out[layer], fin[layer]).abs()
        big = out[layer].to(F64).norm(dim=-1) > 1e-3 * phi.norm(dim=-1).max()
        assert float((1 - cos[big]).abs().max()) < 1e-6, layer
        _ffn_input_to_post(ad, layer, fin, out, post, model, tokens)


def check_zero_and_full(model, tokens) -> None:
    ad = adapt(model)
    _, raw, fin, out, post = run_patched(model, tokens, ffn_component(model, keep="zero"))
    for layer in ad.layers():
        assert float(out[layer].abs().max()) == 0.0
        if not ad.is_parallel(layer):
            assert torch.equal(post[layer], fin[layer])
    clean = ad.run_with_hooks(tokens)
    full = run_patched(model, tokens, ffn_component(model, keep="full"))[0]
    assert rel(full, clean) < 1e-6


def check_random_tangent(model, tokens) -> None:
    ad = adapt(model)
    hooks = ffn_component(model, keep="random_tangent", seed=3)
    _, raw, fin, out, post = run_patched(model, tokens, hooks)
    for layer in ad.layers():
        phi = raw[layer].to(F64)
        u = geo.normalize(fin[layer])
        radial = (u * out[layer].to(F64)).sum(-1).abs()
        assert float((radial / phi.norm(dim=-1).clamp_min(1e-30)).max()) < 1e-5, layer
        want = geo.tangential_part(phi, fin[layer]).norm(dim=-1)
        assert rel(out[layer].to(F64).norm(dim=-1), want) < RTOL, layer
        # a random direction, not the tangential part itself
        assert float(geo.safe_cosine(out[layer], geo.tangential_part(phi, fin[layer])).abs().mean()) < 0.5
    # deterministic per seed: a second forward with the same hooks, and a fresh factory call, agree bit for bit
    again = run_patched(model, tokens, hooks)[3]
    fresh = run_patched(model, tokens, ffn_component(model, keep="random_tangent", seed=3))[3]
    other = run_patched(model, tokens, ffn_component(model, keep="random_tangent", seed=4))[3]
    for layer in ad.layers():
        assert torch.equal(again[layer], out[layer]) and torch.equal(fresh[layer], out[layer])
        assert rel(other[layer], out[layer]) > 1e-2
    # layers get different noise: layer 0's and layer 1's directions are unrelated
    if ad.n_layers > 1:
        c = geo.safe_cosine(out[0], out[1]).abs().mean()
        assert float(c) < 0.5


def check_skip_positions(model, tokens) -> None:
    ad = adapt(model)
    _, raw, fin, out, post = run_patched(model, tokens, ffn_component(model, keep="tangential",
                                                                      skip_positions=(0, -1)))
    for layer in ad.layers():
        for p in (0, tokens.shape[1] - 1):
            assert torch.equal(out[layer][:, p], raw[layer][:, p]), (layer, p)
        mid = slice(1, tokens.shape[1] - 1)
        expected = geo.tangential_part(raw[layer][:, mid], fin[layer][:, mid])
        assert rel(out[layer][:, mid], expected) < RTOL


def check_ffn_gate(model, tokens) -> None:
    ad = adapt(model)
    gates = {0: 0.5, ad.n_layers - 1: 1.7}
    _, raw, fin, out, post = run_patched(model, tokens, ffn_gate(model, gates))
    for layer in ad.layers():
        g = gates.get(layer, 1.0)
        assert torch.equal(out[layer], raw[layer] * g) if layer in gates else torch.equal(out[layer], raw[layer])
    # one gate per layer, as a tensor with a graph: gradients reach the gates
    g = torch.linspace(0.5, 1.5, ad.n_layers).requires_grad_(True)
    with hook_guard(ad.model):
        logits = model.run_with_hooks(tokens, fwd_hooks=ffn_gate(model, g))
    assert_no_hooks(model)
    # autograd.grad w.r.t. the gates only: .backward() would leave .grad on the (session-shared) model's weights
    (grad,) = torch.autograd.grad(logits.float().logsumexp(-1).mean(), [g])
    assert torch.isfinite(grad).all() and float(grad.abs().sum()) > 0
    assert all(p.grad is None for p in model.parameters())


def check_parallel_blocks(model, tokens) -> None:
    ad = adapt(model)
    sequential = [lay for lay in ad.layers() if not ad.is_parallel(lay)]
    clean = ad.run_with_hooks(tokens)
    assert parallel_blocks(model, []) == []  # a plan with k = 0 is the sequential model
    if not sequential:  # NeoX / Pythia: already parallel, the factory is a no-op
        assert parallel_blocks(model, ad.layers()) == []
        return
    for chosen in ([sequential[-1]], sequential):
        store: dict = {}
        names = {(lay, s): ad.hook_name(lay, s) for lay in chosen for s in ("resid_pre", "attn_out", "resid_post")}
        hooks = parallel_blocks(model, chosen) + [(n, saver(store, k)) for k, n in names.items()]
        logits = ad.run_with_hooks(tokens, hooks)
        assert_no_hooks(model)
        for lay in chosen:
            pre = store[(lay, "resid_pre")]
            with torch.no_grad():
                expected = pre.to(F64) + store[(lay, "attn_out")].to(F64) + ad.ffn(lay)(pre).to(F64)
            assert rel(store[(lay, "resid_post")], expected) < RTOL, lay
        assert rel(logits, clean) > 1e-5  # it changed the computation


def check_attention_gain(model, tokens) -> None:
    ad = adapt(model)
    raw, out = {}, {}
    hooks = ([(ad.hook_name(lay, "attn_out"), saver(raw, lay)) for lay in ad.layers()] + attention_gain(model, 1.5)
             + [(ad.hook_name(lay, "attn_out"), saver(out, lay)) for lay in ad.layers()])
    names = ad.identity_names()
    _, cache = ad.run_with_cache(tokens, names, fwd_hooks=hooks)
    for lay in ad.layers():
        assert torch.equal(out[lay], raw[lay] * 1.5)
        assert torch.equal(cache[ad.hook_name(lay, "attn_out")], out[lay])
    ad.check_residual_identity(cache)  # the scaled write is what enters the residual stream
    # a layer subset leaves the other layers alone
    only = attention_gain(model, 2.0, layers=[0])
    assert [n for n, _ in only] == [ad.hook_name(0, "attn_out")]


def check_composition(model, tokens) -> None:
    """Factories compose with a user's own hook on the same point (both fire, in list order) and with
    model.hooks / run_with_hooks / run_with_cache; no hook is left afterwards."""
    ad = adapt(model)
    name = ad.hook_name(0, "mlp_out")
    seen: list = []

    def user(act, hook):
        seen.append(act.detach().clone())
        return act * 2.0

    raw = {}
    # user hook first: the gate sees the user's 2x write; user last: the user sees the gated write
    ad.run_with_hooks(tokens, [(name, saver(raw, "phi")), (name, user)] + ffn_gate(model, {0: 0.25})
                      + [(name, saver(raw, "out"))])
    assert torch.equal(seen[-1], raw["phi"]) and torch.equal(raw["out"], raw["phi"] * 2.0 * 0.25)
    ad.run_with_hooks(tokens, [(name, saver(raw, "phi"))] + ffn_gate(model, {0: 0.25}) + [(name, user)]
                      + [(name, saver(raw, "out"))])
    assert torch.equal(seen[-1], raw["phi"] * 0.25) and torch.equal(raw["out"], raw["phi"] * 0.25 * 2.0)
    assert_no_hooks(model)

    hooks = ffn_component(model, keep="tangential")
    reference = ad.run_with_hooks(tokens, hooks)
    # TL's own run_with_hooks
    logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
    assert_no_hooks(model)
    assert rel(logits, reference) < 1e-6
    # TL's hooks context + run_with_cache: the cache holds the patched writes of that same forward
    with model.hooks(fwd_hooks=hooks + [(name, user)]):
        logits, cache = model.run_with_cache(tokens)
    assert_no_hooks(model)
    for lay in ad.layers():
        phi = cache[ad.hook_name(lay, "mlp_out")].to(F64)
        u = geo.normalize(cache[ad.hook_name(lay, "ffn_input")])
        radial = (u * phi).sum(-1).abs()
        if lay == 0:  # the user hook doubled the tangential write after the factory
            assert rel(phi, 2.0 * seen[-1].to(F64)) < 1e-6
        assert float((radial / phi.norm(dim=-1).clamp_min(1e-30)).max()) < 1e-5, lay
    ad.check_residual_identity({k: v for k, v in cache.items()})
    # an error inside a hook: still nothing left behind
    with pytest.raises(RuntimeError, match="boom"):
        ad.run_with_hooks(tokens, hooks + [(name, lambda a, hook: (_ for _ in ()).throw(RuntimeError("boom")))])
    assert_no_hooks(model)


CHECKS = [check_tangential, check_radial, check_zero_and_full, check_random_tangent, check_skip_positions,
          check_ffn_gate, check_parallel_blocks, check_attention_gain, check_composition]


# ----------------------------------------------------------------------------------------------------------
# tiny models: every arch x backend


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
def test_hook_factory(tiny, tiny_tokens, check):
    assert_no_hooks(tiny)
    check(tiny, tiny_tokens)
    assert_no_hooks(tiny)


def test_reference_resid_pre(tiny, tiny_tokens):
    """reference="resid_pre" splits against the block input instead of the FFN input."""
    ad = adapt(tiny)
    pre = {}
    extra = [(ad.hook_name(lay, "resid_pre"), saver(pre, lay)) for lay in ad.layers()]
    _, raw, fin, out, post = run_patched(tiny, tiny_tokens, ffn_component(tiny, "tangential", reference="resid_pre")
                                         + extra)
    for lay in ad.layers():
        assert rel(out[lay], geo.tangential_part(raw[lay], pre[lay])) < RTOL


def test_single_layer_scope(tiny, tiny_tokens):
    _, raw, fin, out, post = run_patched(tiny, tiny_tokens, ffn_component(tiny, "zero", layers=1))
    assert torch.equal(out[0], raw[0]) and float(out[1].abs().max()) == 0.0


def test_bad_arguments(tiny):
    with pytest.raises(InputError, match="keep must be one of"):
        ffn_component(tiny, keep="sideways")
    with pytest.raises(InputError, match="reference"):
        ffn_component(tiny, reference="resid_post")
    with pytest.raises(InputError, match="finite"):
        attention_gain(tiny, math.nan)
    with pytest.raises(InputError, match="one per layer"):
        ffn_gate(tiny, [1.0] * (adapt(tiny).n_layers + 1))
    with pytest.raises(InputError, match="must be finite"):
        ffn_gate(tiny, {0: math.inf})


# ----------------------------------------------------------------------------------------------------------
# hook order: a user's hook on the same point, listed before or after ours, must not change what the factory
# computes (the factories read the value the block really uses, after every hook on that point)


def _steer(act, hook):
    """A user's steering hook that changes the direction: x -> 3x + ||x|| v with a fixed unit vector v."""
    v = torch.randn(act.shape[-1], generator=torch.Generator().manual_seed(7), dtype=F64)
    v = (v / v.norm()).to(act.dtype)
    return 3.0 * act + act.norm(dim=-1, keepdim=True) * v


def test_parallel_blocks_any_hook_order_matches_executor(tiny, tiny_tokens):
    """parallel_blocks(m, [1]) + a user's steering hook (_steer) on blocks.1.hook_resid_pre, listed first or last, gives the
    executor's output (ts.parallelize with the same user hook) to fp32 rounding (before the fix: 5e-4 off
    when the user's hook ran after ours)."""
    import tl_steering as ts

    ad = adapt(tiny)
    user = (ad.hook_name(1, "resid_pre"), _steer)
    first = ad.run_with_hooks(tiny_tokens, [user] + parallel_blocks(tiny, [1]))
    last = ad.run_with_hooks(tiny_tokens, parallel_blocks(tiny, [1]) + [user])
    truth = ts.parallelize(tiny, [1]).run_with_hooks(tiny_tokens, fwd_hooks=[user])
    assert rel(last, first) < 1e-6
    assert rel(last, truth) < RTOL
    assert rel(first, truth) < RTOL
    assert_no_hooks(tiny)


@pytest.mark.parametrize("keep", ["tangential", "radial"])
def test_ffn_component_any_hook_order(tiny, tiny_tokens, keep):
    """ffn_component + a user's steering hook on the FFN-input point, listed first or last: the written FFN output is
    tangential (radial) to the FFN input the block really used (|cos| < 1e-5, resp. |sin| < 1e-5; before the
    fix |cos| = 0.27 with the user's hook last), and both orders give the same logits."""
    ad = adapt(tiny)
    layer = 1
    fin_name = ad.hook_name(layer, "ffn_input")
    user = (fin_name, _steer)
    outs = []
    for order in ("first", "last"):
        got: dict = {}
        ours = ffn_component(tiny, keep, layers=[layer])
        hooks = [user] + ours if order == "first" else ours + [user]
        # recorders listed after everything: the final FFN input and the FFN write the model goes on with
        hooks += [(fin_name, saver(got, "f")), (ad.hook_name(layer, "mlp_out"), saver(got, "phi"))]
        outs.append(ad.run_with_hooks(tiny_tokens, hooks))
        u = geo.normalize(got["f"].to(F64))
        phi = got["phi"].to(F64)
        norm = phi.norm(dim=-1).clamp_min(1e-30)
        cos = (phi * u).sum(-1) / norm
        ok = phi.norm(dim=-1) > 1e-6 * phi.norm(dim=-1).max()
        if keep == "tangential":
            assert float(cos[ok].abs().max()) < 1e-5, order
        else:
            assert float((1 - cos[ok].abs()).max()) < 1e-5, order
    assert rel(outs[1], outs[0]) < 1e-6
    assert_no_hooks(tiny)
