"""The affine and linear refits of the parallel FFN writes on SmolLM2-135M (docs/parallel.md "Refit"): pinned
held-out numbers.

The 8 pydoc windows of ``smollm2_tokens`` (seed 0, 128 tokens): the first 4 calibrate (every fit), the last 4 are
held out. The plans are those ``plan_parallel`` chose on the calibration windows at k = 15 (benchmarks/plan_refit.py,
2026-12-04): the paper's 15 lowest-C layers and the chosen ``greedy_measured`` plan (also chosen with the affine
refit). Measured on TL 4.3 (bridge); the tolerances cover the ~1e-5 relative activation differences of the TL 3.9
HookedTransformer. About 10 forwards of 4 x 128 tokens (slow-marked: 42 s on TL 4.3, 79 s on TL 3.9, one thread, shared machine).
"""

import pytest

from tests.helpers import assert_no_hooks
from tl_steering.data.batching import mean_loss
from tl_steering.hooks import parallel_blocks
from tl_steering.parallel.refit import RefitLoss

pytestmark = [pytest.mark.integration, pytest.mark.slow]

C_PLAN = [6, 7, 8, 9, 10, 11, 21, 22, 23, 24, 25, 26, 27, 28, 29]
BEST = [5, 6, 7, 8, 9, 17, 18, 20, 21, 22, 23, 24, 25, 26, 27]


def test_affine_refit_halves_the_c_plan_loss(smollm2, smollm2_tokens):
    cal, held = smollm2_tokens[:4], smollm2_tokens[4:]
    clean_c, clean_h = mean_loss(smollm2, cal, [], 4), mean_loss(smollm2, held, [], 4)
    out = {}
    for name, plan in (("C", C_PLAN), ("best", BEST)):
        rl = RefitLoss(smollm2, cal, 4, refit="affine", share_prefix=False, crossfit=False)
        loss, (gates, biases, _) = rl(plan), rl.fitted(plan)
        assert rl.passes == 1  # the fit rides in the measuring forward
        held_d = mean_loss(smollm2, held, parallel_blocks(smollm2, plan, gates, biases), 4) - clean_h
        out[name] = (loss - clean_c, held_d)
    c_plain = mean_loss(smollm2, held, parallel_blocks(smollm2, C_PLAN), 4) - clean_h
    assert c_plain == pytest.approx(0.3156, abs=2e-3)
    assert out["C"][0] == pytest.approx(0.2157, abs=2e-3) and out["C"][1] == pytest.approx(0.2321, abs=2e-3)
    assert out["best"][0] == pytest.approx(0.1650, abs=2e-3) and out["best"][1] == pytest.approx(0.1529, abs=2e-3)
    # the target against the paper's uncorrected plan is met (0.485), against the corrected one it is not
    assert out["best"][1] / c_plain == pytest.approx(0.485, abs=0.01)
    assert out["best"][1] / c_plain <= 0.5 < out["best"][1] / out["C"][1]
    assert_no_hooks(smollm2)


ATTR_ABS = [6, 7, 8, 9, 14, 15, 18, 20, 21, 22, 23, 24, 25, 26, 27]
#: held-out dCE with the linear refit (TL 4.3 bridge and TL 3.9 bridge, one thread, 2026-12-04: 0.12841, 0.09247)
LINEAR_HELD = {"C": 0.1284, "attribution_abs": 0.0925}


def test_linear_refit_held_out_and_executor(smollm2, smollm2_tokens):
    """refit="linear" (g Phi(x) + b + a W, ridge): fitted on the 4 calibration windows, held out on the other 4.
    ATTR_ABS is the plan ``plan_parallel(cal, 15, strategies=ONE_SHOT_COMPARISON, refit="linear")`` chose on one
    thread (at two threads it chose the lowest-C variant 6-10, 20-29 by a near-tie of the cross-fitted calibration
    loss; both stay below half of the C plan held out, docs/parallel.md). The executor folds W into W_O."""
    from tl_steering.parallel.apply import parallelize
    from tl_steering.parallel.refit import fit_corrections

    cal, held = smollm2_tokens[:4], smollm2_tokens[4:]
    clean_h = mean_loss(smollm2, held, [], 4)
    c_plain = mean_loss(smollm2, held, parallel_blocks(smollm2, C_PLAN), 4) - clean_h
    out = {}
    for name, plan in (("C", C_PLAN), ("attribution_abs", ATTR_ABS)):
        w: dict = {}
        g, b, passes = fit_corrections(smollm2, cal, plan, "linear", batch_size=4, linears=w)
        assert passes == 1 and sorted(w) == plan
        out[name] = (mean_loss(smollm2, held, parallel_blocks(smollm2, plan, g, b, w), 4) - clean_h, g, b, w)
    assert out["C"][0] == pytest.approx(LINEAR_HELD["C"], abs=3e-3)
    assert out["attribution_abs"][0] == pytest.approx(LINEAR_HELD["attribution_abs"], abs=3e-3)
    assert out["attribution_abs"][0] / c_plain <= 0.5 and out["C"][0] / c_plain <= 0.5
    held_d, g, b, w = out["attribution_abs"]
    par = parallelize(smollm2, ATTR_ABS, gates=g, biases=b, linears=w)
    assert mean_loss(par, held, [], 4) - clean_h == pytest.approx(held_d, abs=1e-5)
    assert_no_hooks(smollm2)
