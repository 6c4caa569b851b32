"""The adapter's checks of what goes in and comes out of a model: token batches, finite activations, and the
residual identities that guard every decomposition against known bridge bugs. ``ad`` is a
:class:`~tl_steering.backends.adapter.ModelAdapter` (its ``hook_name``, ``layers``, ``is_parallel``, ``dtype``,
``device``, ``n_ctx``, ``cfg``)."""

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from .. import validation
from ..errors import DeviceMismatchError, InputError, NonFiniteError, ResidualIdentityError


def validate_tokens(ad: Any, tokens: Any, min_len: int = 2) -> Int[Tensor, "batch pos"]:
    """Check a token batch and move nothing silently: wrong device is an error, not a copy."""
    if not isinstance(tokens, Tensor):
        raise InputError(f"tokens must be a torch.Tensor of token ids, got {type(tokens).__name__}; "
                         "use model.to_tokens(text) or tl_steering.text_tokens(model)")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise InputError(f"tokens must be integer ids (torch.long), got dtype {tokens.dtype}")
    if tokens.dim() == 1:
        tokens = tokens[None]
    if tokens.dim() != 2:
        raise InputError(f"tokens must have shape [batch, pos], got {tuple(tokens.shape)}")
    if tokens.shape[0] == 0:
        raise InputError("empty batch: tokens has 0 sequences")
    if tokens.shape[1] < min_len:
        raise InputError(
            f"sequences of length {tokens.shape[1]} are too short: at least {min_len} positions are needed "
            "(position 0 is excluded from statistics and a next-token loss needs two)"
        )
    validation.check_length(int(tokens.shape[1]), ad.n_ctx)
    validation.check_not_meta(tokens)
    if tokens.device != ad.device:
        raise DeviceMismatchError(
            f"tokens are on {tokens.device} but the model is on {ad.device}; "
            f"move them with tokens.to('{ad.device}')"
        )
    vocab = int(ad.cfg.d_vocab)
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab:
        raise InputError(f"token ids must lie in [0, {vocab}); got range [{lo}, {hi}]")
    return tokens.long()


def identity_tolerance(ad: Any) -> float:
    """Relative tolerance for residual identities: dtype-aware."""
    return {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}.get(
        ad.dtype, 1e-5)


def check_residual_identity(ad: Any, cache: dict[str, Tensor], layers: Sequence[int] | None = None,
                            rtol: float | None = None) -> dict[int, float]:
    """Check resid_pre + attn_out (+ mlp_out) against resid_mid / resid_post for each layer of ``cache``: the worst
    relative error per layer (error / max |residual|); :class:`ResidualIdentityError` naming the layer when one
    exceeds ``rtol``."""
    rtol = identity_tolerance(ad) if rtol is None else rtol
    out: dict[int, float] = {}
    for layer in ad.layers(layers):
        g = lambda s: cache[ad.hook_name(layer, s)].to(torch.float64)  # noqa: E731
        pre, attn, mlp, post = g("resid_pre"), g("attn_out"), g("mlp_out"), g("resid_post")
        scale = max(float(post.abs().max()), float(pre.abs().max()), 1e-30)
        if ad.is_parallel(layer):
            errs = {"resid_pre + attn_out + mlp_out = resid_post": float((pre + attn + mlp - post).abs().max())}
        else:
            mid = g("resid_mid")
            errs = {
                "resid_pre + attn_out = resid_mid": float((pre + attn - mid).abs().max()),
                "resid_mid + mlp_out = resid_post": float((mid + mlp - post).abs().max()),
            }
        worst = max(errs.values()) / scale
        out[layer] = worst
        if not worst <= rtol:
            which = max(errs, key=errs.get)
            raise ResidualIdentityError(
                f"layer {layer}: {which} fails (relative error {worst:.3g} > {rtol:.1g}). The model's "
                "hook_attn_out / hook_mlp_out do not decompose the residual stream (a known class of "
                "TransformerBridge bugs, or a hook of yours rewrote an activation); tl_steering's "
                "decompositions would be wrong on it."
            )
    return out


def identity_names(ad: Any, layers: Sequence[int] | None = None) -> list[str]:
    """The hook names :func:`check_residual_identity` reads."""
    names = []
    for layer in ad.layers(layers):
        sites = ["resid_pre", "attn_out", "mlp_out", "resid_post"]
        if not ad.is_parallel(layer):
            sites.append("resid_mid")
        names += [ad.hook_name(layer, s) for s in sites]
    return names


def check_finite(x: Tensor, layer: int | None, site: str) -> None:
    """Raise :class:`NonFiniteError` naming the layer and site when ``x`` has NaN or Inf."""
    if not torch.isfinite(x).all():
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        where = f"layer {layer}, {site}" if layer is not None else site
        raise NonFiniteError(
            f"non-finite activation at {where}: {n_nan} NaN and {n_inf} Inf values. Check the model weights "
            "and any hooks of yours on that point; in float16 try float32 or bfloat16."
        )


def split_hook_name(name: str) -> tuple[int | None, str]:
    """``blocks.3.hook_x`` -> ``(3, 'hook_x')``; a name outside the blocks -> ``(None, name)``."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "blocks" and parts[1].isdigit():
        return int(parts[1]), ".".join(parts[2:])
    return None, name


__all__ = ["check_finite", "check_residual_identity", "identity_names", "identity_tolerance", "split_hook_name",
           "validate_tokens"]
