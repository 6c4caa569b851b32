"""The per-block state of the parallel executor (fused weights, inner hook points, corrections) and the helpers
both block kinds share (:mod:`.executor` for HookedTransformer blocks, :mod:`.executor_bridge` for the bridge's
Hugging Face decoder layers; docs/parallel.md)."""

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from .fused import FusedWeights, _Streams, corrected_ffn_write


def _raw(m: Any) -> Any:
    """Unwrap bridge components down to the Hugging Face module they wrap."""
    seen = 0
    while isinstance(m, torch.nn.Module) and "_original_component" in m._modules and seen < 8:
        m = m._modules["_original_component"]
        seen += 1
    return m


# ----------------------------------------------------------------------------------------------------------
# shared state of a parallelized block


class _ParallelState(torch.nn.Module):
    """Per-block executor state: the fused weights (or None), the inner hook points, options."""

    def __init__(self, fused: FusedWeights | None, inner: list[HookPoint], streams: bool):
        super().__init__()
        self.fused = fused
        object.__setattr__(self, "_inner", inner)  # not submodules: they belong to the block already
        self.use_streams = bool(streams)
        self.force_unfused = False
        self.lean_sequential = False  # benchmark control: same kernels, SEQUENTIAL block (not parallel!)
        self._streams = _Streams()
        # fitted correction of the FFN write, g Phi(x) + b (+ a W) (tl_steering.parallel.refit); folded into the
        # fused weights, applied by correct() on the unfused paths
        self.ffn_gate = 1.0
        self.register_buffer("ffn_bias", None, persistent=False)
        self.register_buffer("attn_linear", None, persistent=False)
        self._last_attn: Tensor | None = None  # the attention write of the running forward (hooked unfused path)

    @property
    def corrected(self) -> bool:
        return self.ffn_gate != 1.0 or self.ffn_bias is not None or self.attn_linear is not None

    def correct(self, m: Tensor, a: Tensor | None = None) -> Tensor:
        """The corrected FFN write g m + b (+ a W, ``a`` the block's attention write) (unfused paths; float64
        arithmetic, cast back)."""
        if not self.corrected:
            return m
        if self.attn_linear is not None and a is None:
            raise RuntimeError("parallel block: the attention write was not captured for the linear correction")
        return corrected_ffn_write(m, self.ffn_gate, self.ffn_bias, self.attn_linear, a)

    def set_correction(self, gate: float, bias: Tensor | None, linear: Tensor | None = None) -> None:
        """Set g, b (and W) and fold them into the fused weights (if any): zero run-time cost on the fused path."""
        self.ffn_gate = float(gate)
        self.ffn_bias = None if bias is None else bias.detach().to(torch.float64).clone()
        self.attn_linear = None if linear is None else linear.detach().to(torch.float64).clone()
        if self.fused is not None and self.corrected:
            self.fused.fold_ffn_correction(self.ffn_gate, self.ffn_bias, self.attn_linear)

    def _hooked_attn(self, module: Any, args: Any, out: Tensor) -> None:
        """Torch forward hook on a HookedTransformer block's attention write (unfused path): keep it for
        :meth:`_hooked_correction` of the same forward."""
        self._last_attn = out

    def _hooked_correction(self, module: Any, args: Any, out: Tensor) -> Tensor:
        """Torch forward hook on a HookedTransformer block's FFN module (unfused path: before hook_mlp_out)."""
        a, self._last_attn = self._last_attn, None
        return self.correct(out, a)

    def inner_hooked(self) -> bool:
        return any(hp._forward_hooks or hp._forward_pre_hooks or hp._backward_hooks for hp in self._inner)

    def __deepcopy__(self, memo: dict) -> "_ParallelState":
        new = _ParallelState.__new__(_ParallelState)
        memo[id(self)] = new
        torch.nn.Module.__init__(new)
        new.fused = copy.deepcopy(self.fused, memo)
        object.__setattr__(new, "_inner", [copy.deepcopy(hp, memo) for hp in self._inner])
        new.use_streams, new.force_unfused, new._streams = self.use_streams, self.force_unfused, _Streams()
        new.lean_sequential = self.lean_sequential
        new.ffn_gate = self.ffn_gate
        new.ffn_bias = None if self.ffn_bias is None else self.ffn_bias.clone()
        new.attn_linear = None if self.attn_linear is None else self.attn_linear.clone()
        new._last_attn = None
        return new


def _inner_hook_points(block: torch.nn.Module, boundary: Sequence[HookPoint]) -> list[HookPoint]:
    ids = {id(h) for h in boundary}
    out, seen = [], set()
    for m in block.modules():
        if isinstance(m, HookPoint) and id(m) not in ids and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out
