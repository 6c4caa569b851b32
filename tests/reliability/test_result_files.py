"""Every public call's result survives save -> load (JSON and safetensors) under the strict loader: the field
annotations the loader checks agree with what the protocols really store."""

import pytest
import torch

import tl_steering as ts
from tl_steering.results import Result

from ._calls import PUBLIC_CALLS, tokens_for


@pytest.fixture(scope="module")
def model():
    return ts.tiny_model("gpt2", backend="bridge", seed=0)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


# critical_points is left out: one call takes ~10 s on a tiny model (its own tests round-trip its results)
@pytest.mark.parametrize("name", [k for k in PUBLIC_CALLS if not k.startswith("hooks.")
                                  and k not in ("parallelize", "text_tokens", "critical_points")])
def test_result_round_trips_strictly(model, name, tmp_path):
    res = PUBLIC_CALLS[name](model, tokens_for(model))
    assert isinstance(res, Result), type(res)
    for suffix in (".json", ".safetensors"):
        back = type(res).load(res.save(tmp_path / f"r{suffix}"))
        assert _same(res, back), suffix
