"""The fused parallel block as tensor math and the executor's per-block state (:class:`_ParallelState`); no
TransformerLens or Hugging Face here. See docs/parallel.md, "Design: the fused block"."""

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from .. import validation


def corrected_ffn_write(m: Float[Tensor, "*rows d_model"], gate: float = 1.0,
                        bias: Float[Tensor, " d_model"] | None = None,
                        linear: Float[Tensor, "d_model d_model2"] | None = None,
                        attn: Float[Tensor, "*rows d_model"] | None = None,
                        dtype: torch.dtype | None = None) -> Float[Tensor, "*rows d_model"]:
    """The corrected FFN write ``g m + b + attn W`` of a parallel block (the terms given; ``m`` = Phi(x), ``attn``
    the block's attention write), in float64, cast to ``dtype`` (default ``m.dtype``); the one copy of it."""
    out = m.to(torch.float64) * gate
    if bias is not None:
        out = out + bias.to(device=out.device, dtype=torch.float64)
    if linear is not None:
        if attn is None:
            raise ValueError("the linear correction a W needs the block's attention write a")
        out = out + attn.to(torch.float64) @ linear.to(device=out.device, dtype=torch.float64)
    return out.to(m.dtype if dtype is None else dtype)


def causal_mask(sq: int, sk: int, device: torch.device, window: int | None = None) -> Tensor:
    """``[sq, sk]`` boolean mask (True = attend) of the last ``sq`` of ``sk`` positions: causal, and within the
    ``window`` latest positions when a sliding window is given."""
    i = torch.arange(sk, device=device)
    diff = i[-sq:, None] - i[None, :]
    return (diff >= 0) if window is None else (diff >= 0) & (diff < window)


class FusedWeights(torch.nn.Module):
    """Folded weights of one parallel block (non-persistent buffers) and the fused math on them (docs/parallel.md):
    ``w_in`` ``[d_model, n_q + 2 n_kv + (d_mlp if gated) + d_mlp]`` (columns q | k | v | gate | up), ``w_out``
    ``[n_heads d_head + d_mlp, d_model]`` (rows W_O ; W_out); sandwich-norm blocks: :meth:`set_sandwich`."""

    def __init__(self, *, norm: str, eps: float, w_in: Tensor, b_in: Tensor | None, w_out: Tensor,
                 b_out: Tensor | None, n_heads: int, n_kv_heads: int, d_head: int, d_mlp: int, gated: bool,
                 act: Callable[[Tensor], Tensor], scale: float, b_post: Tensor | None = None):
        super().__init__()
        self.norm, self.eps = norm, float(eps)
        self.n_heads, self.n_kv_heads, self.d_head, self.d_mlp = n_heads, n_kv_heads, d_head, d_mlp
        self.gated, self.act, self.scale = gated, act, float(scale)
        # b_post: HookedTransformer's GatedMLP adds b_in AFTER act(gate) * up
        for name, t in (("w_in", w_in), ("b_in", b_in), ("w_out", w_out), ("b_out", b_out), ("b_post", b_post)):
            self.register_buffer(name, None if t is None else t.contiguous(), persistent=False)
        nq, nkv = n_heads * d_head, n_kv_heads * d_head
        self.splits = [nq, nkv, nkv] + ([d_mlp] if gated else []) + [d_mlp]
        self.branch_biases: tuple[Tensor | None, Tensor | None] = (None, None)  # b_O, b_out (before folding)
        self.qk_eps = self.post_eps = 0.0
        self.softcap: float | None = None
        self.window: int | None = None
        for name in ("q_norm_g", "k_norm_g", "post_attn_g", "post_ffn_g", "b_ffn", "w_lin"):
            self.register_buffer(name, None, persistent=False)

    def set_sandwich(self, *, q_norm_g: Tensor | None = None, k_norm_g: Tensor | None = None, qk_eps: float = 0.0,
                     post_attn_g: Tensor | None = None, post_ffn_g: Tensor | None = None, post_eps: float = 0.0,
                     softcap: float | None = None, window: int | None = None) -> None:
        """Gains (already ``1 + w`` for Gemma's norms) of the QK-norms and the post-sublayer norms, softcap, window."""
        cv = lambda t: None if t is None else t.detach().to(self.w_in.dtype).contiguous()  # noqa: E731
        self.q_norm_g, self.k_norm_g, self.qk_eps = cv(q_norm_g), cv(k_norm_g), float(qk_eps)
        self.post_attn_g, self.post_ffn_g, self.post_eps = cv(post_attn_g), cv(post_ffn_g), float(post_eps)
        self.softcap = float(softcap) if softcap else None
        self.window = int(window) if window else None

    @staticmethod
    def _rms(x: Tensor, g: Tensor | None, eps: float) -> Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (y if g is None else y * g.to(xf.dtype)).to(x.dtype)

    def qk_norm(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head RMS norm of q [.., h, dh] and k [.., kv, dh] (QK-norm blocks; identity otherwise)."""
        if self.q_norm_g is not None:
            q = self._rms(q, self.q_norm_g, self.qk_eps)
        if self.k_norm_g is not None:
            k = self._rms(k, self.k_norm_g, self.qk_eps)
        return q, k

    @property
    def sandwich(self) -> bool:
        return self.post_attn_g is not None or self.post_ffn_g is not None

    def fold_ffn_correction(self, gate: float, bias: Tensor | None, linear: Tensor | None = None) -> None:
        """Make the FFN branch write g Phi(x) + b (+ a W), folded in float64 and cast back (pre-norm and
        sandwich-norm folds: docs/parallel.md, ``gates`` / ``linears``)."""
        nq = self.n_heads * self.d_head
        dt = self.w_out.dtype
        bias64 = None if bias is None else bias.detach().to(self.w_out.device, torch.float64)
        lin64 = None if linear is None else linear.detach().to(self.w_out.device, torch.float64)
        if self.sandwich:
            if self.post_ffn_g is None:
                raise ValueError("a sandwich-norm block without a post-FFN gain")
            self.post_ffn_g = (self.post_ffn_g.double() * gate).to(dt)
            self.b_ffn = None if bias64 is None else bias64.to(dt)
            self.w_lin = None if lin64 is None else lin64.to(dt)
            return
        w = self.w_out  # only the rows that change go through float64 (w * 1.0 and the cast back are exact)
        if gate != 1.0:
            w[nq:] = (w[nq:].double() * gate).to(dt)
        if lin64 is not None:
            top = w[:nq].double()
            w[:nq] = (top + top @ lin64).to(dt)
        b_o, b_down = self.branch_biases
        b = torch.zeros(w.shape[1], dtype=torch.float64, device=w.device)
        if b_o is not None:
            b_o64 = b_o.double().to(w.device)
            b = b + b_o64 + (b_o64 @ lin64 if lin64 is not None else 0.0)
        if b_down is not None:
            b = b + gate * b_down.double().to(w.device)
        if bias64 is not None:
            b = b + bias64
        self.b_out = b.to(dt)

    def normalize(self, x: Tensor) -> Tensor:
        if self.norm == "ln":
            return F.layer_norm(x, x.shape[-1:], None, None, self.eps)
        return self._rms(x, None, self.eps)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
        """x [b, s, d] -> q [b,s,h,dh], k, v [b,s,kv,dh], gate [b,s,m] or None, up [b,s,m] (one GEMM)."""
        b, s, d = x.shape
        xh = self.normalize(x).reshape(b * s, d)
        y = torch.addmm(self.b_in, xh, self.w_in) if self.b_in is not None else xh @ self.w_in
        parts = y.split(self.splits, dim=-1)
        q, k = self.qk_norm(parts[0].view(b, s, self.n_heads, self.d_head),
                            parts[1].view(b, s, self.n_kv_heads, self.d_head))
        v = parts[2].view(b, s, self.n_kv_heads, self.d_head)
        gate = parts[3].view(b, s, -1) if self.gated else None
        up = parts[-1].view(b, s, -1)
        return q, k, v, gate, up

    def mlp_hidden(self, gate: Tensor | None, up: Tensor) -> Tensor:
        h = self.act(gate) * up if self.gated else self.act(up)
        return h + self.b_post if self.b_post is not None else h

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Causal attention, q [b,h,sq,dh], k/v [b,kv,sk,dh] -> z [b, sq, h*dh]."""
        sq, sk = q.shape[-2], k.shape[-2]
        if mask is None and self.window is not None and sk > self.window:
            mask = causal_mask(sq, sk, q.device, self.window)
        if self.softcap is not None:
            return self._attend_softcap(q, k, v, mask)
        kwargs: dict[str, Any] = {"scale": self.scale}
        if self.n_kv_heads != self.n_heads:
            kwargs["enable_gqa"] = True
        if mask is not None:
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[..., :sk], **kwargs)
        elif sq == 1:
            z = F.scaled_dot_product_attention(q, k, v, **kwargs)
        elif sq == sk:
            z = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
        else:  # queries are the last sq of sk positions
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(sq, sk, q.device), **kwargs)
        return z.transpose(1, 2).reshape(q.shape[0], sq, -1)

    def _attend_softcap(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Attention with logits softcapped as ``c * tanh(scores / c)`` (Gemma 2); explicit softmax."""
        sq, sk = q.shape[-2], k.shape[-2]
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        sc = (q @ k.transpose(-1, -2)) * self.scale
        sc = torch.tanh(sc / self.softcap) * self.softcap
        if mask is None:
            mask = causal_mask(sq, sk, q.device)
        if mask.dtype == torch.bool:
            sc = sc.masked_fill(~mask[..., :sk], torch.finfo(sc.dtype).min)
        else:
            sc = sc + mask[..., :sk]
        z = torch.softmax(sc.float(), dim=-1).to(q.dtype) @ v
        return z.transpose(1, 2).reshape(q.shape[0], sq, -1)

    def output(self, x: Tensor, z: Tensor, h: Tensor) -> Tensor:
        """x + [z, h] @ [W_O; W_out] + b (one GEMM, residual add included). Sandwich-norm blocks:
        x + post_attn(z @ W_O) + post_ffn(h @ W_out) (a GEMM per branch: each output is normalized)."""
        b, s, d = x.shape
        if self.sandwich:
            nq = self.n_heads * self.d_head
            a, m = z.reshape(b * s, -1) @ self.w_out[:nq], h.reshape(b * s, -1) @ self.w_out[nq:]
            if self.post_attn_g is not None:
                a = self._rms(a, self.post_attn_g, self.post_eps)
            if self.post_ffn_g is not None:
                m = self._rms(m, self.post_ffn_g, self.post_eps)
            if self.b_ffn is not None:
                m = m + self.b_ffn
            if self.w_lin is not None:  # the linear correction a W of the FFN write (fold_ffn_correction)
                m = m + a @ self.w_lin
            return (x.reshape(b * s, d) + a + m).view(b, s, d)
        zh = torch.cat([z, h], dim=-1).reshape(b * s, -1)
        out = torch.addmm(x.reshape(b * s, d), zh, self.w_out)
        if self.b_out is not None:
            out = out + self.b_out
        return out.view(b, s, d)


def _fold(g: Tensor | None, bias: Tensor | None, w: Tensor, b: Tensor | None, out: Tensor) -> Tensor | None:
    """(x_hat * g + bias) @ w + b  ==  x_hat @ w' + b': w' = g w written into ``out`` (its dtype), b' returned
    in float64. g w is rounded once into ``out``: from float64, or in ``out``'s dtype when g and w have that
    dtype already (a product of two such numbers is exact in float64, so the rounding is the same)."""
    if g is not None and g.dtype == w.dtype == out.dtype:
        torch.mul(g[:, None], w, out=out)
    else:
        out.copy_(w if g is None else g.double()[:, None] * w.double())
    b2 = None if bias is None else bias.double() @ w.double()
    return b2 if b is None else b.double() + (0 if b2 is None else b2)


def _build(norm: str, eps: float, ln1: tuple, ln2: tuple, wq, bq, wk, bk, wv, bv, wo, bo, w_gate, b_gate, w_up,
           b_up, w_down, b_down, n_heads, n_kv, d_head, act, scale, dtype, b_post=None) -> FusedWeights:
    """Fold norms (g, bias) into the input projections; all w as [in, out]; each weight rounded once to
    ``dtype`` (:func:`_fold`)."""
    specs = [(ln1, wq, bq), (ln1, wk, bk), (ln1, wv, bv)] + \
        ([(ln2, w_gate, b_gate)] if w_gate is not None else []) + [(ln2, w_up, b_up)]
    widths = [w.shape[1] for _, w, _ in specs]
    w_in = torch.empty(wq.shape[0], sum(widths), dtype=dtype, device=wq.device)
    biases = [_fold(g, bias, w, b, out) for ((g, bias), w, b), out in zip(specs, w_in.split(widths, dim=1))]
    b_in = None if all(b is None for b in biases) else torch.cat(
        [torch.zeros(n, dtype=torch.float64, device=w_in.device) if b is None else b for b, n in zip(biases, widths)])
    w_out = torch.cat([wo.detach().to(dtype), w_down.detach().to(dtype)])  # float -> dtype: one rounding
    b_out = None
    if bo is not None or b_down is not None:
        b_out = (0 if bo is None else bo.double()) + (0 if b_down is None else b_down.double())
    cast = lambda t: None if t is None else t.detach().to(dtype)  # noqa: E731
    fw = FusedWeights(norm=norm, eps=eps, w_in=w_in, b_in=cast(b_in), w_out=w_out,
                        b_out=cast(b_out), n_heads=n_heads, n_kv_heads=n_kv, d_head=d_head,
                        d_mlp=w_down.shape[0], gated=w_gate is not None, act=act, scale=scale,
                        b_post=cast(b_post))
    fw.branch_biases = (cast(bo), cast(b_down))
    return fw


class _ParallelState(torch.nn.Module):
    """Per-block state of a parallelized block (:mod:`.executor`): the fused weights (or
    None), the inner hook points, options."""

    def __init__(self, fused: FusedWeights | None, inner: list[Any], streams: bool):
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
        """:func:`corrected_ffn_write` with this block's correction (unfused paths)."""
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
        """Torch forward hook keeping a HookedTransformer block's attention write for :meth:`_hooked_correction`."""
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
        """One fused parallel block on residual ``x`` (docs/parallel.md, "Design: the fused block"), attention
        ``core(q, k, v)`` on a side stream (:meth:`on_side`); 0 positions (``generate("")``) is an InputError."""
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
