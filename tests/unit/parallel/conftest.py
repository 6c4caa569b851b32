"""Fixtures shared by the planner tests of this room (test_plan.py, test_defect_peers.py)."""

import pytest
import torch

import tl_steering as ts
from tl_steering.backends import adapt


@pytest.fixture(scope="module")
def tiny64(tiny):
    """A float64 copy of the session's tiny model (same architecture, backend and seed)."""
    ad = adapt(tiny)
    return ts.tiny_model(ad.info.name.removeprefix("tiny-"), backend=ad.backend, seed=0).to(torch.float64)


@pytest.fixture(scope="module")
def planner_tokens():
    return torch.randint(1, 257, (4, 12), generator=torch.Generator().manual_seed(5))
