"""The parallel executor on SmolLM2-135M: fused parallel blocks equal the hook-based surrogate."""

import pytest
import torch

from tl_steering.backends import adapt, weights_fingerprint
from tl_steering.hooks import parallel_blocks
from tl_steering.parallel.apply import parallelize

pytestmark = pytest.mark.integration

LAYERS = [3, 14, 27]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_smollm2_parallel_equals_surrogate(smollm2, smollm2_tokens):
    tokens = smollm2_tokens[:2]
    fp = weights_fingerprint(smollm2)
    par = parallelize(smollm2, LAYERS)
    ad, adp = adapt(smollm2), adapt(par)
    names = [ad.hook_name(lay, "resid_post") for lay in LAYERS]
    ref_logits, ref = ad.run_with_cache(tokens, names, fwd_hooks=parallel_blocks(smollm2, LAYERS))
    logits, got = adp.run_with_cache(tokens, names)
    for n in names:
        assert rel(got[n], ref[n]) < 1e-4, n
    assert rel(logits, ref_logits) < 1e-4
    # the loss moves a little, not a lot, for three parallel layers
    d_loss = float(adp.loss_per_token(tokens).mean() - ad.loss_per_token(tokens).mean())
    assert abs(d_loss) < 0.5
    assert [adp.is_parallel(i) for i in LAYERS] == [True] * 3 and not ad.any_parallel
    assert weights_fingerprint(smollm2) == fp


def test_smollm2_plan_on_one_short_window_says_what_it_knows(smollm2, smollm2_tokens):
    """The README's old call (issue 36): one 32-token window calibrates, one is held out. The plan records and
    warns once that nothing could be cross-fitted (its calibration dCE is in-sample), fits each linear map with the
    ridge 31 tokens carry (df <= 14.5), and every figure carries a 95 % interval that contains it."""
    import warnings

    import tl_steering as ts
    from tl_steering.parallel.strategies import choose

    tokens = smollm2_tokens[:2, :32]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = ts.plan_parallel(smollm2, tokens, 4, strategy=["C", "attribution_abs"], fisher_samples=0)
    said = [str(w.message) for w in caught if str(w.message).startswith("plan_parallel:")]
    assert len(said) == 1 and "31 fitted tokens" in said[0] and "14.5" in said[0]
    assert plan.calibration_fit == "in-sample" and plan.refit == "linear" and plan.options["refit_carry"]
    s = plan.summary()
    for name in ("calibration_delta_ce", "held_out_delta_ce", "held_out_delta_ce_uncorrected"):
        lo, hi = s[name + "_interval"]
        assert lo <= s[name] <= hi and hi - lo > 0, name
    for strat in plan.strategies:
        lo, hi = s[f"held_out_delta_ce_{strat}_interval"]
        assert lo <= s[f"held_out_delta_ce_{strat}"] <= hi
    assert plan.strategy == choose(plan.at_k("calibration"), plan.strategies, "C", plan.margins,
                                   plan.margins_uncorrected)
