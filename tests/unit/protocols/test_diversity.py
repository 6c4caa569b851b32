"""tl_steering.protocols.diversity on the tiny models, set statistics with plain torch (conftest.py)."""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import hook_count
from tl_steering import errors
from tl_steering.protocols import (
    DiversityResult,
    diversity,
)
from tests.unit.protocols.conftest import TOL, _is_parallel, _tl_cache, check_round_trip, check_summary_and_plots, _component_hooks

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _set_stats(x, drop0=True):
    """Per-sequence statistics with plain torch: Gram matrix, singular values, centring."""
    u = x.double()[:, 1:] if drop0 else x.double()
    u = u / u.norm(dim=-1, keepdim=True)
    n = u.shape[1]
    gram = u @ u.mT
    s = torch.linalg.svdvals(u)
    p = s / s.sum(-1, keepdim=True)
    ubar = u.mean(1, keepdim=True)
    return {
        "pairwise_cosine": (gram.sum((-1, -2)) - n) / (n * (n - 1)),
        "resultant_length": ubar.squeeze(1).norm(dim=-1),
        "effective_rank": torch.exp(-(p * p.log()).sum(-1)),
        "participation_ratio": (s**2).sum(-1) ** 2 / (s**4).sum(-1),
        "rank_collapse": (u - ubar).flatten(1).norm(dim=-1) / u.flatten(1).norm(dim=-1),
    }


def _entropy_loss(logits, tokens):
    lp = F.log_softmax(logits[:, :-1].double(), -1)
    ent = -(lp.exp() * lp).sum(-1).mean()
    ce = -lp.gather(-1, tokens[:, 1:, None]).mean()
    return float(ent), float(ce)


def test_diversity_matches_independent_recomputation(tiny, tiny_tokens, results):
    res: DiversityResult = results["diversity"]
    logits, cache = _tl_cache(tiny, tiny_tokens)
    n_layers = tiny.cfg.n_layers
    assert res.sites == ["resid_pre", "resid_mid", "resid_post"]
    for lay in range(n_layers):
        pre = cache[f"blocks.{lay}.hook_resid_pre"]
        post = cache[f"blocks.{lay}.hook_resid_post"]
        par = _is_parallel(tiny, lay)
        mid = pre + cache[f"blocks.{lay}.hook_attn_out"] if par else cache[f"blocks.{lay}.hook_resid_mid"]
        st = {s: _set_stats(v) for s, v in (("pre", pre), ("mid", mid), ("post", post))}
        for k in ("pairwise_cosine", "resultant_length", "effective_rank", "participation_ratio", "rank_collapse"):
            table = getattr(res, k)
            assert table[lay, 0] == pytest.approx(float(st["pre"][k].mean()), abs=TOL), k
            assert table[lay, 2] == pytest.approx(float(st["post"][k].mean()), abs=TOL), k
            if par:
                assert math.isnan(table[lay, 1])
            else:
                assert table[lay, 1] == pytest.approx(float(st["mid"][k].mean()), abs=TOL), k
            assert res.attention_effect[k][lay] == pytest.approx(float((st["mid"][k] - st["pre"][k]).mean()),
                                                                 abs=TOL)
            assert res.ffn_effect[k][lay] == pytest.approx(float((st["post"][k] - st["mid"][k]).mean()), abs=TOL)
    fin = _set_stats(cache[f"blocks.{n_layers - 1}.hook_resid_post"])
    assert res.final_diversity["pairwise_cosine"] == pytest.approx(float(fin["pairwise_cosine"].mean()), abs=TOL)
    ent, ce = _entropy_loss(logits, tiny_tokens)
    assert res.entropy["clean"] == pytest.approx(ent, abs=TOL)
    assert res.loss["clean"] == pytest.approx(ce, abs=TOL)
    # under the all-layer radial ablation
    logits_r, cache_r = _tl_cache(tiny, tiny_tokens, _component_hooks(tiny, "radial", range(n_layers)))
    for lay in range(n_layers):
        st = _set_stats(cache_r[f"blocks.{lay}.hook_resid_post"])
        assert res.under_ablation["radial"][lay, 2] == pytest.approx(float(st["pairwise_cosine"].mean()), abs=TOL)
        assert res.under_ablation_stats["radial"]["effective_rank"][lay, 2] == pytest.approx(
            float(st["effective_rank"].mean()), abs=TOL)
    ent, ce = _entropy_loss(logits_r, tiny_tokens)
    assert res.entropy["radial"] == pytest.approx(ent, abs=TOL)
    assert res.loss["radial"] == pytest.approx(ce, abs=TOL)
    fin = _set_stats(cache_r[f"blocks.{n_layers - 1}.hook_resid_post"])
    assert res.final_diversity_under_ablation["radial"]["pairwise_cosine"] == pytest.approx(
        float(fin["pairwise_cosine"].mean()), abs=TOL)
    # attention-gain sweep
    assert res.gain_sweep["gain"].tolist() == [0.5, 1.0, 2.0]
    for i, g in enumerate((0.5, 1.0, 2.0)):
        hooks = [(f"blocks.{lay}.hook_attn_out", lambda act, hook, g=g: act * g) for lay in range(n_layers)]
        lg, cg = _tl_cache(tiny, tiny_tokens, hooks)
        fin = _set_stats(cg[f"blocks.{n_layers - 1}.hook_resid_post"])
        ent, ce = _entropy_loss(lg, tiny_tokens)
        assert res.gain_sweep["final_pairwise_cosine"][i] == pytest.approx(float(fin["pairwise_cosine"].mean()),
                                                                           abs=TOL)
        assert res.gain_sweep["entropy"][i] == pytest.approx(ent, abs=TOL)
        assert res.gain_sweep["loss"][i] == pytest.approx(ce, abs=TOL)
    assert res.gain_sweep["loss"][1] == pytest.approx(res.loss["clean"], abs=1e-9)


def test_bad_inputs_raise_package_errors(tiny, tiny_tokens):
    with pytest.raises(errors.InputError, match="too short"):
        diversity(tiny, tiny_tokens[:, :1])
    with pytest.raises(errors.InputError, match="full"):
        diversity(tiny, tiny_tokens, ablations=("full",))
    with pytest.raises(errors.InputError, match="gain"):
        diversity(tiny, tiny_tokens, gains=(float("inf"),))
    assert hook_count(tiny) == 0


def test_result_round_trip_summary_and_plots(results, tmp_path, tiny_tokens):
    check_round_trip(results["diversity"], tmp_path, "diversity")
    check_summary_and_plots(results["diversity"], tiny_tokens.shape[0], "diversity")


def test_diversity_set_statistics_are_the_same_on_two_threads():
    """The diversity protocol's per-sequence statistics run in two halves on two threads when torch has two (the
    suite runs on one): every sequence's numbers come from its own SVD, so the two routes agree bit for bit, with
    masked rows and degenerate tokens in both halves."""
    from tl_steering.protocols.diversity import STATS, _stats

    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 9, 16, generator=g, dtype=torch.float64)
    x[:, 0] *= 50.0  # a sink-like row
    x[1, 3] = 0.0  # a degenerate token
    x[4, 2:] = x[4, 1]  # one direction repeated
    base = torch.rand(5, 9, generator=g) > 0.2
    base[:, 0] = False
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, bad_one = _stats(x, base)
        torch.set_num_threads(2)
        two, bad_two = _stats(x, base)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(bad_one, bad_two) and int(bad_one[1]) == 1
    for k in STATS:
        assert torch.equal(one[k].isnan(), two[k].isnan()), k
        assert torch.equal(one[k].nan_to_num(), two[k].nan_to_num()), k
    assert torch.get_num_threads() == before
