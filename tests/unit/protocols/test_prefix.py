"""Unit tests of tl_steering.protocols.prefix (docs/prefix.md) on the tiny models: every arch x backend."""

import math

import plotly.graph_objects as go
import pytest
import torch

from tests.helpers import hook_count
from tl_steering import geometry as geo
from tl_steering.backends import adapt, weights_fingerprint
from tl_steering.errors import InputError
from tl_steering.protocols.prefix import (
    PrefixSensitivityResult,
    PrefixStatisticsResult,
    prefix_sensitivity,
    prefix_statistics,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_noise_perturbation_is_causal(tiny, tiny_tokens):
    ad = adapt(tiny)
    fp = weights_fingerprint(tiny)
    j = 6
    r = prefix_sensitivity(tiny, tiny_tokens, 1, j, eps=1e-2, seed=0)
    # positions before j do not move (bit-exact here; the spec allows 1e-6 in float32)
    assert r.prefix_max_angle < 1e-6 and r.prefix_max_rel_change < 1e-6 and r.prefix_max_kl < 1e-10
    # the perturbed position moves by about eps (ξ is a unit vector; the angle is <= eps and > eps / 10 here)
    assert r.layers == list(range(1, ad.n_layers)) and r.perturb_layer == 1
    assert float(r.kl[0]) > 0
    assert 0 < float(r.angle[0, 0]) < 1.5e-2
    assert r.distance.tolist() == list(range(tiny_tokens.shape[1] - j))
    assert r.count.tolist() == [tiny_tokens.shape[0]] * (tiny_tokens.shape[1] - j)
    # later positions feel it through attention (nonzero, and smaller than at j on average)
    assert float(r.angle[-1, 1:].mean()) > 0
    assert weights_fingerprint(tiny) == fp and hook_count(tiny) == 0


def test_noise_angle_matches_direct_computation(tiny, tiny_tokens):
    """δθ at (layer, distance) equals the angle between resid_post rows of two explicit forwards."""
    ad = adapt(tiny)
    j, l0 = 4, 0
    r = prefix_sensitivity(tiny, tiny_tokens, l0, j, eps=1e-1, seed=3)
    name = ad.hook_name(ad.n_layers - 1, "resid_post")
    gen = torch.Generator().manual_seed(3)
    xi = torch.randn(tiny_tokens.shape[0], ad.d_model, generator=gen, dtype=torch.float64)
    xi = xi / xi.norm(dim=-1, keepdim=True)

    def perturb(act, hook):
        act = act.clone()
        x = act[:, j].double()
        act[:, j] = (x + 1e-1 * x.norm(dim=-1, keepdim=True) * xi).to(act.dtype)
        return act

    _, clean = ad.run_with_cache(tiny_tokens, [name])
    _, pert = ad.run_with_cache(tiny_tokens, [name], fwd_hooks=[(ad.hook_name(l0, "resid_pre"), perturb)])
    ang = geo.angle(pert[name], clean[name])  # arccos form: ~1e-8 rad error, fine at these angles
    assert torch.allclose(r.angle[-1], ang[:, j:].mean(0), atol=1e-6)


def test_token_mode(tiny, tiny_tokens):
    r = prefix_sensitivity(tiny, tiny_tokens, 0, [3, 8], mode="token", seed=1)
    assert r.mode == "token" and r.perturb_layer == 0 and r.layers == list(range(adapt(tiny).n_layers))
    assert r.prefix_max_angle < 1e-6 and r.prefix_max_kl < 1e-10
    assert float(r.kl[0]) > 0
    assert len(r.replaced_tokens) == 2 * tiny_tokens.shape[0]
    assert all(old != new and 0 <= new < 257 for _, _, old, new in r.replaced_tokens)
    # distance d is averaged over both j where both reach it, over j = 3 only beyond
    n = tiny_tokens.shape[0]
    assert r.count[0] == 2 * n and r.count[-1] == n
    # seeded
    r2 = prefix_sensitivity(tiny, tiny_tokens, 0, [3, 8], mode="token", seed=1)
    assert r2.replaced_tokens == r.replaced_tokens and torch.equal(r2.angle, r.angle)


def test_sensitivity_result_io(tmp_path, tiny_tokens):
    import tl_steering as ts

    model = ts.tiny_model("gpt2", backend="bridge", seed=0)
    r = prefix_sensitivity(model, tiny_tokens, 1, 2, eps=1e-3)
    assert isinstance(r.plot(), go.Figure)
    back = PrefixSensitivityResult.load(r.save(tmp_path / "p.json"))
    assert torch.equal(back.angle, r.angle) and back.prefix_bitwise_equal == r.prefix_bitwise_equal
    s = r.summary()
    assert s["kl_at_perturbed"] > 0 and math.isfinite(s["angle_final_mean_later"])
    with pytest.raises(InputError, match="position"):
        prefix_sensitivity(model, tiny_tokens, 1, 99)
    with pytest.raises(InputError, match="mode"):
        prefix_sensitivity(model, tiny_tokens, 1, 2, mode="swap")
    with pytest.raises(InputError, match="eps"):
        prefix_sensitivity(model, tiny_tokens, 1, 2, eps=0.0)


def test_prefix_statistics(tiny, tiny_tokens):
    ad = adapt(tiny)
    r = prefix_statistics(tiny, tiny_tokens)
    assert isinstance(r, PrefixStatisticsResult) and r.layers == list(range(ad.n_layers))
    n_pos = tiny_tokens.shape[1]
    pc = r.values["pairwise_cosine"]
    assert tuple(pc.shape) == (ad.n_layers, n_pos)
    # prefix end 0 holds only the excluded BOS row; prefix end 1 a single row: pairwise cosine undefined
    assert torch.isnan(pc[:, :2]).all() and torch.isfinite(pc[:, 2:]).all()
    assert r.n_valid.tolist() == list(range(n_pos))
    # the full prefix equals the set statistic of positions 1.. averaged over sequences
    name = ad.hook_name(ad.n_layers - 1, "resid_post")
    _, cache = ad.run_with_cache(tiny_tokens, [name])
    u = cache[name][:, 1:]
    assert float(pc[-1, -1]) == pytest.approx(float(geo.mean_pairwise_cosine(u).mean()), abs=1e-12)
    assert float(r.values["effective_rank"][-1, -1]) == pytest.approx(float(geo.effective_rank(u).mean()), rel=1e-9)
    assert float(r.values["resultant_length"][-1, -1]) == pytest.approx(
        float(geo.mean_resultant_length(u).mean()), abs=1e-12)
    assert isinstance(r.plot("effective_rank"), go.Figure)


def test_prefix_statistics_options(tiny_tokens):
    import tl_steering as ts

    model = ts.tiny_model("llama", backend="bridge", seed=0)
    r = prefix_statistics(model, tiny_tokens, layers=[1], site="ffn_input", stats=["pairwise_cosine"])
    assert r.stats == ["pairwise_cosine"] and r.site == "ffn_input" and r.layers == [1]
    with pytest.raises(InputError, match="stats"):
        prefix_statistics(model, tiny_tokens, stats=["entropy"])
