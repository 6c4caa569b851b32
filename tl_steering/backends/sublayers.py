"""Pure sublayer callables of one block (pre-norm, sandwich-norm and post-norm blocks), with the block's norms
detected from the block itself, and :func:`bridge_attention_kwargs`. See docs/gemma.md."""

import dataclasses
import inspect
from typing import Any

import torch
from torch import Tensor

from .detect import first_output
from .fused import causal_mask

try:  # TL 3.x: OLMo 2 post-norm blocks on HookedTransformer
    from transformer_lens.components.transformer_block import (  # type: ignore[attr-defined]
        POST_NORM_ARCHITECTURES as _POST_NORM_ARCHS,
    )
except ImportError:  # TL 4.x (no HookedTransformer) or an older 3.x
    _POST_NORM_ARCHS = ()


@dataclasses.dataclass(frozen=True)
class SublayerNorms:
    """The four norms around a block's sublayers; ``None`` means identity (the norm is absent)."""

    pre_attn: torch.nn.Module | None
    post_attn: torch.nn.Module | None
    pre_ffn: torch.nn.Module | None
    post_ffn: torch.nn.Module | None


def _child(blk: torch.nn.Module, name: str) -> torch.nn.Module | None:
    m = blk._modules.get(name)
    return None if m is None or isinstance(m, torch.nn.Identity) else m


def sublayer_norms(blk: torch.nn.Module) -> SublayerNorms:
    """Detect the norms of a TransformerLens block (HookedTransformer ``TransformerBlock`` or ``BlockBridge``)."""
    cfg = getattr(blk, "cfg", None)
    if _POST_NORM_ARCHS and getattr(cfg, "original_architecture", None) in _POST_NORM_ARCHS \
            and type(blk).__name__ != "BlockBridge" and "ln1_post" not in blk._modules:
        # HookedTransformer OLMo 2: ln1/ln2 are applied AFTER attn/MLP (TransformerBlock.forward)
        return SublayerNorms(None, _child(blk, "ln1"), None, _child(blk, "ln2"))
    post_only = _bridge_post_norm_only(blk)
    if post_only is not None:
        return post_only
    ln1, ln2 = _child(blk, "ln1"), _child(blk, "ln2")
    post1, post2 = _child(blk, "ln1_post"), _child(blk, "ln2_post")
    if ln2 is None and post2 is None:
        ln2 = ln1  # GPT-J / Phi: the MLP reads ln1's output (shared norm)
    return SublayerNorms(ln1, post1, ln2, post2)


def unwrap(m: Any) -> Any:
    """The Hugging Face module a bridge component wraps (``m`` itself for any other module)."""
    for _ in range(8):
        inner = m._modules.get("_original_component") if isinstance(m, torch.nn.Module) else None
        if inner is None:
            break
        m = inner
    return m


def _bridge_post_norm_only(blk: torch.nn.Module) -> SublayerNorms | None:
    """A bridge block whose Hugging Face layer has norms only AFTER its sublayers (OLMo 2: post_attention_ and
    post_feedforward_layernorm, no input_/pre_feedforward_layernorm). TL 3.9's bridge names those norms ``ln1`` /
    ``ln2``, TL 4.x ``ln1_post`` / ``ln2_post``: we map them by the Hugging Face module they wrap, not by name."""
    layer = blk._modules.get("_original_component")
    if layer is None:
        return None
    names = set(layer._modules)
    if not {"post_attention_layernorm", "post_feedforward_layernorm"} <= names or \
            names & {"input_layernorm", "pre_feedforward_layernorm"}:
        return None
    want = {id(unwrap(layer._modules[n])): n for n in ("post_attention_layernorm", "post_feedforward_layernorm")}
    found: dict[str, torch.nn.Module] = {}
    for child in ("ln1", "ln1_post", "ln2", "ln2_post"):
        m = _child(blk, child)
        if m is not None and id(unwrap(m)) in want:
            found[want[id(unwrap(m))]] = m
    if len(found) != 2:
        return None
    return SublayerNorms(None, found["post_attention_layernorm"], None, found["post_feedforward_layernorm"])


def _apply(norm: torch.nn.Module | None, x: Tensor) -> Tensor:
    return x if norm is None else first_output(norm(x))


def ffn_apply(blk: torch.nn.Module, norms: SublayerNorms, x3: Tensor) -> Tensor:
    """Phi(x) = post_ffn(MLP(pre_ffn(x))) on ``[batch, pos, d]`` (no hook handling here)."""
    return _apply(norms.post_ffn, _apply(blk.mlp, _apply(norms.pre_ffn, x3)))


def bridge_attention_kwargs(model: Any, blk: torch.nn.Module, x: Tensor) -> dict[str, Any]:
    """What the decoder layer passes the bridge's attention for a full causal sequence ``x`` [batch, pos, d]:
    rotary ``position_embeddings`` for positions 0..pos-1 (the layer's own type on Gemma 3) and, on
    sliding-window layers longer than their window, a 4-D boolean causal sliding mask (True = attend)."""
    kwargs: dict[str, Any] = {}
    batch, n_pos = x.shape[0], x.shape[1]
    hf_attn = unwrap(blk.attn)
    rotary = getattr(model, "rotary_emb", None)
    if rotary is not None:
        pos = torch.arange(n_pos, device=x.device).unsqueeze(0).expand(batch, -1)
        layer_type = getattr(hf_attn, "layer_type", None)
        typed = layer_type is not None and "layer_type" in inspect.signature(unwrap(rotary).forward).parameters
        kwargs["position_embeddings"] = rotary(x, pos, layer_type) if typed else rotary(x, pos)
    window = getattr(hf_attn, "sliding_window", None)
    if window and n_pos > int(window):
        allowed = causal_mask(n_pos, n_pos, x.device, int(window))
        kwargs["attention_mask"] = allowed[None, None].expand(batch, 1, n_pos, n_pos)
    return kwargs


def attention_apply(model: Any, blk: torch.nn.Module, norms: SublayerNorms, backend: str, x: Tensor) -> Tensor:
    """A(x) = post_attn(attn(pre_attn(x))) on the full residual ``[batch, pos, d]`` (causal; no hook handling)."""
    h = _apply(norms.pre_attn, x)
    if backend == "hooked":
        out = blk.attn(h, h, h)
    else:
        out = blk.attn(hidden_states=h, **bridge_attention_kwargs(model, blk, x))
    return _apply(norms.post_attn, first_output(out))


__all__ = ["SublayerNorms", "attention_apply", "bridge_attention_kwargs", "ffn_apply", "unwrap", "sublayer_norms"]
