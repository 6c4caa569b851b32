"""Deep copies of a user's model or block that never fail on transient autograd state."""

import copy
from typing import Any

from torch import Tensor
from torch.nn import Parameter


def deepcopy_module(module: Any, share_parameters: bool = False) -> Any:
    """``copy.deepcopy`` that survives transient non-leaf tensors some bridge components keep from the last
    forward run with autograd on (``deepcopy`` refuses non-leaf tensors): those are copied detached. The
    parameters and buffers are copied as ``deepcopy`` does; ``share_parameters``: each parameter is a new
    ``Parameter`` on the same storage (no second copy of the weights: ``.to()``, ``.half()`` or ``requires_grad_``
    on the copy leave ``module`` as it is, an in-place write into a weight of the copy writes into ``module``'s)."""
    memo: dict[int, Any] = {}
    if share_parameters:  # tied weights stay tied: one Parameter object, one entry
        memo.update({id(p): Parameter(p.detach(), requires_grad=p.requires_grad) for p in module.parameters()})

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
