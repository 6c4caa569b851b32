"""parallel_defect (docs/defect.md) on the tiny models of every architecture and backend.

The scores are recomputed independently from TransformerLens's own ``run_with_cache`` and direct calls of the
block's ``ln2`` / ``mlp`` modules (``torch.autograd.functional.jvp`` for the first-order term, not
``torch.func``), on a float64 copy of each tiny model; the mean-value integral form of the defect is checked
with 8-point Gauss-Legendre; the first-order estimate must converge to the exact defect as the attention write
is scaled down. Losses behind every curve point are re-run with ``parallel_blocks``.
"""

import math

import numpy as np
import pytest
import torch

import tl_steering as ts
from tests.helpers import first_output
from tl_steering.backends import adapt, weights_fingerprint
from tl_steering.errors import InputError
from tl_steering.hooks import attention_gain, parallel_blocks
from tl_steering.parallel.defect import (
    BRACKET_TERMS,
    DEFECT_VARIANTS,
    SPEEDUP_LABEL,
    DefectResult,
    default_k_values,
    parallel_defect,
)

EXCLUDED = 1  # positions 1.. enter the pooled statistics (exclude_positions=(0,))


def _arch(model) -> str:
    return adapt(model).info.name.removeprefix("tiny-")


@pytest.fixture(scope="module")
def result(tiny, tiny_tokens):
    """One full run per tiny model (fp32): brackets, gold standard, timing."""
    return parallel_defect(tiny, tiny_tokens, brackets=True, evaluate=True, n_random=2, timing=True,
                           timing_repeats=2)


@pytest.fixture(scope="module")
def tiny64(tiny):
    """A fresh float64 copy of the same tiny model (same arch, backend, seed)."""
    ad = adapt(tiny)
    return ts.tiny_model(_arch(tiny), backend=ad.backend, seed=0).to(torch.float64)


@pytest.fixture(scope="module")
def result64(tiny64, tiny_tokens):
    return parallel_defect(tiny64, tiny_tokens, brackets=True, timing=False)


def _independent(model, tokens):
    """Per layer: d, J a, P_u d, Phi(x + a), Dx at the kept positions (TL's cache + direct module calls)."""
    _, cache = model.run_with_cache(tokens)
    out = []
    for layer, blk in enumerate(model.blocks):
        x = cache[f"blocks.{layer}.hook_resid_pre"]
        a = cache[f"blocks.{layer}.hook_attn_out"]
        post = cache[f"blocks.{layer}.hook_resid_post"]
        ln2 = getattr(blk, "ln2", None) or blk.ln1

        def phi(z, blk=blk, ln2=ln2):
            return first_output(blk.mlp(first_output(ln2(z))))

        with torch.no_grad():
            y = x + a  # = resid_mid (sequential); the counterfactual FFN input (parallel)
            d = phi(y) - phi(x)
        _, ja = torch.autograd.functional.jvp(phi, (x,), (a,))
        u = y / y.norm(dim=-1, keepdim=True)
        tan = d - (u * d).sum(-1, keepdim=True) * u
        keep = slice(EXCLUDED, None)
        out.append({k: v[:, keep].detach().to(torch.float64) for k, v in
                    {"d": d, "ja": ja, "tan": tan, "phi": phi(y), "dx": post - x}.items()})
    return out


def _ss(v):
    return float((v * v).sum())


# ----------------------------------------------------------------------------------------------------------
# definitions


def test_scores_match_independent_recompute_float64(tiny64, tiny_tokens, result64):
    ad = adapt(tiny64)
    terms = _independent(tiny64, tiny_tokens)
    for i, t in enumerate(terms):
        expected = {"C": math.sqrt(_ss(t["d"]) / _ss(t["dx"])),
                    "C_phi": math.sqrt(_ss(t["d"]) / _ss(t["phi"])),
                    "C1": math.sqrt(_ss(t["ja"]) / _ss(t["dx"])),
                    "C_tan": math.sqrt(_ss(t["tan"]) / _ss(t["dx"]))}
        nu = math.sqrt(_ss(t["d"] - t["ja"]) / _ss(t["d"]))
        got = result64.counterfactual_scores
        for k, v in expected.items():
            assert float(got[k][i]) == pytest.approx(v, rel=1e-9), (i, k)
        assert float(result64.counterfactual_nonlinearity[i]) == pytest.approx(nu, rel=1e-9)
        if ad.is_parallel(i):
            continue
        for k, v in expected.items():
            assert float(result64.scores[k][i]) == pytest.approx(v, rel=1e-9), (i, k)
        assert float(result64.nonlinearity[i]) == pytest.approx(nu, rel=1e-9)
        n = t["d"].shape[0] * t["d"].shape[1]
        assert float(result64.rms["defect"][i]) == pytest.approx(math.sqrt(_ss(t["d"]) / n), rel=1e-9)
        assert float(result64.rms["update"][i]) == pytest.approx(math.sqrt(_ss(t["dx"]) / n), rel=1e-9)
    assert result64.n_tokens == tiny_tokens.shape[0] * (tiny_tokens.shape[1] - EXCLUDED)
    assert float(result64.phi_check.max()) < 1e-12


def test_scores_match_float64_copy_in_float32(result, result64):
    """The fp32 run (geometry in float64) agrees with the float64 model to fp32 rounding."""
    for k in DEFECT_VARIANTS:
        torch.testing.assert_close(result.scores[k], result64.scores[k], rtol=1e-4, atol=1e-7)
    assert float(result.phi_check.max()) <= 1e-5
    assert result.score is not result.scores["C"] and torch.equal(result.score, result.scores["C"])


def test_integral_form_gauss_legendre(tiny64, tiny_tokens, result64):
    """d = int_0^1 J_Phi(x + t a) a dt (8-point Gauss-Legendre), to ~1e-6 relative in float64."""
    ad = adapt(tiny64)
    nodes, weights = np.polynomial.legendre.leggauss(8)
    _, cache = ad.run_with_cache(tiny_tokens, ad.identity_names())
    for layer in range(ad.n_layers):
        x = cache[ad.hook_name(layer, "resid_pre")]
        a = cache[ad.hook_name(layer, "attn_out")]
        phi = ad.ffn(layer)
        with torch.no_grad():
            d = phi(x + a) - phi(x)
            quad = torch.zeros_like(d)
            for t, w in zip(nodes, weights):
                _, jv = torch.func.jvp(phi, (x + float((t + 1) / 2) * a,), (a,))
                quad += float(w / 2) * jv
        rel = float((quad - d)[:, 1:].norm() / d[:, 1:].norm())
        assert rel < 1e-6, (layer, rel)
        dx = cache[ad.hook_name(layer, "resid_post")] - x
        c_quad = float(quad[:, 1:].norm() / dx[:, 1:].norm())
        assert float(result64.counterfactual_scores["C"][layer]) == pytest.approx(c_quad, rel=1e-6)


def test_first_order_converges_as_attention_is_scaled_down(tiny64, tiny_tokens):
    """||J(eps a)|| / ||Phi(x + eps a) - Phi(x)|| -> 1 and nu -> 0 (as O(eps)) when attention writes eps a.

    The scaled write comes from a user hook (``attention_gain``) that parallel_defect must respect. Read from
    the counterfactual scores, which equal the scores on sequential blocks and give the same check on NeoX.
    """
    ratios, nus = {}, {}
    for eps in (1e-1, 1e-2, 1e-3):
        with tiny64.hooks(fwd_hooks=attention_gain(tiny64, eps)):
            r = parallel_defect(tiny64, tiny_tokens, timing=False)
        ratios[eps] = r.counterfactual_scores["C1"] / r.counterfactual_scores["C"]
        nus[eps] = r.counterfactual_nonlinearity
    assert float((ratios[1e-3] - 1).abs().max()) < 1e-3
    assert float(nus[1e-3].max()) < 1e-2
    # first order in eps: each tenfold shrink of eps shrinks nu about tenfold
    assert bool((nus[1e-2] < 0.2 * nus[1e-1]).all()) and bool((nus[1e-3] < 0.2 * nus[1e-2]).all())
    assert sum(len(hp.fwd_hooks) for hp in tiny64.hook_dict.values()) == 0


def test_brackets_recomputed_independently(tiny64, tiny_tokens, result64):
    """DA.Phi (JVP of the attention sublayer over the sequence in the direction Phi(X)) against reverse-mode
    AD (``torch.autograd.functional.jvp``) and a central difference.

    The central difference uses h = 3e-3 and a 5e-4 tolerance: TransformerBridge attention runs its softmax in
    float32 even in a float64 model, which puts ~1e-7 noise into A(X) (a small-h difference would amplify it).
    """
    ad = adapt(tiny64)
    _, cache = ad.run_with_cache(tiny_tokens, ad.identity_names())
    assert set(result64.brackets) == set(BRACKET_TERMS)
    for layer in range(ad.n_layers):
        x = cache[ad.hook_name(layer, "resid_pre")]
        attn, phi = ad.attention(layer), ad.ffn(layer)
        with torch.no_grad():
            v = phi(x)
            h = 3e-3
            fd = (attn(x + h * v) - attn(x - h * v)) / (2 * h)
            _, ja = torch.func.jvp(phi, (x,), (cache[ad.hook_name(layer, "attn_out")],))
        _, da = torch.autograd.functional.jvp(attn, (x,), (v,))
        n = da[:, 1:].shape[0] * da[:, 1:].shape[1]
        rms = lambda t: math.sqrt(_ss(t[:, 1:].detach()) / n)  # noqa: E731
        assert float(result64.brackets["DA_Phi"][layer]) == pytest.approx(rms(da), rel=1e-9)
        assert float(result64.brackets["DA_Phi"][layer]) == pytest.approx(rms(fd), rel=5e-4)
        assert float(result64.brackets["DPhi_A"][layer]) == pytest.approx(rms(ja), rel=1e-9)
        assert float(result64.brackets["bracket"][layer]) == pytest.approx(rms(ja - da), rel=1e-9)


# ----------------------------------------------------------------------------------------------------------
# parallel blocks


def test_already_parallel_blocks(tiny, result):
    ad = adapt(tiny)
    par = [ad.is_parallel(i) for i in range(ad.n_layers)]
    assert result.already_parallel == par
    if _arch(tiny) != "neox":
        assert not any(par)
        assert bool((result.score > 0).all()) and bool(torch.isfinite(result.nonlinearity).all())
        return
    assert all(par) and result.candidates == []
    # measured, not set: hook_mlp_out - Phi(resid_pre) is 0 for a block that is its own parallel surrogate
    assert float(result.score.abs().max()) <= 1e-6
    assert torch.equal(result.scores["C1"], torch.zeros(ad.n_layers, dtype=torch.float64))
    assert bool(torch.isnan(result.nonlinearity).all())
    assert torch.equal(result.delta_ce, torch.zeros(ad.n_layers, dtype=torch.float64))
    assert bool((result.counterfactual_scores["C"] > 0.05).all())  # a sequential ordering would differ
    assert result.plan(0) == []
    with pytest.raises(InputError):
        result.plan(1)
    assert result.k_values == [0] and float(result.curves["lowest"][0]) == 0.0


# ----------------------------------------------------------------------------------------------------------
# plans, curves and the gold standard


def test_plan_returns_lowest_sequential_layers():
    scores = torch.tensor([0.5, 0.1, 0.0, 0.3, 0.2, 0.1], dtype=torch.float64)
    res = DefectResult(layers=[0, 1, 2, 3, 4, 5], already_parallel=[False, False, True, False, False, False],
                       scores={"C": scores, "C1": scores.flip(0)})
    assert torch.equal(res.score, scores)
    assert res.candidates == [0, 1, 3, 4, 5]
    assert res.plan(0) == []
    assert res.plan(2) == [1, 5]  # tie 0.1/0.1: both; layer 2 is parallel already and never chosen
    assert res.plan(3) == [1, 4, 5]
    assert res.plan(5) == [0, 1, 3, 4, 5]
    assert res.plan(2, variant="C1") == [0, 3]  # C1 = [0.1, 0.2, (0.3), 0.0, 0.1, 0.5]: tie 0/4 -> layer 0
    for bad in (-1, 6, 1.5, True):
        with pytest.raises(InputError):
            res.plan(bad)
    with pytest.raises(InputError):
        res.plan(1, variant="nope")


def test_plan_and_curves_match_reruns(tiny, tiny_tokens, result):
    ad = adapt(tiny)
    cand = result.candidates
    assert result.k_values == default_k_values(len(cand))
    clean = float(ad.loss_per_token(tiny_tokens).mean())
    assert result.clean_loss == pytest.approx(clean, abs=1e-9)
    for i, layer in enumerate(result.layers):
        if layer in cand:
            ce = float(ad.loss_per_token(tiny_tokens, parallel_blocks(tiny, [layer])).mean())
            assert float(result.delta_ce[i]) == pytest.approx(ce - clean, abs=1e-9)
    k_list = result.curves["k"].tolist()
    assert k_list == result.k_values
    for j, k in enumerate(k_list):
        assert result.curve_layers["lowest"][j] == result.plan(k)
        hi = sorted(cand, key=lambda lay: -float(result.score[result.layers.index(lay)]))[:k]
        assert result.curve_layers["highest"][j] == sorted(hi)
        window = result.curve_layers["contiguous"][j]
        if k:
            start = cand.index(window[0])
            assert window == cand[start:start + k]
        else:
            assert window == []
        for draw in result.curve_layers["random"]:
            assert len(draw[j]) == len(set(draw[j])) == k and set(draw[j]) <= set(cand)
        # parallel_blocks on the plan gives the curve value
        plan = result.plan(k)
        ce = float(ad.loss_per_token(tiny_tokens, parallel_blocks(tiny, plan) if plan else []).mean())
        assert float(result.curves["lowest"][j]) == pytest.approx(ce - clean, abs=1e-9)
    assert result.curves["random"].shape == (2, len(k_list))
    torch.testing.assert_close(result.curves["random_mean"], result.curves["random"].mean(0))
    if len(cand) >= 3:
        assert all(-1 <= v <= 1 for v in result.spearman.values())
    else:  # the tiny models have 2 layers: a rank correlation of 2 points says nothing
        assert all(math.isnan(v) for v in result.spearman.values())


def test_random_draws_are_seeded(tiny, tiny_tokens, result):
    again = parallel_defect(tiny, tiny_tokens, evaluate=True, n_random=2, timing=False)
    assert again.curve_layers["random"] == result.curve_layers["random"]
    torch.testing.assert_close(again.curves["random"], result.curves["random"], rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------
# timing and the speedup estimate


def test_timing_and_speedup(tiny, tiny_tokens, result):
    cand = result.candidates
    assert bool((result.t_attn > 0).all()) and bool((result.t_ffn > 0).all())
    assert result.t_forward > 0 and result.t_other >= 0
    assert result.timing_shape == [2, 16] and result.timing_device == "cpu"  # timing_windows=2 of the 3 windows
    one = parallel_defect(tiny, tiny_tokens, timing=True, timing_repeats=1, timing_windows=3, batch_size=1)
    assert one.timing_shape == [1, 16] and one.options["timing_windows"] == 3  # at most one forward's batch
    est = result.speedup_estimate(result.plan(len(cand) // 2))
    assert est["label"] == SPEEDUP_LABEL
    assert est["speedup"] >= 1.0 and est["speedup_with_other"] >= 1.0
    assert result.speedup_estimate([])["speedup"] == pytest.approx(1.0)
    with pytest.raises(InputError):
        result.speedup_estimate([99])


def test_timing_is_opt_in(tiny, tiny_tokens):
    """A scoring call measures nothing by default: deterministic and fast; no speedup estimate without times."""
    a = parallel_defect(tiny, tiny_tokens)
    b = parallel_defect(tiny, tiny_tokens)
    assert not a.options["timing"] and bool(torch.isnan(a.t_attn).all()) and math.isnan(a.t_forward)
    for k in a.scores:
        torch.testing.assert_close(a.scores[k], b.scores[k], rtol=0, atol=0, equal_nan=True)
    with pytest.raises(InputError, match="timing=True"):
        a.speedup_estimate([])


def test_speedup_formula():
    """Uniform layers, k = L/2: speedup = 2 (a + m) / ((a + m) + max(a, m)) (docs/defect.md)."""
    a, m = 0.63, 1.0
    res = DefectResult(layers=list(range(4)), scores={"C": torch.arange(4.0, dtype=torch.float64)},
                       t_attn=torch.full((4,), a, dtype=torch.float64),
                       t_ffn=torch.full((4,), m, dtype=torch.float64), t_other=0.5)
    est = res.speedup_estimate(res.plan(2))
    assert est["layers"] == [0, 1]
    assert est["speedup"] == pytest.approx(2 * (a + m) / ((a + m) + max(a, m)))
    assert est["T_seq_s"] == pytest.approx(4 * (a + m))
    assert est["T_par_s"] == pytest.approx(2 * (a + m) + 2 * m)
    assert est["speedup_with_other"] == pytest.approx((4 * (a + m) + 0.5) / (2 * (a + m) + 2 * m + 0.5))
    with pytest.raises(InputError):
        DefectResult(layers=[0], scores={"C": torch.zeros(1, dtype=torch.float64)}).speedup_estimate([0])


# ----------------------------------------------------------------------------------------------------------
# hygiene, serialisation, display, errors


def test_suite_run_reuses_the_window_sums_of_an_earlier_call(tiny, tiny_tokens, monkeypatch):
    """Inside a suite run (shared_clean_forwards) a call on windows an earlier call held (in any order), with no
    more terms than it measured, measures nothing: its scores are the earlier call's sums at those rows, equal to a
    fresh call's up to float32 rounding of the batch; a call asking for brackets the earlier one lacks, or on other
    windows, measures."""
    import tl_steering.parallel.defect as defect_module
    from tl_steering.backends.adapter import shared_clean_forwards

    measured = []
    real = defect_module._window_sums
    monkeypatch.setattr(defect_module, "_window_sums", lambda ad, tokens, *a: measured.append(tokens) or
                        real(ad, tokens, *a))
    part = tiny_tokens[1:3]
    assert tiny_tokens.shape[0] == 3
    fresh = parallel_defect(tiny, part, brackets=True)
    with shared_clean_forwards(tiny):
        parallel_defect(tiny, tiny_tokens, brackets=False)
        with_brackets = parallel_defect(tiny, part, brackets=True)  # the kept sums lack the brackets: measured
        reused = parallel_defect(tiny, part)  # rows 1-2 of the call with brackets, or of the first: not measured
        flipped = parallel_defect(tiny, part.flip(0))  # the same windows in the other order: not measured
        parallel_defect(tiny, part.flip(-1))  # other windows: measured
    assert [t.shape[0] for t in measured] == [2, 3, 2, 2]
    assert torch.equal(measured[3], part.flip(-1))
    for name in DEFECT_VARIANTS:
        torch.testing.assert_close(flipped.scores[name], reused.scores[name], rtol=1e-12, atol=0.0, equal_nan=True)
    for got in (reused, with_brackets):
        for name in DEFECT_VARIANTS:
            torch.testing.assert_close(got.scores[name], fresh.scores[name], rtol=1e-5, atol=1e-9, equal_nan=True)
        for name, value in fresh.peer_scores.items():
            torch.testing.assert_close(got.peer_scores[name], value, rtol=1e-5, atol=1e-9, equal_nan=True)
        assert got.n_tokens == fresh.n_tokens
    assert reused.brackets == {} and set(with_brackets.brackets) == set(BRACKET_TERMS)
    for name in BRACKET_TERMS:
        torch.testing.assert_close(with_brackets.brackets[name], fresh.brackets[name], rtol=1e-5, atol=1e-9)


def test_no_hooks_left_and_weights_unchanged(tiny, tiny_tokens):
    before = weights_fingerprint(tiny)
    k_values = [0] if _arch(tiny) == "neox" else [0, 1]
    parallel_defect(tiny, tiny_tokens[:1], brackets=True, evaluate=True, k_values=k_values, n_random=1,
                    timing=False)
    assert sum(len(hp.fwd_hooks) + len(hp.bwd_hooks) for hp in tiny.hook_dict.values()) == 0
    assert weights_fingerprint(tiny) == before


@pytest.mark.parametrize("suffix", [".json", ".safetensors"])
def test_save_load_round_trip(result, tmp_path, suffix):
    path = result.save(tmp_path / f"defect{suffix}")
    back = DefectResult.load(path)
    assert back.layers == result.layers and back.already_parallel == result.already_parallel
    for group in ("scores", "counterfactual_scores", "rms", "brackets", "curves"):
        a, b = getattr(result, group), getattr(back, group)
        assert set(a) == set(b)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True)
    for name in ("score", "nonlinearity", "delta_ce", "t_attn", "t_ffn", "phi_check"):
        torch.testing.assert_close(getattr(result, name), getattr(back, name), rtol=0, atol=0, equal_nan=True)
    assert back.curve_layers == result.curve_layers and back.k_values == result.k_values
    assert back.summary().keys() == result.summary().keys()
    assert back.provenance.extra["exclude_positions"] == [0]
    assert back.provenance.seed == 0 and back.provenance.n_sequences == 3


def test_summary_and_plots(result):
    s = result.summary()
    assert s["n_layers"] == len(result.layers) and s["n_tokens"] == 45
    assert "clean_loss" in s and "k_half" in s
    fig = result.plot()
    assert len(fig.data) >= len(DEFECT_VARIANTS)
    assert len(result.plot_curves().data) >= 4


def test_bad_inputs(tiny, tiny_tokens):
    with pytest.raises(InputError):
        parallel_defect(tiny, tiny_tokens, k_values=[99], evaluate=True, timing=False)
    with pytest.raises(InputError):
        parallel_defect(tiny, tiny_tokens, n_random=-1, timing=False)
    with pytest.raises(InputError):
        parallel_defect(tiny, tiny_tokens, exclude_positions=tuple(range(16)), timing=False)
    with pytest.raises(InputError):
        parallel_defect(tiny, tiny_tokens.float(), timing=False)
    res = parallel_defect(tiny, tiny_tokens, layers=[1], timing=False)
    assert res.layers == [1] and len(res.score) == 1 and not res.evaluated
    with pytest.raises(InputError):
        res.plot_curves()
    with pytest.raises(InputError):
        res.speedup_estimate([])
