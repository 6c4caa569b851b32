"""Deep copies of a user's model or block that never fail on transient autograd state."""

import copy
from typing import Any

from torch import Tensor


def deepcopy_module(module: Any) -> Any:
    """``copy.deepcopy`` that survives transient non-leaf tensors some bridge components keep from the last
    forward run with autograd on (``deepcopy`` refuses non-leaf tensors): those are copied detached. The
    parameters and buffers are copied as ``deepcopy`` does."""
    memo: dict[int, Any] = {}

    def seed(v: Any, depth: int = 0) -> None:
        if isinstance(v, Tensor):
            if not v.is_leaf and id(v) not in memo:
                memo[id(v)] = v.detach().clone()
        elif depth < 2 and isinstance(v, (list, tuple)):
            for x in v:
                seed(x, depth + 1)
        elif depth < 2 and isinstance(v, dict):
            for x in v.values():
                seed(x, depth + 1)

    for m in module.modules():
        for k, v in vars(m).items():
            if k not in ("_parameters", "_buffers", "_modules"):
                seed(v)
    return copy.deepcopy(module, memo)
