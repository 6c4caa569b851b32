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
    d = out.to_dict()
    d["provenance"].pop("created", None)
    d.pop("seconds", None)
    for key in list(d):
        if "time" in key or "seconds" in key:
            d.pop(key)
    return json.dumps(d, sort_keys=True)


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_same_seed_bit_identical(name):
    model = ts.tiny_model("gpt2", backend="bridge", seed=0)
    tokens = tokens_for(model)
    a = _canonical(PUBLIC_CALLS[name](model, tokens))
    b = _canonical(PUBLIC_CALLS[name](model, tokens))
    assert a == b
