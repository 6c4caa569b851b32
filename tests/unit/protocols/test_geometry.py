"""Unit tests of tl_steering.protocols (deficit, ablation, diversity) on the tiny models.

Every quantity is recomputed independently: activations from TransformerLens's own ``model.run_with_cache``
(not the adapter's cache), the FFN field from direct calls of ``blocks[l].ln2`` / ``blocks[l].mlp``, ablations
from hooks written here, statistics with plain torch (Gram matrices, ``svdvals``). Agreement: <= 1e-6 absolute
(float64 geometry on float32 activations of the same forward). Parallel blocks (tiny NeoX) are covered by the
``tiny`` fixture.
"""

import math

import plotly.graph_objects as go
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import first_output, hook_count
from tl_steering import errors
from tl_steering import geometry as geo
from tl_steering.backends import adapt, weights_fingerprint
from tl_steering.protocols import (
    AblationResult,
    DeficitResult,
    DiversityResult,
    angular_deficit,
    diversity,
    ffn_ablation,
)
from tl_steering.results import Result
from tl_steering.stats import bootstrap_ci, position_bins, position_mask

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-6


def _tl_cache(model, tokens, hooks=()):
    with torch.no_grad(), model.hooks(fwd_hooks=list(hooks)):
        logits, cache = model.run_with_cache(tokens)
    return logits, {k: v.detach() for k, v in cache.items()}


def _phi(model, layer, x):
    blk = model.blocks[layer]
    ln2 = getattr(blk, "ln2", None) or blk.ln1
    with torch.no_grad():
        return first_output(blk.mlp(first_output(ln2(x))))


def _is_parallel(model, layer):
    return adapt(model).is_parallel(layer)


def _cos(a, b):
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


def _tan(v, u):
    return v - (v * u).sum(-1, keepdim=True) * u


def _angle(a, b):
    return torch.arccos(_cos(a, b).clamp(-1, 1))


@pytest.fixture(scope="module")
def results(tiny, tiny_tokens):
    """Each protocol once per tiny model, with hooks and weights checked before and after."""
    before_hooks, before_w = hook_count(tiny), weights_fingerprint(tiny)
    out = {
        "deficit": angular_deficit(tiny, tiny_tokens, n_bootstrap=200, batch_size=2),
        "ablation": ffn_ablation(tiny, tiny_tokens, scope="per_layer", batch_size=2, n_bootstrap=100),
        "ablation_keep0": ffn_ablation(tiny, tiny_tokens, keep=("tangential", "radial"), ablate_position_0=False,
                                       include_random_tangent=False, n_bootstrap=0),
        "diversity": diversity(tiny, tiny_tokens, gains=(0.5, 1.0, 2.0), batch_size=2),
    }
    assert hook_count(tiny) == before_hooks == 0
    assert weights_fingerprint(tiny) == before_w
    return out


# ----------------------------------------------------------------------------------------------------------
# shared statistics (tl_steering.stats, tl_steering.geometry)


def test_position_bins_and_mask():
    edges, index = position_bins(128)
    assert edges == [1, 2, 4, 8, 16, 32, 64, 128]
    assert index[0] == -1 and index[1] == 0 and index[2] == index[3] == 1 and index[4] == 2 and index[127] == 6
    edges, index = position_bins(16)
    assert edges == [1, 2, 4, 8, 16] and index[15] == 3
    assert position_bins(2)[0] == [1, 2]
    m = position_mask(5, (0, -1))
    assert m.tolist() == [False, True, True, True, False]
    with pytest.raises(errors.InputError, match="leaves no position"):
        position_mask(2, (0, 1))


def test_degenerate_mask_drops_zero_and_tiny_norms_of_the_valid_positions():
    norms = torch.tensor([[5.0, 1.0, 0.0, 1e-12, 2.0, 3.0, 1.5]], dtype=torch.float64)
    base = torch.tensor([[False, True, True, True, True, True, True]])
    x = norms[..., None] * torch.tensor([0.6, 0.8], dtype=torch.float64)
    valid = base & ~geo.degenerate_mask(x, base)  # the protocols' rule
    assert valid.tolist() == [[False, True, False, False, True, True, True]]


def test_bootstrap_ci_is_seeded_and_brackets_the_mean():
    x = torch.randn(40, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a, b = bootstrap_ci(x, n_bootstrap=300, seed=3), bootstrap_ci(x, n_bootstrap=300, seed=3)
    assert torch.equal(a, b) and a.shape == (3, 2)
    mean = x.mean(0)
    assert bool((a[:, 0] < mean).all() and (mean < a[:, 1]).all())
    # width of a 95 % CI of a mean of 40 N(0,1) draws: about 2 * 1.96 / sqrt(40) = 0.62
    assert 0.4 < float((a[:, 1] - a[:, 0]).mean()) < 0.85
    assert torch.isnan(bootstrap_ci(x, n_bootstrap=0)).all()


# ----------------------------------------------------------------------------------------------------------
# angular deficit


def test_deficit_matches_independent_recomputation(tiny, tiny_tokens, results):
    res: DeficitResult = results["deficit"]
    _, cache = _tl_cache(tiny, tiny_tokens)
    n_layers = tiny.cfg.n_layers
    assert res.layers == list(range(n_layers))
    edges, index = position_bins(tiny_tokens.shape[1])
    for lay in range(n_layers):
        x32 = cache[f"blocks.{lay}.hook_resid_pre"]
        x = x32.double()
        a = cache[f"blocks.{lay}.hook_attn_out"].double()
        post = cache[f"blocks.{lay}.hook_resid_post"].double()
        phi = _phi(tiny, lay, x32).double()
        dx = post - x
        u = x / x.norm(dim=-1, keepdim=True)
        align = _cos(_tan(a, u), _tan(dx, u))[:, 1:]  # position 0 excluded
        assert res.deficit[lay] == pytest.approx(1 - float(align.mean(1).mean()), abs=TOL)
        assert res.per_sequence_alignment[:, lay] == pytest.approx(align.mean(1), abs=TOL)
        assert res.deficit_median[lay] == pytest.approx(1 - float(align.mean(1).median()), abs=TOL)
        assert res.untangented_deficit[lay] == pytest.approx(1 - float(_cos(a, dx)[:, 1:].mean()), abs=TOL)
        assert res.angle_deficit[lay] == pytest.approx(float((torch.arccos(align) / math.pi).mean()), abs=TOL)
        e_a = float(_angle(x + a, post)[:, 1:].mean())
        e_af = float(_angle(x + a + phi, post)[:, 1:].mean())
        assert res.error_attention[lay] == pytest.approx(e_a, abs=TOL)
        assert res.error_parallel[lay] == pytest.approx(e_af, abs=TOL)
        assert res.ffn_contribution[lay] == pytest.approx((e_a - e_af) / e_a, abs=TOL)
        r2 = x.norm(dim=-1)[:, 1:] ** 2
        vdx, va, vaf = (_tan(v, u)[:, 1:] for v in (dx, a, a + phi))
        tot = float(((vdx**2).sum(-1) / r2).sum())
        assert res.r2_attention[lay] == pytest.approx(1 - float(((vdx - va) ** 2).sum(-1).div(r2).sum()) / tot,
                                                      abs=TOL)
        assert res.r2_parallel[lay] == pytest.approx(1 - float(((vdx - vaf) ** 2).sum(-1).div(r2).sum()) / tot,
                                                     abs=TOL)
        full_align = _cos(_tan(a, u), _tan(dx, u))
        for k in range(len(edges) - 1):
            sel = index == k
            assert res.deficit_by_position[lay, k] == pytest.approx(1 - float(full_align[:, sel].mean()), abs=TOL)
            assert int(res.position_bin_counts[lay, k]) == int(sel.sum()) * tiny_tokens.shape[0]
        if _is_parallel(tiny, lay):
            # x + a + Phi(x) IS the parallel block's output: e_AF is 0 up to float32 rounding
            assert res.error_parallel[lay] < 1e-5
            assert res.ffn_contribution[lay] == pytest.approx(1.0, abs=1e-4)
            assert res.r2_parallel[lay] == pytest.approx(1.0, abs=1e-8)
    assert res.parallel == [_is_parallel(tiny, lay) for lay in range(n_layers)]
    assert res.mean == pytest.approx(float(res.deficit.mean()), abs=1e-12)
    assert res.mean_excluding_first == pytest.approx(float(res.deficit[1:].mean()), abs=1e-12)
    assert res.mean_ci[0] <= res.mean <= res.mean_ci[1]
    assert bool((res.deficit_ci[:, 0] <= res.deficit).all() and (res.deficit <= res.deficit_ci[:, 1]).all())
    assert int(res.n_masked.sum()) == 0
    assert res.n_tokens_used.tolist() == [tiny_tokens.shape[0] * (tiny_tokens.shape[1] - 1)] * n_layers
    assert max(res.residual_identity_error) < 1e-5


def test_deficit_layer_selection_and_batching_agree(tiny, tiny_tokens, results):
    sub = angular_deficit(tiny, tiny_tokens, layers=[1], n_bootstrap=0, batch_size=3)
    full = results["deficit"]
    assert sub.layers == [1]
    # batches of 3 against one batch: the float32 forward may round differently per batch shape (a matmul kernel's
    # row blocking; AVX2 MKL does, AVX-512 happened not to), so the float64 statistics of those activations agree
    # to a few float32 roundings of O(1) quantities, not to float64's
    tol = 128 * torch.finfo(torch.float32).eps
    assert sub.deficit[0] == pytest.approx(float(full.deficit[1]), abs=tol)
    assert sub.error_parallel[0] == pytest.approx(float(full.error_parallel[1]), abs=tol)
    assert math.isnan(sub.mean_ci[0])
    assert sub.mean_excluding_first == pytest.approx(sub.mean, abs=1e-12)
    only0 = angular_deficit(tiny, tiny_tokens, layers=0, n_bootstrap=0)
    assert math.isnan(only0.mean_excluding_first)


def test_deficit_masks_and_counts_zero_norm_tokens(tiny, tiny_tokens):
    """A user hook zeroes resid_pre of position 3 at layer 1: those tokens are dropped and counted."""
    hp = tiny.hook_dict["blocks.1.hook_resid_pre"]

    def zero_pos3(act, hook):
        act = act.clone()
        act[:, 3] = 0.0
        return act

    hp.add_hook(zero_pos3)
    try:
        res = angular_deficit(tiny, tiny_tokens, n_bootstrap=0)
        assert hook_count(tiny) == 1  # the user's hook stays, ours are gone
    finally:
        hp.remove_hooks()
    n_seq, n_pos = tiny_tokens.shape
    assert res.n_masked.tolist() == [0, n_seq]
    assert res.n_tokens_used.tolist() == [n_seq * (n_pos - 1), n_seq * (n_pos - 2)]
    assert torch.isfinite(res.deficit).all()


# ----------------------------------------------------------------------------------------------------------
# FFN ablation


def _component_hooks(model, keep, layers, skip0=False):
    """Independent implementation of the radial/tangential/zero FFN patch (docs/ablation.md)."""
    hooks = []
    for lay in layers:
        ref = f"blocks.{lay}.hook_resid_pre" if _is_parallel(model, lay) else f"blocks.{lay}.hook_resid_mid"
        st = {}

        def stash(act, hook, st=st):
            st["u"] = act.double() / act.double().norm(dim=-1, keepdim=True)

        def patch(act, hook, st=st):
            u, phi = st["u"], act.double()
            rad = (phi * u).sum(-1, keepdim=True) * u
            new = {"radial": rad, "tangential": phi - rad, "zero": torch.zeros_like(phi)}[keep]
            if skip0:
                new[:, 0] = phi[:, 0]
            return new.to(act.dtype)

        hooks += [(ref, stash), (f"blocks.{lay}.hook_mlp_out", patch)]
    return hooks


def _metrics(model, tokens, hooks, clean_logits):
    with torch.no_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
    lp, lq = F.log_softmax(clean_logits[:, :-1].double(), -1), F.log_softmax(logits[:, :-1].double(), -1)
    ce = -lq.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (lp.argmax(-1) == lq.argmax(-1)).double()
    return float(ce.mean()), float(kl.mean()), float(top1.mean())


def test_ablation_matches_independent_hooks(tiny, tiny_tokens, results):
    res: AblationResult = results["ablation"]
    n_layers = tiny.cfg.n_layers
    with torch.no_grad():
        clean_logits = tiny(tiny_tokens)
    clean = -F.log_softmax(clean_logits[:, :-1].double(), -1).gather(-1, tiny_tokens[:, 1:, None]).mean()
    assert res.clean_loss == pytest.approx(float(clean), abs=TOL)
    assert res.variants == ["tangential", "radial", "zero", "random_tangent"]
    for keep in ("tangential", "radial", "zero"):
        ce, kl, top1 = _metrics(tiny, tiny_tokens, _component_hooks(tiny, keep, range(n_layers)), clean_logits)
        assert res.delta_loss[keep] == pytest.approx(ce - float(clean), abs=TOL)
        assert res.kl[keep] == pytest.approx(kl, abs=TOL)
        assert res.top1_agreement[keep] == pytest.approx(top1, abs=TOL)
        assert res.ratio_to_zero[keep] == pytest.approx(res.delta_loss[keep] / res.delta_loss["zero"], rel=1e-12)
        for lay in range(n_layers):
            ce, kl, _ = _metrics(tiny, tiny_tokens, _component_hooks(tiny, keep, [lay]), clean_logits)
            assert res.per_layer_delta_loss[keep][lay] == pytest.approx(ce - float(clean), abs=TOL)
            assert res.per_layer_kl[keep][lay] == pytest.approx(kl, abs=TOL)
        lo, hi = res.delta_loss_ci[keep]
        assert lo <= res.delta_loss[keep] <= hi
    assert res.kl["random_tangent"] > 0 and 0 <= res.top1_agreement["random_tangent"] <= 1
    assert res.ablate_position_0 is True and res.scope == "per_layer"
    assert res.per_sequence_delta_loss["zero"].mean() == pytest.approx(res.delta_loss["zero"], abs=1e-12)
    # position 0 kept intact
    keep0 = results["ablation_keep0"]
    assert keep0.ablate_position_0 is False and keep0.variants == ["tangential", "radial", "zero"]
    for keep in ("tangential", "radial", "zero"):
        ce, kl, top1 = _metrics(tiny, tiny_tokens, _component_hooks(tiny, keep, range(n_layers), skip0=True),
                                clean_logits)
        assert keep0.delta_loss[keep] == pytest.approx(ce - float(clean), abs=TOL)
        assert keep0.kl[keep] == pytest.approx(kl, abs=TOL)
    assert keep0.per_layer_delta_loss == {}


def test_ablation_random_tangent_is_seeded(tiny, tiny_tokens, results):
    again = ffn_ablation(tiny, tiny_tokens, keep="zero", layers=None, batch_size=2, n_bootstrap=0)
    assert again.delta_loss["random_tangent"] == pytest.approx(results["ablation"].delta_loss["random_tangent"],
                                                               abs=1e-12)
    other = ffn_ablation(tiny, tiny_tokens, keep="zero", batch_size=2, n_bootstrap=0, seed=5)
    assert other.delta_loss["random_tangent"] != again.delta_loss["random_tangent"]


def test_ablation_single_layer_scan_reuses_the_joint_run(tiny, tiny_tokens, results):
    one = ffn_ablation(tiny, tiny_tokens, keep="radial", scope="per_layer", layers=[1],
                       include_random_tangent=False, n_bootstrap=0)
    assert one.layers == [1] and one.variants == ["radial", "zero"]
    for v in ("radial", "zero"):
        assert float(one.per_layer_delta_loss[v][0]) == pytest.approx(one.delta_loss[v], abs=1e-12)
        assert float(one.per_layer_delta_loss[v][0]) == pytest.approx(
            float(results["ablation"].per_layer_delta_loss[v][1]), abs=TOL)


# ----------------------------------------------------------------------------------------------------------
# diversity


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


# ----------------------------------------------------------------------------------------------------------
# results: round trip, summary, plots; errors


@pytest.mark.parametrize("suffix", ["json", "safetensors"])
def test_results_round_trip(results, tmp_path, suffix):
    for name, res in results.items():
        path = res.save(tmp_path / f"{name}.{suffix}")
        back = type(res).load(path)
        assert type(back) is type(res)
        assert back.to_dict() == res.to_dict()
        assert Result.load(path).to_dict() == res.to_dict()


def test_summary_provenance_and_plots(results, tiny_tokens):
    for name, res in results.items():
        s = res.summary()
        assert s and all(isinstance(k, str) for k in s)
        assert res.provenance.n_sequences == tiny_tokens.shape[0] and res.provenance.seed == 0
        assert res.provenance.extra["protocol"] in ("angular_deficit", "ffn_ablation", "diversity")
        figs = [res.plot()] + ([res.plot_positions()] if name == "deficit" else [])
        assert all(isinstance(f, go.Figure) and len(f.data) > 0 for f in figs)


def test_bad_inputs_raise_package_errors(tiny, tiny_tokens):
    with pytest.raises(errors.InputError, match="integer ids"):
        angular_deficit(tiny, tiny_tokens.float())
    with pytest.raises(errors.LayerIndexError, match="out of range"):
        angular_deficit(tiny, tiny_tokens, layers=[7])
    with pytest.raises(errors.InputError, match="too short"):
        diversity(tiny, tiny_tokens[:, :1])
    with pytest.raises(errors.InputError, match="sideways"):  # the message names the bad value
        ffn_ablation(tiny, tiny_tokens, keep=("sideways",))
    with pytest.raises(errors.InputError, match="n_bootstrap"):
        ffn_ablation(tiny, tiny_tokens, n_bootstrap=-2)
    with pytest.raises(errors.InputError, match="scope"):
        ffn_ablation(tiny, tiny_tokens, scope="some")
    with pytest.raises(errors.InputError, match="batch_size"):
        angular_deficit(tiny, tiny_tokens, batch_size=0)
    with pytest.raises(errors.InputError, match="n_bootstrap"):
        angular_deficit(tiny, tiny_tokens, n_bootstrap=-1)
    with pytest.raises(errors.InputError, match="exclude_positions"):
        angular_deficit(tiny, tiny_tokens, exclude_positions=("first",))
    with pytest.raises(errors.InputError, match="full"):
        diversity(tiny, tiny_tokens, ablations=("full",))
    with pytest.raises(errors.InputError, match="gain"):
        diversity(tiny, tiny_tokens, gains=(float("inf"),))
    assert hook_count(tiny) == 0


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
