"""The per-block state of the parallel executor (fused weights, inner hook points, corrections) and the helpers
both block kinds share (:mod:`.executor` for HookedTransformer blocks, :mod:`.executor_bridge` for the bridge's
Hugging Face decoder layers; docs/parallel.md)."""

import contextlib
import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from .. import validation
from .fused import FusedWeights, corrected_ffn_write
from .hookbase import hook_points


class _ParallelState(torch.nn.Module):
    """Per-block executor state: the fused weights (or None), the inner hook points, options."""

    def __init__(self, fused: FusedWeights | None, inner: list[HookPoint], streams: bool):
        super().__init__()
        self.fused = fused
        object.__setattr__(self, "_inner", inner)  # not submodules: they belong to the block already
        self.use_streams = bool(streams)
        self.force_unfused = False
        self._side: dict[Any, Any] = {}  # a side CUDA stream per device index
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

    def on_side(self, x: Tensor) -> tuple[Any, Callable[..., None]]:
        """``(context, join)``: the enclosed work runs on a side CUDA stream that first waits for the current one
        (``use_streams`` and ``x`` on CUDA; else no-ops); ``join(*tensors)`` makes the current stream wait for it."""
        if not (self.use_streams and x.is_cuda):
            return contextlib.nullcontext(), (lambda *ts: None)
        cur = torch.cuda.current_stream(x.device)
        if x.device.index not in self._side:
            self._side[x.device.index] = torch.cuda.Stream(device=x.device)
        side = self._side[x.device.index]
        side.wait_stream(cur)

        def join(*tensors: Tensor) -> None:
            cur.wait_stream(side)
            for t in tensors:
                if isinstance(t, Tensor) and t.is_cuda:
                    t.record_stream(cur)

        return torch.cuda.stream(side), join

    def step(self, x: Tensor, core: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        """One fused parallel block on residual ``x``: the shared projection, attention ``core(q, k, v)`` (on a side
        stream, :meth:`on_side`) beside the MLP hidden layer, one joint output GEMM. An input of 0 positions
        (TransformerLens's ``generate("")`` on a parallelized copy) is an InputError, not a reshape error."""
        if x.shape[-2] == 0:
            validation.check_length(0, None, "the input of a parallelized block")
        fw = self.fused
        q, k, v, gate, up = fw.project(x)
        ctx, join = self.on_side(x)
        with ctx:
            z = core(q, k, v)
        h = fw.mlp_hidden(gate, up)
        join(z)
        return fw.output(x, z, h)

    def __deepcopy__(self, memo: dict) -> "_ParallelState":
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        torch.nn.Module.__init__(new)
        new.fused = copy.deepcopy(self.fused, memo)
        object.__setattr__(new, "_inner", [copy.deepcopy(hp, memo) for hp in self._inner])
        new.use_streams, new.force_unfused, new._side = self.use_streams, self.force_unfused, {}
        new.ffn_gate = self.ffn_gate
        new.ffn_bias = None if self.ffn_bias is None else self.ffn_bias.clone()
        new.attn_linear = None if self.attn_linear is None else self.attn_linear.clone()
        new._last_attn = None
        return new


def _inner_hook_points(block: torch.nn.Module, boundary: Sequence[HookPoint]) -> list[HookPoint]:
    ids = {id(h) for h in boundary}
    return [hp for hp in hook_points(block) if id(hp) not in ids]
