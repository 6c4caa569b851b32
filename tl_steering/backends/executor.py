"""Block surgery for :func:`tl_steering.parallel.apply.parallelize`: the ``HookedParallelBlock`` subclass (TL 3.9) and
the replacement forward of a bridge's GPT-2-, Llama- or Gemma-style decoder layer; the math is :mod:`.fused`
(docs/parallel.md, docs/gemma.md)."""

import inspect
import types
from typing import Any

import torch
from torch import Tensor
from transformer_lens.model_bridge.generalized_components.block import ParallelBlockBridge as _PBB

from ..errors import InputError, ModelNotSupportedError
from .detect import first_output
from .fused import FusedWeights, _build, _ParallelState
from .hookbase import hook_points
from .sublayers import unwrap as _raw

try:  # TL 3.x only
    from transformer_lens.components import TransformerBlock as _HookedBlock  # type: ignore[attr-defined]
except ImportError:  # TL 4.x: no HookedTransformer
    _HookedBlock = None


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
            st, cfg = self._tl_parallel, self.cfg
            return not (st.fused is None or st.force_unfused or shortformer_pos_embed is not None
                        or cfg.use_attn_in or cfg.use_split_qkv_input or cfg.use_hook_mlp_in or st.inner_hooked()
                        # padding: HookedTransformer's own masked path
                        or (attention_mask is not None and not bool(attention_mask.all())))

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

            return self.hook_resid_post(st.step(x, core))

else:  # pragma: no cover - TL 4.x
    HookedParallelBlock = None  # type: ignore[assignment, misc]


_HT_UNSUPPORTED = (
    ("attn_scores_soft_cap", lambda v: v is not None and v > 0),
    ("use_qk_norm", bool),
    ("use_local_attn", bool),
    ("use_normalization_before_and_after", bool),
    ("num_experts", lambda v: v is not None))


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
    if float(blk.ln1.eps) != float(blk.ln2.eps):
        return None, f"ln1.eps={blk.ln1.eps} != ln2.eps={blk.ln2.eps}"
    mlp, attn = blk.mlp, blk.attn
    if type(mlp).__name__ not in ("MLP", "GatedMLP") or cfg.is_layer_norm_activation():
        return None, f"MLP {type(mlp).__name__} / act_fn {cfg.act_fn}"

    d, dh, nh = cfg.d_model, cfg.d_head, cfg.n_heads
    gqa = hasattr(attn, "_W_K")
    WK, bK = (attn._W_K, attn._b_K) if gqa else (attn.W_K, attn.b_K)
    WV, bV = (attn._W_V, attn._b_V) if gqa else (attn.W_V, attn.b_V)
    nkv = WK.shape[0]
    flat = lambda w: w.detach().permute(1, 0, 2).reshape(d, -1)  # [h, d, dh] -> [d, h*dh]  # noqa: E731
    gated = type(mlp).__name__ == "GatedMLP"
    fw = _build(
        norm, float(blk.ln1.eps), (getattr(blk.ln1, "w", None), getattr(blk.ln1, "b", None)),
        (getattr(blk.ln2, "w", None), getattr(blk.ln2, "b", None)),
        flat(attn.W_Q), attn.b_Q.detach().reshape(-1), flat(WK), bK.detach().reshape(-1), flat(WV),
        bV.detach().reshape(-1), attn.W_O.detach().reshape(nh * dh, d), attn.b_O.detach(),
        mlp.W_gate.detach() if gated else None, None, mlp.W_in.detach(), None if gated else mlp.b_in.detach(),
        mlp.W_out.detach(), mlp.b_out.detach(), nh, nkv, dh, mlp.act_fn, 1.0 / float(attn.attn_scale),
        attn.W_Q.dtype, b_post=mlp.b_in.detach() if gated else None)
    return fw, ""


def _parallelize_hooked(model: Any, layers: list[int], fuse: bool, streams: bool,
                        corrections: dict[int, tuple[float, Tensor | None, Tensor | None]]) -> list[str]:
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
        if layer in corrections:
            blk._tl_parallel.set_correction(*corrections[layer])
            # the unfused path (HookedTransformer's own parallel code): correct the FFN module's output before
            # hook_mlp_out sees it (ln2_post on sandwich-norm blocks); a bound method, so a deepcopy follows
            sandwich = getattr(model.cfg, "use_normalization_before_and_after", False)
            ffn_mod = blk.ln2_post if sandwich else blk.mlp
            if corrections[layer][2] is not None:  # a W needs the attention write a (after ln1_post)
                (blk.ln1_post if sandwich else blk.attn).register_forward_hook(blk._tl_parallel._hooked_attn)
            ffn_mod.register_forward_hook(blk._tl_parallel._hooked_correction)
    model.setup()  # rebuild hook_dict / mod_dict (hook_resid_mid gone from these blocks)
    return notes


_GEMMA_MODULES = {"input_layernorm", "self_attn", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "mlp"}


def _hf_family(layer: Any) -> str | None:
    names = set(layer._modules)
    if {"ln_1", "attn", "ln_2", "mlp"} <= names:
        return "gpt2"
    if _GEMMA_MODULES <= names:  # sandwich norms (Gemma 2 / 3): a norm before AND after each sublayer
        return "gemma"
    if {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"} <= names:
        return "llama"
    return None


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rms_gain(norm: Any, dim: int) -> tuple[Tensor | None, float | None]:
    """The gain g and eps with ``norm(x) == x / rms(x) * g`` (plain RMSNorm: g = w; Gemma: g = 1 + w), found
    by probing the module numerically (so a norm with another formula is refused, never folded wrongly)."""
    raw = _raw(norm)
    eps = getattr(raw, "variance_epsilon", getattr(raw, "eps", None))
    w = getattr(raw, "weight", None)
    if eps is None or not isinstance(w, Tensor) or w.shape != (dim,) or getattr(raw, "bias", None) is not None:
        return None, None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, dim, generator=g, dtype=torch.float64).to(w.device, w.dtype) * 3.0
    with torch.no_grad():
        got = raw(x).double()
        xd = x.double()
        xhat = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + float(eps))
        for gain in (w.double(), 1.0 + w.double()):
            if torch.allclose(got, xhat * gain, rtol=1e-4, atol=1e-5 * float(got.abs().max())):
                return gain.to(w.dtype), float(eps)
    return None, None


def _hf_linears(attn: Any, mlp: Any) -> list[tuple[Tensor, Tensor | None]] | str:
    """``[(W^T, b or None)]`` of q, k, v, o, gate, up, down of a Llama/Gemma-style decoder layer (weights as
    ``[in, out]``, detached; shared by both fused builders), or why the layer has another layout."""
    if not all(n in mlp._modules for n in ("gate_proj", "up_proj", "down_proj")):
        return f"MLP {type(mlp).__name__} is not gate/up/down"
    mods = [_raw(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                              mlp.down_proj)]
    return [(m.weight.detach().T, None if m.bias is None else m.bias.detach()) for m in mods]


def _gemma_fused(layer: Any) -> tuple[FusedWeights | None, str, int]:
    """Gemma 2/3 decoder layer: fold the pre-norm gains into q|k|v and gate|up; keep QK-norms and the two
    post-norms as gains applied after the GEMMs (see FusedWeights.set_sandwich)."""
    attn, mlp = _raw(layer.self_attn), _raw(layer.mlp)
    w = _hf_linears(attn, mlp)
    if isinstance(w, str):
        return None, w, -1
    (wq, bq), (wk, bk), (wv, bv), (wo, bo), (wg, bg), (wu, bu), (wd, bd) = w
    if bo is not None or bd is not None:
        return None, "output biases under a post-norm", -1
    d, dh = wq.shape[0], int(attn.head_dim)
    gains = {n: _rms_gain(getattr(layer, n), d) for n in ("input_layernorm", "pre_feedforward_layernorm",
                                                            "post_attention_layernorm", "post_feedforward_layernorm")}
    qk = {n: _rms_gain(attn._modules[n], dh) for n in ("q_norm", "k_norm") if n in attn._modules}
    bad = [n for n, (g, _) in {**gains, **qk}.items() if g is None]
    if bad:
        return None, f"{bad[0]} is not an RMSNorm of the form x / rms(x) * g", -1
    if gains["input_layernorm"][1] != gains["pre_feedforward_layernorm"][1]:
        return None, "pre-norm eps differ", -1
    if len({e for _, e in qk.values()}) > 1:
        return None, "q_norm/k_norm eps differ", -1
    post_eps = {gains["post_attention_layernorm"][1], gains["post_feedforward_layernorm"][1]}
    if len(post_eps) > 1:
        return None, "post-norm eps differ", -1
    nh, nkv = wq.shape[1] // dh, wk.shape[1] // dh
    fw = _build("rms", gains["input_layernorm"][1], (gains["input_layernorm"][0], None),
                (gains["pre_feedforward_layernorm"][0], None), wq, bq, wk, bk, wv, bv, wo, None, wg, bg, wu, bu,
                wd, None, nh, nkv, dh, mlp.act_fn, float(attn.scaling), _raw(attn.q_proj).weight.dtype)
    qk_eps = next(iter(qk.values()))[1] if qk else 0.0
    fw.set_sandwich(q_norm_g=qk["q_norm"][0] if "q_norm" in qk else None,
                    k_norm_g=qk["k_norm"][0] if "k_norm" in qk else None, qk_eps=qk_eps,
                    post_attn_g=gains["post_attention_layernorm"][0], post_ffn_g=gains["post_feedforward_layernorm"][0],
                    post_eps=post_eps.pop(), softcap=getattr(attn, "attn_logit_softcapping", None),
                    window=getattr(attn, "sliding_window", None))
    return fw, "", int(attn.layer_idx)


def _bridge_fused(layer: Any, family: str) -> tuple[FusedWeights | None, str, int]:
    if family == "gemma":
        return _gemma_fused(layer)
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
    if "Gemma" in type(ln1).__name__:
        return None, "Gemma RMSNorm (1 + w) is not handled", -1
    if eps1 != eps2:
        return None, f"input_layernorm eps={eps1} != post_attention_layernorm eps={eps2}", -1
    if any(n in attn._modules for n in ("q_norm", "k_norm")):
        return None, "QK-norm", -1
    if getattr(attn, "sliding_window", None):
        return None, "sliding-window attention", -1
    w = _hf_linears(attn, mlp)
    if isinstance(w, str):
        return None, w, -1
    (wq, bq), (wk, bk), (wv, bv), (wo, bo), (wg, bg), (wu, bu), (wd, bd) = w
    dh = int(attn.head_dim)
    nh, nkv = wq.shape[1] // dh, wk.shape[1] // dh
    fw = _build("rms", float(eps1), (ln1.weight.detach(), None), (ln2.weight.detach(), None), wq, bq, wk, bk, wv,
                bv, wo, bo, wg, bg, wu, bu, wd, bd, nh, nkv, dh, mlp.act_fn, float(attn.scaling),
                _raw(attn.q_proj).weight.dtype)
    return fw, "", int(attn.layer_idx)


def _inner_hook_points(block: torch.nn.Module, boundary: list[Any]) -> list[Any]:
    """The block's hook points inside its boundary ones (those a forward on the fused path would skip)."""
    ids = {id(h) for h in boundary}
    return [hp for hp in hook_points(block) if id(hp) not in ids]


def _hf_parallel_forward(self: Any, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Forward of a parallelized Hugging Face decoder layer (bound to the layer instance)."""
    st: _ParallelState = self._tl_parallel
    family: str = self._tl_parallel_family
    kwargs.update(zip(self._tl_parallel_args, args))  # the decoder layer's own positional parameters
    if family == "gpt2":
        if kwargs.pop("encoder_hidden_states", None) is not None:
            raise ModelNotSupportedError("parallelized GPT-2 blocks do not support cross-attention")
        kwargs.pop("encoder_attention_mask", None)
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
        a_call = lambda h: attn(h, **kwargs)  # noqa: E731
    elif family == "gemma":  # each branch keeps its own post-norm: post_attn(attn(ln1 x)) + post_ffn(mlp(ln2 x))
        ln1, attn, ln2 = self.input_layernorm, self.self_attn, self.pre_feedforward_layernorm
        post1, post2 = self.post_attention_layernorm, self.post_feedforward_layernorm
        mlp = lambda h: post2(first_output(self.mlp(h)))  # noqa: E731
        a_call = lambda h: post1(first_output(attn(hidden_states=h, **kwargs)))  # noqa: E731
    else:
        ln1, attn, ln2, mlp = self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp
        a_call = lambda h: attn(hidden_states=h, **kwargs)  # noqa: E731
    a = first_output(a_call(ln1(x)))
    ctx, join = st.on_side(x)
    with ctx:
        m = st.correct(first_output(mlp(ln2(x))), a)  # the fitted correction (if any) of the FFN write
    join(m)
    return x + a + m


def _positional_names(layer: Any) -> tuple[str, ...]:
    """Names of the decoder layer's positional parameters after ``hidden_states`` (from its class forward)."""
    params = list(inspect.signature(type(layer).forward).parameters.values())[2:]
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _hf_fused(layer: Any, st: _ParallelState, family: str, x: Tensor, kwargs: dict) -> Tensor:
    fw = st.fused
    assert fw is not None
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 4:
        raise InputError(f"parallelized block got a {mask.dim()}-D attention mask; expected the 4-D mask "
                         "Hugging Face builds (or None)")
    pe = kwargs.get("position_embeddings")
    if family in ("llama", "gemma") and pe is None:
        raise InputError("parallelized Llama-style block needs position_embeddings (cos, sin); the bridge "
                         "passes them in a normal forward")

    cache = kwargs.get("cache")  # the Hugging Face cache (DynamicCache) of a cached decode, or None

    def core(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if family in ("llama", "gemma"):  # Gemma: q/k were QK-normed in project(), then rotary (HF order)
            cos, sin = pe[0].unsqueeze(1), pe[1].unsqueeze(1)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if cache is not None:  # Hugging Face layout [b, kv, s, dh], keys after rotary (as HF and TL's bridge store)
            k, v = cache.update(k, v, layer._tl_parallel_layer_idx)
        return fw.attend(q, k, v, mask)

    return st.step(x, core)


def _parallelize_bridge(model: Any, layers: list[int], fuse: bool, streams: bool,
                        corrections: dict[int, tuple[float, Tensor | None, Tensor | None]]) -> list[str]:
    notes = []
    for layer_i in layers:
        blk = model.blocks[layer_i]
        layer = blk._original_component
        family = _hf_family(layer)
        if family is None:
            raise ModelNotSupportedError(
                f"block {layer_i} wraps a {type(layer).__name__}; parallelize supports GPT-2-style (ln_1/attn/ln_2/"
                "mlp), Llama-style (input_layernorm/self_attn/post_attention_layernorm/mlp) and Gemma-style "
                "(sandwich norms: input/post_attention/pre_feedforward/post_feedforward_layernorm) decoder layers"
            )
        fw, why, layer_idx = _bridge_fused(layer, family) if fuse else (None, "", -1)
        if fuse and fw is None:
            notes.append(f"block {layer_i}: not fused ({why}); runs the unfused parallel path")
        inner = _inner_hook_points(blk, [blk.hook_in, blk.hook_out])
        layer._tl_parallel = _ParallelState(fw, inner, streams)
        if layer_i in corrections:
            layer._tl_parallel.set_correction(*corrections[layer_i])
        layer._tl_parallel_family = family
        layer._tl_parallel_args = _positional_names(layer)
        layer._tl_parallel_layer_idx = layer_idx if layer_idx >= 0 else layer_i
        layer.forward = types.MethodType(_hf_parallel_forward, layer)
        # the adapter (and readers of the block type) see a parallel block: no hook_resid_mid
        if type(blk).__name__ == "BlockBridge":
            blk.__class__ = _PBB
            aliases = dict(blk.hook_aliases)
            aliases.pop("hook_resid_mid", None)
            blk.hook_aliases = aliases
    return notes


def parallelize_blocks(model: Any, backend: str, layers: list[int], fuse: bool, streams: bool,
                       corrections: dict[int, tuple[float, Tensor | None, Tensor | None]] | None = None) -> list[str]:
    """Turn ``layers`` of ``model`` (a copy the caller owns) into parallel blocks, in place; returns notes on
    blocks that could not be fused. ``corrections``: ``{layer: (g, b, W)}``, the FFN write of that parallel
    block becomes g Phi(x) + b + a W (``b`` a ``[d_model]`` tensor or None, ``W`` ``[d_model, d_model]`` or None, a
    the block's attention write)."""
    parallelize = _parallelize_hooked if backend == "hooked" else _parallelize_bridge
    return parallelize(model, layers, fuse, streams, corrections or {})


def parallel_states(model: Any) -> list[_ParallelState]:
    """The executor states of every parallelized block in ``model``."""
    return [m for m in model.modules() if isinstance(m, _ParallelState)]


__all__ = ["HookedParallelBlock", "parallel_states", "parallelize_blocks"]
