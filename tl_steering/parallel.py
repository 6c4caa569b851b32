"""The parallel executor: run chosen sequential blocks as parallel attention/MLP blocks, for real.

:func:`parallelize` returns a NEW model (a deep copy; the original is left bit-identical and hook-free) in
which exactly the chosen blocks compute the parallel surrogate of MATH_SPEC §7,

    P(x) = x + A(x) + Phi(x),    A(x) = attn(LN1(x)),  Phi(x) = MLP(LN2(x)),

while every other block is unchanged. Supported: GPT-2-style blocks (LayerNorm, learned positions) and
Llama-style blocks (RMSNorm, rotary, gated MLP, grouped-query attention), on ``TransformerBridge`` (TL 3.9
and 4.x) and ``HookedTransformer`` (TL 3.9), CPU and CUDA.

Fused block (``fuse=True``, the default). A parallel block reads ONE normalized input x_hat (the norm
WITHOUT its affine part: ``(x - mean) / std`` for LayerNorm, ``x / rms`` for RMSNorm). LN1's gain/bias are
folded into W_Q, W_K, W_V (and their biases); LN2's into W_in (and W_gate). Then

* one GEMM: ``x_hat @ [W_Q | W_K | W_V | W_gate | W_in] + b`` gives q, k, v and the MLP pre-activations;
* the attention core (rotary, causal scaled-dot-product attention, GQA) runs on q, k, v; the MLP
  activation on its slice;
* one GEMM: ``x + [z_attn, h_mlp] @ [W_O ; W_out] + (b_O + b_out)`` (the residual add rides in the GEMM).

The folded weights are a snapshot taken by :func:`parallelize` (non-persistent buffers of the copy); the
original sublayers stay in the copy, so ``adapt(par).ffn(l)`` / ``.attention(l)`` keep working.

Hooks. Block-boundary hooks (``blocks.l.hook_resid_pre`` and ``blocks.l.hook_resid_post``) always fire.
A fused block does not materialize the hooks INSIDE it (``ln1.*``, ``attn.*`` incl. ``hook_pattern``,
``hook_q/k/v/z``, ``hook_attn_out``, ``ln2.*``, ``mlp.*`` incl. ``hook_pre/hook_post``, ``hook_mlp_out``,
``hook_mlp_in``), so while none of them has a hook attached, the fused fast path runs. When any hook is
attached inside a parallelized block (e.g. a full ``run_with_cache``), that block runs the exact unfused
parallel path instead (``attn(ln1(x)) + mlp(ln2(x))`` through the original sublayers), so every inner hook
fires with parallel semantics; only the speed changes. ``hook_resid_mid`` does not exist in a parallel
block (HookedTransformer: removed from ``hook_dict``; bridge: the name stays in ``hook_dict`` as an alias of
``ln2.hook_in``, which sees ``resid_pre`` on the unfused path and never fires on the fused one; the adapter
reports these blocks as parallel and never uses it).

Attention masks. No padding is the supported fast case. On HookedTransformer a mask with zeros (left
padding) sends the block to the unfused path (HookedTransformer's own masking, correct). On the bridge the
4-D mask Hugging Face builds is passed to the attention kernel as is.

KV cache. HookedTransformer: ``model(tokens, past_kv_cache=cache)`` works for fused blocks (keys cached
before rotary, as HookedTransformer does), so ``generate(use_past_kv_cache=True)`` works. Bridge: not
supported; the bridge's own attention ignores the Hugging Face cache its parent model passes down (an
unparallelized bridge's cached decode disagrees with its full forward too), and so do the fused blocks.

CUDA streams (``streams=True``): the attention core runs on a side stream while the MLP branch runs on the
current stream (unfused: the whole MLP branch); ignored on CPU.
"""

import contextlib
import copy
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .backends import adapt
from .errors import InputError, ModelNotSupportedError, ParallelBlockError

try:  # TL 3.x only
    from transformer_lens.components import TransformerBlock as _HookedBlock  # type: ignore[attr-defined]
except ImportError:  # TL 4.x: no HookedTransformer
    _HookedBlock = None

try:
    from transformer_lens.model_bridge.generalized_components.block import ParallelBlockBridge as _PBB
except ImportError:  # pragma: no cover
    _PBB = None

from transformer_lens.hook_points import HookPoint

# ----------------------------------------------------------------------------------------------------------
# the fused computation


def _raw(m: Any) -> Any:
    """Unwrap bridge components down to the Hugging Face module they wrap."""
    seen = 0
    while isinstance(m, torch.nn.Module) and "_original_component" in m._modules and seen < 8:
        m = m._modules["_original_component"]
        seen += 1
    return m


class FusedWeights(torch.nn.Module):
    """Folded weights of one parallel block (non-persistent buffers) and the fused math on them.

    ``w_in``: ``[d_model, n_q + 2 n_kv + (d_mlp if gated) + d_mlp]`` (columns q | k | v | gate | up),
    ``w_out``: ``[n_heads d_head + d_mlp, d_model]`` (rows W_O ; W_out).
    """

    def __init__(self, *, norm: str, eps: float, w_in: Tensor, b_in: Tensor | None, w_out: Tensor,
                 b_out: Tensor | None, n_heads: int, n_kv_heads: int, d_head: int, d_mlp: int, gated: bool,
                 act: Callable[[Tensor], Tensor], scale: float, b_post: Tensor | None = None):
        super().__init__()
        self.norm, self.eps = norm, float(eps)
        self.n_heads, self.n_kv_heads, self.d_head, self.d_mlp = n_heads, n_kv_heads, d_head, d_mlp
        self.gated, self.act, self.scale = gated, act, float(scale)
        self.register_buffer("w_in", w_in.contiguous(), persistent=False)
        self.register_buffer("b_in", None if b_in is None else b_in.contiguous(), persistent=False)
        self.register_buffer("w_out", w_out.contiguous(), persistent=False)
        self.register_buffer("b_out", None if b_out is None else b_out.contiguous(), persistent=False)
        # HookedTransformer's GatedMLP adds b_in AFTER act(gate) * up
        self.register_buffer("b_post", None if b_post is None else b_post.contiguous(), persistent=False)
        nq, nkv = n_heads * d_head, n_kv_heads * d_head
        self.splits = [nq, nkv, nkv] + ([d_mlp] if gated else []) + [d_mlp]
        self.n_attn_cols = nq + 2 * nkv
        self._lean: dict[str, Any] | None = None  # contiguous per-branch weights (benchmark control only)

    # -- lean SEQUENTIAL control (the same kernels, sequential order): benchmarks only -------------------------
    def set_branch_biases(self, b_o: Tensor | None, b_down: Tensor | None) -> None:
        self._branch_biases = (b_o, b_down)

    def _lean_weights(self) -> dict[str, Any]:
        if self._lean is None or self._lean["w_a"].device != self.w_in.device:
            n, nq = self.n_attn_cols, self.n_heads * self.d_head
            b_o, b_down = getattr(self, "_branch_biases", (None, None))
            cv = lambda t: None if t is None else t.to(self.w_in.device, self.w_in.dtype)  # noqa: E731
            self._lean = dict(
                w_a=self.w_in[:, :n].contiguous(), b_a=None if self.b_in is None else self.b_in[:n].contiguous(),
                w_m=self.w_in[:, n:].contiguous(), b_m=None if self.b_in is None else self.b_in[n:].contiguous(),
                w_o=self.w_out[:nq].contiguous(), w_d=self.w_out[nq:].contiguous(), b_o=cv(b_o), b_d=cv(b_down))
        return self._lean

    def lean_sequential(self, x: Tensor, core: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        """x + A(x) then + Phi(x + A(x)) with the folded weights (norm affines folded per branch)."""
        w = self._lean_weights()
        b, s, d = x.shape
        lin = lambda t, wt, bias: torch.addmm(bias, t, wt) if bias is not None else t @ wt  # noqa: E731
        ya = lin(self.normalize(x).reshape(b * s, d), w["w_a"], w["b_a"])
        nq, nkv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        q, k, v = ya.split([nq, nkv, nkv], dim=-1)
        z = core(q.view(b, s, self.n_heads, self.d_head), k.view(b, s, self.n_kv_heads, self.d_head),
                 v.view(b, s, self.n_kv_heads, self.d_head))
        x1 = torch.addmm(x.reshape(b * s, d), z.reshape(b * s, -1), w["w_o"])
        if w["b_o"] is not None:
            x1 = x1 + w["b_o"]
        ym = lin(self.normalize(x1.view(b, s, d)).reshape(b * s, d), w["w_m"], w["b_m"])
        parts = ym.split([self.d_mlp] * (2 if self.gated else 1), dim=-1)
        h = self.mlp_hidden(parts[0] if self.gated else None, parts[-1])
        out = torch.addmm(x1, h, w["w_d"])
        if w["b_d"] is not None:
            out = out + w["b_d"]
        return out.view(b, s, d)

    def normalize(self, x: Tensor) -> Tensor:
        if self.norm == "ln":
            return F.layer_norm(x, x.shape[-1:], None, None, self.eps)
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
        """x [b, s, d] -> q [b,s,h,dh], k, v [b,s,kv,dh], gate [b,s,m] or None, up [b,s,m] (one GEMM)."""
        b, s, d = x.shape
        xh = self.normalize(x).reshape(b * s, d)
        y = torch.addmm(self.b_in, xh, self.w_in) if self.b_in is not None else xh @ self.w_in
        parts = y.split(self.splits, dim=-1)
        q = parts[0].view(b, s, self.n_heads, self.d_head)
        k = parts[1].view(b, s, self.n_kv_heads, self.d_head)
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
            causal = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, **kwargs)
        return z.transpose(1, 2).reshape(q.shape[0], sq, -1)

    def output(self, x: Tensor, z: Tensor, h: Tensor) -> Tensor:
        """x + [z, h] @ [W_O; W_out] + b (one GEMM, residual add included)."""
        b, s, d = x.shape
        zh = torch.cat([z, h], dim=-1).reshape(b * s, -1)
        out = torch.addmm(x.reshape(b * s, d), zh, self.w_out)
        if self.b_out is not None:
            out = out + self.b_out
        return out.view(b, s, d)


def _fold(g: Tensor | None, bias: Tensor | None, w: Tensor, b: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """(x_hat * g + bias) @ w + b  ==  x_hat @ w' + b'  (float64)."""
    w = w.double()
    w2 = w if g is None else g.double()[:, None] * w
    b2 = None if b is None else b.double()
    if bias is not None:
        b2 = bias.double() @ w if b2 is None else b2 + bias.double() @ w
    return w2, b2


def _cat_bias(biases: list[Tensor | None], widths: list[int], like: Tensor) -> Tensor | None:
    if all(b is None for b in biases):
        return None
    return torch.cat([torch.zeros(n, dtype=torch.float64, device=like.device) if b is None else b.double()
                      for b, n in zip(biases, widths)])


def _build(norm: str, eps: float, ln1: tuple, ln2: tuple, wq, bq, wk, bk, wv, bv, wo, bo, w_gate, b_gate, w_up,
           b_up, w_down, b_down, n_heads, n_kv, d_head, act, scale, dtype, b_post=None) -> FusedWeights:
    """Fold norms (g, bias) into the input projections; all w as [in, out]."""
    cols, biases = [], []
    for (g, bias), w, b in [(ln1, wq, bq), (ln1, wk, bk), (ln1, wv, bv)] + \
            ([(ln2, w_gate, b_gate)] if w_gate is not None else []) + [(ln2, w_up, b_up)]:
        w2, b2 = _fold(g, bias, w, b)
        cols.append(w2)
        biases.append(b2)
    w_in = torch.cat(cols, dim=1)
    b_in = _cat_bias(biases, [c.shape[1] for c in cols], w_in)
    w_out = torch.cat([wo.double(), w_down.double()], dim=0)
    b_out = None
    if bo is not None or b_down is not None:
        b_out = (0 if bo is None else bo.double()) + (0 if b_down is None else b_down.double())
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    fw = FusedWeights(norm=norm, eps=eps, w_in=cast(w_in), b_in=cast(b_in), w_out=cast(w_out),
                        b_out=cast(b_out), n_heads=n_heads, n_kv_heads=n_kv, d_head=d_head,
                        d_mlp=w_down.shape[0], gated=w_gate is not None, act=act, scale=scale,
                        b_post=cast(b_post))
    fw.set_branch_biases(cast(None if bo is None else bo.detach()), cast(None if b_down is None else b_down.detach()))
    return fw


# ----------------------------------------------------------------------------------------------------------
# CUDA streams


class _Streams:
    """A side CUDA stream per device; branches run concurrently, joined before the output GEMM."""

    def __init__(self) -> None:
        self._side: dict[Any, Any] = {}

    def side(self, device: torch.device) -> Any:
        key = device.index
        if key not in self._side:
            self._side[key] = torch.cuda.Stream(device=device)
        return self._side[key]

    def __deepcopy__(self, memo: dict) -> "_Streams":
        return _Streams()


def _on_side(enabled: bool, x: Tensor, streams: _Streams) -> Any:
    """Context running the enclosed work on a side stream (CUDA + enabled) that first waits for the current
    one; returns (context, join) where join() makes the current stream wait for the side stream."""
    if not (enabled and x.is_cuda and torch.cuda.is_available()):
        return contextlib.nullcontext(), (lambda *ts: None)
    cur = torch.cuda.current_stream(x.device)
    side = streams.side(x.device)
    side.wait_stream(cur)

    def join(*tensors: Tensor) -> None:
        cur.wait_stream(side)
        for t in tensors:
            if isinstance(t, Tensor) and t.is_cuda:
                t.record_stream(cur)

    return torch.cuda.stream(side), join


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
        return new


def _fused_step(st: Any, x: Tensor, core: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
    """One fused parallel block on residual ``x``: the shared projection, attention ``core(q, k, v)`` (on a side
    CUDA stream when ``st.use_streams``) beside the MLP hidden layer, one joint output GEMM. With
    ``st.lean_sequential`` the same kernels run as a sequential block (the benchmark's control)."""
    fw = st.fused
    if st.lean_sequential:
        return fw.lean_sequential(x, core)
    q, k, v, gate, up = fw.project(x)
    ctx, join = _on_side(st.use_streams, x, st._streams)
    with ctx:
        z = core(q, k, v)
    h = fw.mlp_hidden(gate, up)
    join(z)
    return fw.output(x, z, h)


def _inner_hook_points(block: torch.nn.Module, boundary: Sequence[HookPoint]) -> list[HookPoint]:
    ids = {id(h) for h in boundary}
    out, seen = [], set()
    for m in block.modules():
        if isinstance(m, HookPoint) and id(m) not in ids and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


# ----------------------------------------------------------------------------------------------------------
# HookedTransformer (TL 3.9)


class _ParallelCfg:
    """A view of the model's config with ``parallel_attn_mlp=True`` (live: flags toggled on the model, such
    as ``use_hook_mlp_in``, are seen)."""

    def __init__(self, base: Any):
        object.__setattr__(self, "_base", base)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_base":
            raise AttributeError(name)
        if name == "parallel_attn_mlp":
            return True
        return getattr(object.__getattribute__(self, "_base"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._base, name, value)


if _HookedBlock is not None:

    class HookedParallelBlock(_HookedBlock):  # type: ignore[misc, valid-type]
        """A HookedTransformer block computing x + A(x) + Phi(x) (fused when possible; see module doc)."""

        _tl_parallel: _ParallelState

        def _can_fuse(self, shortformer_pos_embed: Any, attention_mask: Tensor | None) -> bool:
            st = self._tl_parallel
            cfg = self.cfg
            if st.fused is None or st.force_unfused or shortformer_pos_embed is not None:
                return False
            if cfg.use_attn_in or cfg.use_split_qkv_input or cfg.use_hook_mlp_in:
                return False
            if st.inner_hooked():
                return False
            if attention_mask is not None and not bool(attention_mask.all()):
                return False  # padding: HookedTransformer's own masked path
            return True

        def forward(self, resid_pre: Tensor, shortformer_pos_embed: Tensor | None = None,
                    past_kv_cache_entry: Any = None, attention_mask: Tensor | None = None) -> Tensor:
            st = self._tl_parallel
            if not self._can_fuse(shortformer_pos_embed, attention_mask):
                # HookedTransformer's own parallel code path (no side stream there)
                return super().forward(resid_pre, shortformer_pos_embed=shortformer_pos_embed,
                                       past_kv_cache_entry=past_kv_cache_entry, attention_mask=attention_mask)
            x = self.hook_resid_pre(resid_pre)
            fw = st.fused

            def core(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                offset = 0
                if past_kv_cache_entry is not None:
                    offset = past_kv_cache_entry.past_keys.size(1)
                    k, v = past_kv_cache_entry.append(k, v)
                if self.cfg.positional_embedding_type == "rotary":
                    q = self.attn.apply_rotary(q, offset, None)
                    k = self.attn.apply_rotary(k, 0, None)
                return fw.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None)

            return self.hook_resid_post(_fused_step(st, x, core))

else:  # pragma: no cover - TL 4.x
    HookedParallelBlock = None  # type: ignore[assignment, misc]


_HT_UNSUPPORTED = (
    ("attn_scores_soft_cap", lambda v: v is not None and v > 0),
    ("use_qk_norm", bool),
    ("use_local_attn", bool),
    ("use_normalization_before_and_after", bool),
    ("num_experts", lambda v: v is not None),
)


def _hooked_fused(model: Any, layer: int) -> tuple[FusedWeights | None, str]:
    cfg = model.cfg
    blk = model.blocks[layer]
    for name, bad in _HT_UNSUPPORTED:
        if bad(getattr(cfg, name, None)):
            return None, f"cfg.{name}={getattr(cfg, name)!r}"
    if cfg.positional_embedding_type not in ("standard", "rotary"):
        return None, f"positional_embedding_type={cfg.positional_embedding_type!r}"
    if getattr(cfg, "attention_dir", "causal") != "causal":
        return None, "non-causal attention"
    kinds = {type(blk.ln1).__name__, type(blk.ln2).__name__}
    if kinds <= {"LayerNorm", "LayerNormPre"}:
        norm = "ln"
    elif kinds <= {"RMSNorm", "RMSNormPre"}:
        norm = "rms"
    else:
        return None, f"norms {sorted(kinds)}"
    if abs(float(blk.ln1.eps) - float(blk.ln2.eps)) > 0:
        return None, f"ln1.eps={blk.ln1.eps} != ln2.eps={blk.ln2.eps}"
    mlp, attn = blk.mlp, blk.attn
    if type(mlp).__name__ not in ("MLP", "GatedMLP") or cfg.is_layer_norm_activation():
        return None, f"MLP {type(mlp).__name__} / act_fn {cfg.act_fn}"

    def norm_params(ln: Any) -> tuple:
        return getattr(ln, "w", None), getattr(ln, "b", None)

    d, dh, nh = cfg.d_model, cfg.d_head, cfg.n_heads
    gqa = hasattr(attn, "_W_K")
    WK, bK = (attn._W_K, attn._b_K) if gqa else (attn.W_K, attn.b_K)
    WV, bV = (attn._W_V, attn._b_V) if gqa else (attn.W_V, attn.b_V)
    nkv = WK.shape[0]
    flat = lambda w: w.detach().permute(1, 0, 2).reshape(d, -1)  # [h, d, dh] -> [d, h*dh]  # noqa: E731
    gated = type(mlp).__name__ == "GatedMLP"
    fw = _build(
        norm, float(blk.ln1.eps), norm_params(blk.ln1), norm_params(blk.ln2),
        flat(attn.W_Q), attn.b_Q.detach().reshape(-1), flat(WK), bK.detach().reshape(-1), flat(WV),
        bV.detach().reshape(-1), attn.W_O.detach().reshape(nh * dh, d), attn.b_O.detach(),
        mlp.W_gate.detach() if gated else None, None, mlp.W_in.detach(), None if gated else mlp.b_in.detach(),
        mlp.W_out.detach(), mlp.b_out.detach(), nh, nkv, dh, mlp.act_fn, 1.0 / float(attn.attn_scale),
        attn.W_Q.dtype, b_post=mlp.b_in.detach() if gated else None,
    )
    return fw, ""


def _parallelize_hooked(model: Any, layers: list[int], fuse: bool, streams: bool) -> list[str]:
    notes = []
    for layer in layers:
        blk = model.blocks[layer]
        fw, why = _hooked_fused(model, layer) if fuse else (None, "")
        if fuse and fw is None:
            notes.append(f"block {layer}: not fused ({why}); runs the unfused parallel path")
        blk.__class__ = HookedParallelBlock
        blk.cfg = _ParallelCfg(model.cfg)
        if "hook_resid_mid" in blk._modules:
            del blk._modules["hook_resid_mid"]
        inner = _inner_hook_points(blk, [blk.hook_resid_pre, blk.hook_resid_post])
        blk._tl_parallel = _ParallelState(fw, inner, streams)
    model.setup()  # rebuild hook_dict / mod_dict (hook_resid_mid gone from these blocks)
    return notes


# ----------------------------------------------------------------------------------------------------------
# TransformerBridge (TL 3.9 and 4.x): replace the forward of the Hugging Face decoder layer inside the block


def _hf_family(layer: Any) -> str | None:
    names = set(layer._modules)
    if {"ln_1", "attn", "ln_2", "mlp"} <= names:
        return "gpt2"
    if {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"} <= names:
        return "llama"
    return None


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _bridge_fused(layer: Any, family: str) -> tuple[FusedWeights | None, str, int]:
    if family == "gpt2":
        ln1, ln2, attn, mlp = _raw(layer.ln_1), _raw(layer.ln_2), _raw(layer.attn), _raw(layer.mlp)
        if not isinstance(ln1, torch.nn.LayerNorm) or not isinstance(ln2, torch.nn.LayerNorm):
            return None, "norms are not LayerNorm", -1
        if ln1.eps != ln2.eps:
            return None, f"ln_1.eps={ln1.eps} != ln_2.eps={ln2.eps}", -1
        if getattr(attn, "is_cross_attention", False) or "crossattention" in layer._modules:
            return None, "cross-attention", -1
        c_attn, c_proj = _raw(attn.c_attn), _raw(attn.c_proj)
        c_fc, c_proj2 = _raw(mlp.c_fc), _raw(mlp.c_proj)
        d = c_attn.weight.shape[0]
        wq, wk, wv = c_attn.weight.detach().split(d, dim=1)
        bq, bk, bv = c_attn.bias.detach().split(d, dim=0)
        nh, dh = attn.num_heads, attn.head_dim
        scale = float(getattr(attn, "scaling", dh ** -0.5 if getattr(attn, "scale_attn_weights", True) else 1.0))
        fw = _build("ln", ln1.eps, (ln1.weight.detach(), ln1.bias.detach()), (ln2.weight.detach(), ln2.bias.detach()),
                    wq, bq, wk, bk, wv, bv, c_proj.weight.detach(), c_proj.bias.detach(), None, None,
                    c_fc.weight.detach(), c_fc.bias.detach(), c_proj2.weight.detach(), c_proj2.bias.detach(),
                    nh, nh, dh, mlp.act, scale, c_attn.weight.dtype)
        return fw, "", int(attn.layer_idx if attn.layer_idx is not None else -1)
    ln1, ln2 = _raw(layer.input_layernorm), _raw(layer.post_attention_layernorm)
    attn, mlp = _raw(layer.self_attn), _raw(layer.mlp)
    eps1 = getattr(ln1, "variance_epsilon", getattr(ln1, "eps", None))
    eps2 = getattr(ln2, "variance_epsilon", getattr(ln2, "eps", None))
    if "RMSNorm" not in type(ln1).__name__ or "RMSNorm" not in type(ln2).__name__ or eps1 is None:
        return None, f"norms {type(ln1).__name__}/{type(ln2).__name__} are not plain RMSNorm", -1
    if type(ln1).__name__ != "LlamaRMSNorm" and "Gemma" in type(ln1).__name__:
        return None, "Gemma RMSNorm (1 + w) is not handled", -1
    if eps1 != eps2:
        return None, f"input_layernorm eps={eps1} != post_attention_layernorm eps={eps2}", -1
    if any(n in attn._modules for n in ("q_norm", "k_norm")):
        return None, "QK-norm", -1
    if getattr(attn, "sliding_window", None):
        return None, "sliding-window attention", -1
    if not all(n in mlp._modules for n in ("gate_proj", "up_proj", "down_proj")):
        return None, f"MLP {type(mlp).__name__} is not gate/up/down", -1
    lin = lambda m: (_raw(m).weight.detach().T, None if _raw(m).bias is None else _raw(m).bias.detach())  # noqa: E731
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = (lin(attn.q_proj), lin(attn.k_proj), lin(attn.v_proj),
                                              lin(attn.o_proj))
    (wg, bg), (wu, bu), (wd, bd) = lin(mlp.gate_proj), lin(mlp.up_proj), lin(mlp.down_proj)
    dh = int(attn.head_dim)
    nh, nkv = wq.shape[1] // dh, wk.shape[1] // dh
    fw = _build("rms", float(eps1), (ln1.weight.detach(), None), (ln2.weight.detach(), None), wq, bq, wk, bk, wv,
                bv, wo, bo, wg, bg, wu, bu, wd, bd, nh, nkv, dh, mlp.act_fn, float(attn.scaling),
                _raw(attn.q_proj).weight.dtype)
    return fw, "", int(attn.layer_idx)


def _hf_parallel_forward(self: Any, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Forward of a parallelized Hugging Face decoder layer (bound to the layer instance)."""
    st: _ParallelState = self._tl_parallel
    family: str = self._tl_parallel_family
    if family == "gpt2":  # GPT2Block(hidden_states, cache, attention_mask, encoder_hidden_states, ...)
        names = ("cache", "attention_mask", "encoder_hidden_states", "encoder_attention_mask", "use_cache")
        for n, a in zip(names, args):
            kwargs[n] = a
        if kwargs.get("encoder_hidden_states") is not None:
            raise ModelNotSupportedError("parallelized GPT-2 blocks do not support cross-attention")
        kwargs.pop("encoder_hidden_states", None)
        kwargs.pop("encoder_attention_mask", None)
    elif args:  # LlamaDecoderLayer(hidden_states, attention_mask, position_ids, cache, use_cache, pos_emb)
        for n, a in zip(("attention_mask", "position_ids", "cache", "use_cache", "position_embeddings"), args):
            kwargs[n] = a
    if "past_key_values" in kwargs and kwargs.get("cache") is None:
        kwargs["cache"] = kwargs.pop("past_key_values")
    kwargs.pop("past_key_values", None)
    x = hidden_states
    fused = st.fused is not None and not st.force_unfused and not st.inner_hooked()
    if fused:
        return _hf_fused(self, st, family, x, kwargs)
    # unfused parallel: attn(ln1(x)) + mlp(ln2(x)) through the (bridge) sublayers, every inner hook fires
    if family == "gpt2":
        ln1, attn, ln2, mlp = self.ln_1, self.attn, self.ln_2, self.mlp
        attn_kwargs = {k: kwargs[k] for k in kwargs}
        a_call = lambda h: attn(h, **attn_kwargs)  # noqa: E731
    else:
        ln1, attn, ln2, mlp = self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp
        a_call = lambda h: attn(hidden_states=h, **kwargs)  # noqa: E731
    a = a_call(ln1(x))
    a = a[0] if isinstance(a, tuple) else a
    ctx, join = _on_side(st.use_streams, x, st._streams)
    with ctx:
        m = mlp(ln2(x))
        m = m[0] if isinstance(m, tuple) else m
    join(m)
    return x + a + m


def _hf_fused(layer: Any, st: _ParallelState, family: str, x: Tensor, kwargs: dict) -> Tensor:
    fw = st.fused
    assert fw is not None
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 4:
        raise InputError(f"parallelized block got a {mask.dim()}-D attention mask; expected the 4-D mask "
                         "Hugging Face builds (or None)")
    pe = kwargs.get("position_embeddings")
    if family == "llama" and pe is None:
        raise InputError("parallelized Llama-style block needs position_embeddings (cos, sin); the bridge "
                         "passes them in a normal forward")

    def core(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if family == "llama":
            cos, sin = pe[0].unsqueeze(1), pe[1].unsqueeze(1)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        # The bridge's own attention components do not read or write the Hugging Face cache the parent
        # model passes down (checked on TL 3.9 and 4.3: the cache stays empty), so neither do we.
        return fw.attend(q, k, v, mask)

    return _fused_step(st, x, core)


def _parallelize_bridge(model: Any, layers: list[int], fuse: bool, streams: bool) -> list[str]:
    notes = []
    for layer_i in layers:
        blk = model.blocks[layer_i]
        layer = blk._original_component
        family = _hf_family(layer)
        if family is None:
            raise ModelNotSupportedError(
                f"block {layer_i} wraps a {type(layer).__name__}; parallelize supports GPT-2-style (ln_1/attn/ln_2/"
                "mlp) and Llama-style (input_layernorm/self_attn/post_attention_layernorm/mlp) decoder layers"
            )
        fw, why, layer_idx = _bridge_fused(layer, family) if fuse else (None, "", -1)
        if fuse and fw is None:
            notes.append(f"block {layer_i}: not fused ({why}); runs the unfused parallel path")
        inner = _inner_hook_points(blk, [blk.hook_in, blk.hook_out])
        layer._tl_parallel = _ParallelState(fw, inner, streams)
        layer._tl_parallel_family = family
        layer._tl_parallel_layer_idx = layer_idx if layer_idx >= 0 else layer_i
        layer.forward = types.MethodType(_hf_parallel_forward, layer)
        # the adapter (and readers of the block type) see a parallel block: no hook_resid_mid
        if _PBB is not None and type(blk).__name__ == "BlockBridge":
            blk.__class__ = _PBB
            aliases = dict(blk.hook_aliases)
            aliases.pop("hook_resid_mid", None)
            blk.hook_aliases = aliases
    return notes


# ----------------------------------------------------------------------------------------------------------
# public API


def parallelize(model: Any, layers: Sequence[int] | int, fuse: bool = True, streams: bool = False,
                verify: bool = True) -> Any:
    """A new model in which exactly the chosen blocks compute x + A(x) + Phi(x) (parallel attention/MLP).

    Args:
        model: a TransformerLens ``HookedTransformer`` (TL 3.9) or ``TransformerBridge`` (TL 3.9 / 4.x) with
            GPT-2-style or Llama-style blocks. It is deep-copied and never modified.
        layers: block indices to parallelize (an empty list gives an unchanged copy). Blocks that are
            parallel already (NeoX/Pythia/GPT-J) are left as they are, with a warning.
        fuse: fold each norm's affine into the input projections and run the block as two GEMMs (one for
            Q/K/V + MLP in/gate, one for [z, h] @ [W_O; W_out]). ``False``: the unfused parallel block
            attn(ln1(x)) + mlp(ln2(x)) through the original sublayers (every inner hook fires).
        streams: on CUDA, run the attention core on a side stream concurrently with the MLP branch.
        verify: run the new model once on 8 random tokens fused and unfused and raise
            :class:`ParallelBlockError` if they disagree (guards against weight layouts this fold does not
            understand). Cheap; turn off only when timing the call itself.

    Returns:
        The parallelized copy (same class as ``model``). Hooks at block boundaries (``hook_resid_pre``,
        ``hook_resid_post``) always fire; see the module docstring for hooks inside a fused block.
    """
    ad = adapt(model)
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (Sequence, torch.Tensor, range)):
        raise InputError(f"layers must be a list of block indices, got {type(layers).__name__}")
    chosen = sorted({ad.check_layer(int(lay)) for lay in layers})
    already = [lay for lay in chosen if ad.is_parallel(lay)]
    if already:
        warnings.warn(f"blocks {already} are parallel attention/MLP blocks already; parallelize leaves them as "
                      "they are", stacklevel=2)
    todo = [lay for lay in chosen if not ad.is_parallel(lay)]
    if ad.backend == "hooked" and HookedParallelBlock is None:  # pragma: no cover
        raise ModelNotSupportedError("HookedTransformer blocks need TransformerLens 3.x")
    new = _deepcopy_model(model)
    if not todo:
        return new
    with torch.no_grad():
        if ad.backend == "hooked":
            notes = _parallelize_hooked(new, todo, fuse, streams)
        else:
            notes = _parallelize_bridge(new, todo, fuse, streams)
    for n in notes:
        warnings.warn(n, stacklevel=2)
    new._tl_steering_parallel = {"layers": todo, "fuse": fuse, "streams": streams, "notes": notes}
    if verify and fuse and len(notes) < len(todo):
        _verify(new)
    return new


def _deepcopy_model(model: Any) -> Any:
    """``copy.deepcopy`` that survives transient non-leaf tensors some bridge components keep from the last
    forward run with autograd on (they are copied detached)."""
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

    for m in model.modules():
        for k, v in vars(m).items():
            if k not in ("_parameters", "_buffers", "_modules"):
                seed(v)
    return copy.deepcopy(model, memo)


def _lean_sequential_copy(model: Any, layers: Sequence[int]) -> Any:
    """Benchmark CONTROL, not a parallel model: a copy whose chosen blocks stay SEQUENTIAL but run on the same
    lean kernels as the fused parallel blocks (folded norms, SDPA, addmm). Comparing it with the original
    isolates the implementation gain; comparing the parallel model with it isolates the parallel structure's."""
    new = parallelize(model, layers, verify=False)
    for st in _states(new):
        st.lean_sequential = True
    return new


def parallel_layers(model: Any) -> list[int]:
    """The blocks :func:`parallelize` turned parallel in ``model`` (empty for any other model)."""
    info = getattr(model, "_tl_steering_parallel", None)
    return list(info["layers"]) if info else []


def _states(model: Any) -> list[_ParallelState]:
    return [m for m in model.modules() if isinstance(m, _ParallelState)]


@contextlib.contextmanager
def unfused(model: Any):
    """Inside the block, every parallelized block of ``model`` runs the unfused parallel path."""
    states = _states(model)
    before = [s.force_unfused for s in states]
    for s in states:
        s.force_unfused = True
    try:
        yield model
    finally:
        for s, b in zip(states, before):
            s.force_unfused = b


def _verify(model: Any, rtol: float | None = None) -> float:
    ad = adapt(model)
    vocab = int(model.cfg.d_vocab)
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(1, vocab, (1, 8), generator=g).to(ad.device)
    with torch.no_grad():
        fused = model(tokens, return_type="logits")
        with unfused(model):
            ref = model(tokens, return_type="logits")
    err = float((fused.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))
    tol = rtol if rtol is not None else {torch.float64: 1e-9, torch.float32: 1e-4}.get(ad.dtype, 3e-2)
    if not err <= tol:
        raise ParallelBlockError(
            f"the fused parallel blocks disagree with the unfused parallel reference (relative error {err:.3g} > "
            f"{tol:g}); this model's weight layout is not what the fold expects. Use parallelize(..., fuse=False)."
        )
    return err


__all__ = ["FusedWeights", "HookedParallelBlock", "parallel_layers", "parallelize", "unfused"]
