"""Block surgery for the parallel executor (the backend side of :func:`tl_steering.parallel.apply.parallelize`):
the ``HookedParallelBlock`` subclass (TL 3.9) and the entry points; the bridge side is :mod:`.executor_bridge`, the
math and the per-block state :mod:`.fused`. See docs/parallel.md."""

from typing import Any

from torch import Tensor

from .executor_bridge import _inner_hook_points, _parallelize_bridge
from .fused import FusedWeights, _build, _ParallelState
from .sublayers import unwrap as _raw  # noqa: F401  (tests)

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
        attn.W_Q.dtype, b_post=mlp.b_in.detach() if gated else None,
    )
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
