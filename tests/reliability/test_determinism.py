"""Determinism: the same seed gives bit-identical results on CPU for every protocol."""

import json

import pytest
import torch

import tl_steering as ts

from ._calls import PUBLIC_CALLS, tokens_for

# the calls whose output is a Result (compare to_dict minus the timestamp) or a tensor
DETERMINISTIC = [k for k in PUBLIC_CALLS if not k.startswith("hooks.")]


def _canonical(out):
    if isinstance(out, torch.Tensor):
        return out.detach().cpu().numpy().tobytes()
    return json.dumps(_drop_timings(out.to_dict()), sort_keys=True)


def _drop_timings(d):
    """Remove timestamps and timings at every depth (nested results, e.g. per-layer critical points, carry theirs)."""
    if isinstance(d, list):
        return [_drop_timings(x) for x in d]
    if not isinstance(d, dict):
        return d
    return {k: _drop_timings(v) for k, v in d.items() if k != "created" and "time" not in k and "seconds" not in k}


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_same_seed_bit_identical(name):
    model = ts.tiny_model("gpt2", backend="bridge", seed=0)
    tokens = tokens_for(model)
    a = _canonical(PUBLIC_CALLS[name](model, tokens))
    b = _canonical(PUBLIC_CALLS[name](model, tokens))
    assert a == b
