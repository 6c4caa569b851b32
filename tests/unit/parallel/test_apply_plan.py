"""A ``ParallelPlan`` is the unit the executor takes (docs/parallel.md, "Executor"): ``parallelize(model, plan)``
applies the plan's layers and every fitted part of its correction; given some parts of a plan's correction but not
all, ``parallelize`` and ``parallel_blocks`` raise an error naming what is missing; ``generate`` on the result gives
the hook surrogate's greedy tokens.

The linear plan's loss is checked against an independent surrogate: the tiny Llama's forward written here in
float64 from the Hugging Face weights (no package code), with the corrected parallel block
x + A(x) + g Phi(x) + b + A(x) W on the plan's layers.
"""

import math

import pytest
import torch

import tl_steering as ts
from tests.helpers import assert_no_hooks
from tl_steering.backends import tiny_hf_model
from tl_steering.errors import InputError
from tl_steering.hooks import parallel_blocks
from tl_steering.parallel import parallelize

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STRATEGIES = ["attribution_abs"]  # one cheap one-shot strategy: the plan is what matters here, not the choice


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(1, 257, (8, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def plans(planner_model, tokens):
    kw = {"held_out": tokens[4:], "strategy": STRATEGIES, "batch_size": 4, "fisher_samples": 0}
    return {refit: ts.plan_parallel(planner_model, tokens[:4], 2, refit=refit, **kw)
            for refit in ("linear", "affine", "none")}


# -- the independent float64 surrogate (tiny Llama of conftest.planner_model: seed 3, 5 layers, d 32) ---------


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _llama64_loss(tokens, plan_layers, gates, biases, linears) -> float:
    """Mean next-token CE of the tiny Llama in float64, blocks in ``plan_layers`` parallel and corrected."""
    hf, _ = tiny_hf_model("llama", seed=3, n_layers=5, d_model=32)
    cfg = hf.config
    hf = hf.double()
    eps, nh, nkv = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size
    dh = d // nh
    b, s = tokens.shape
    inv = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = lambda t: torch.cat([-t[..., dh // 2:], t[..., :dh // 2]], -1)  # noqa: E731
    causal = torch.ones(s, s, dtype=torch.bool).tril()

    def attn(layer, x):
        at = layer.self_attn
        h = _rms(x, layer.input_layernorm.weight, eps)
        q = (h @ at.q_proj.weight.T).view(b, s, nh, dh).transpose(1, 2)
        k = (h @ at.k_proj.weight.T).view(b, s, nkv, dh).transpose(1, 2)
        v = (h @ at.v_proj.weight.T).view(b, s, nkv, dh).transpose(1, 2)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        sc = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
        z = (sc.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
        return z @ at.o_proj.weight.T

    def mlp(layer, x):
        m = layer.mlp
        h = _rms(x, layer.post_attention_layernorm.weight, eps)
        return (torch.nn.functional.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T

    with torch.no_grad():
        x = hf.model.embed_tokens.weight[tokens]
        for i, layer in enumerate(hf.model.layers):
            a = attn(layer, x)
            if i in plan_layers:
                write = gates.get(i, 1.0) * mlp(layer, x)
                if i in biases:
                    write = write + biases[i]
                if i in linears:
                    write = write + a @ linears[i].double()
                x = x + a + write
            else:
                x = x + a
                x = x + mlp(layer, x)
        logits = _rms(x, hf.model.norm.weight, eps) @ hf.lm_head.weight.T
    logp = logits[:, :-1].log_softmax(-1)
    return float(-logp.gather(-1, tokens[:, 1:, None]).mean())


# -- tests -----------------------------------------------------------------------------------------------------


def test_linear_plan_matches_the_independent_float64_surrogate(planner_model, plans, tokens):
    """parallelize(model, plan) of a refit="linear" plan: its held-out loss equals the hand-written float64 model
    to 1e-6 (a float32 executor), and every part of the correction matters at that tolerance."""
    plan = plans["linear"]
    g, b = plan.corrections()
    w = plan.linear_maps()
    assert sorted(w) == plan.layers and float(plan.linears.abs().max()) > 0
    held = tokens[4:]
    par = parallelize(planner_model, plan)
    with torch.no_grad():
        got = float(par(held, return_type="loss"))
    ref = _llama64_loss(held, plan.layers, g, b, w)
    assert abs(got - ref) < 1e-6, (got, ref)  # measured 1.8e-7 (TL 4.3)
    # not vacuous: the plan without its maps, or with no correction, is 100x the tolerance away (2.6e-4, 2.4e-4)
    assert abs(_llama64_loss(held, plan.layers, g, b, {}) - ref) > 1e-4
    assert abs(_llama64_loss(held, plan.layers, {}, {}, {}) - ref) > 1e-4
    # the same number as the planner's own held-out record of this plan (its hooks, the package's mean_loss)
    assert abs((got - plan.clean_loss_held_out) - plan.held_out_delta_ce) < 1e-5
    assert par._tl_steering_parallel["corrected"] == plan.layers
    assert_no_hooks(planner_model)


@pytest.mark.parametrize("refit", ["linear", "affine", "none"])
def test_plan_equals_explicit_complete_form(planner_model, plans, tokens, refit):
    plan = plans[refit]
    g, b = plan.corrections()
    explicit = parallelize(planner_model, plan.layers, gates=g or None, biases=b or None,
                           linears=plan.linear_maps() or None)
    whole = parallelize(planner_model, plan)
    with torch.no_grad():
        assert torch.equal(whole(tokens), explicit(tokens))
        # and the plan's hook surrogate
        ref = planner_model.run_with_hooks(tokens, fwd_hooks=plan.hooks(planner_model))
        assert float((whole(tokens) - ref).abs().max()) < 1e-4


def test_partial_correction_is_an_error(planner_model, plans):
    lin, aff = plans["linear"], plans["affine"]
    g, b = lin.corrections()
    with pytest.raises(InputError, match=r"without its linears.*parallelize\(model, plan\).*plan\.linear_maps\(\)"):
        parallelize(planner_model, lin.layers, gates=g, biases=b)
    with pytest.raises(InputError, match=r"without its biases and linears"):
        parallelize(planner_model, lin.layers, gates=g)
    with pytest.raises(InputError, match=r"without its gates and biases"):
        parallelize(planner_model, lin.layers, linears=lin.linear_maps())
    ga, _ = aff.corrections()
    with pytest.raises(InputError, match=r"refit='affine'.*without its biases"):
        parallelize(planner_model, aff.layers, gates=ga)
    with pytest.raises(InputError, match=r"different refits"):
        parallelize(planner_model, lin.layers, gates=ga, biases=b, linears=lin.linear_maps())
    # the hook surrogate refuses the same, pointing at plan.hooks(model)
    with pytest.raises(InputError, match=r"without its linears.*plan\.hooks\(model\)"):
        parallel_blocks(planner_model, lin.layers, g, b)
    # a plan plus explicit corrections: ambiguous
    with pytest.raises(InputError, match=r"Pass the plan alone"):
        parallelize(planner_model, lin, gates=g)
    # the plain dicts of the user's own corrections are taken as given (no plan to be partial of)
    parallelize(planner_model, lin.layers, gates=dict(g), verify=False)
    assert_no_hooks(planner_model)


def test_generate_of_a_planned_model_is_the_surrogates(planner_model, plans, tokens):
    """20 greedy tokens of parallelize(model, plan).generate (KV cache on and off) equal the hook surrogate's,
    run without a cache one full forward per token."""
    plan = plans["linear"]
    par = parallelize(planner_model, plan)
    prompt = tokens[:1, :6]
    seq = prompt
    with torch.no_grad():
        for _ in range(20):
            logits = planner_model.run_with_hooks(seq, fwd_hooks=plan.hooks(planner_model))
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    for cache in (True, False):
        got = par.generate(prompt, max_new_tokens=20, do_sample=False, use_past_kv_cache=cache, verbose=False,
                           stop_at_eos=False)
        assert torch.equal(got, seq), f"use_past_kv_cache={cache}"
    assert_no_hooks(planner_model)
