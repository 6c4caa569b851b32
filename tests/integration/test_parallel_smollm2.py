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
