"""Streaming probe on the real SmolLM2-135M: equals the cache route; its memory does not grow with forwards."""

import gc
import warnings

import pytest
import torch

from tests.unit.probing.test_trace import assert_matches, assert_no_hooks, cache_for, reference_metrics
from tl_steering.probing.trace import ALL_QUANTITIES, probe

pytestmark = pytest.mark.integration


def _n_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_probe_equals_cache_route_smollm2(smollm2, smollm2_tokens):
    tokens = smollm2_tokens[:2]
    with probe(smollm2, metrics="all", corpus="pydoc:2x128:seed0") as trace:
        for b in range(tokens.shape[0]):  # one window per forward: the sums merge across forwards
            smollm2(tokens[b:b + 1])
    assert_no_hooks(smollm2)
    res = trace.result()
    assert res.n_forwards == 2 and res.n_tokens == tokens.numel()
    assert set(res.quantities) == set(ALL_QUANTITIES)
    assert_matches(res, reference_metrics(smollm2, cache_for(smollm2, tokens)), tol=1e-6)
    # real numbers, not just agreement: all finite on this sequential model, and sane ranges
    for q in res.quantities:
        assert torch.isfinite(res.get(q)).all(), q
    assert ((res.get("tangent_alignment") > -1) & (res.get("tangent_alignment") < 1)).all()
    assert (res.get("effective_rank_post") >= 1).all() and (res.get("effective_rank_post") <= 127).all()


def test_probe_memory_flat_smollm2(smollm2, smollm2_tokens):
    """The accumulator state and the number of live tensors do not depend on the number of forwards."""
    tokens = smollm2_tokens[:1, :64]
    with probe(smollm2, position_bins=True) as trace:
        smollm2(tokens)
        size, live = trace.state_nbytes(), _n_tensors()
        for _ in range(3):
            smollm2(tokens)
        assert trace.state_nbytes() == size
        assert _n_tensors() <= live
    assert trace.result().n_forwards == 4
    assert size < 200_000  # a few hundred numbers per layer, nothing the size of an activation
