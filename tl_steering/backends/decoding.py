"""Incremental (KV-cache) decoding on both model classes. See docs/generate.md and docs/parallel.md, "Masks and KV
cache"."""

import contextlib
import functools
import inspect
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from .. import validation
from ..errors import InputError
from .detect import backend_of

from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge as _AttnBridge


def kv_cache(model: Any, batch: int = 1) -> Any:
    """An empty KV cache for ``model`` (HookedTransformer: TL's cache for ``batch`` sequences; bridge: a Hugging
    Face ``DynamicCache``, which sizes itself on the first step)."""
    if backend_of(model) == "hooked":
        from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

        return TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, batch)
    from transformers import DynamicCache

    return DynamicCache()


def _route(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if kwargs.get("past_key_values") is None and kwargs.get("cache") is not None:
        kwargs = dict(kwargs)
        kwargs["past_key_values"] = kwargs["cache"]
    return args, kwargs


@contextlib.contextmanager
def cache_routing(model: Any) -> Iterator[Any]:
    """Inside the block, every attention bridge of ``model`` also receives the Hugging Face cache its decoder layer
    passes as ``cache=`` under ``past_key_values=`` (the name TransformerLens reads). Nested entries are free; a
    HookedTransformer needs nothing. The pre-hooks are removed on exit, also on error."""
    if backend_of(model) != "bridge" or getattr(model, "_tl_steering_routing", 0):
        yield model
        return
    handles = [m.register_forward_pre_hook(_route, with_kwargs=True) for m in model.modules()
               if isinstance(m, _AttnBridge)]
    model._tl_steering_routing = 1
    try:
        yield model
    finally:
        model._tl_steering_routing = 0
        for h in handles:
            h.remove()


def _update_kv_cache(self: Any, k: Tensor, v: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """``AttentionBridge._update_kv_cache`` that also finds the cache under ``cache=`` (transformers >= 5.x's name)
    when TransformerLens's names (``past_key_values``, ``layer_past``) carry none. Bound per instance by
    :func:`route_cache_keyword` (named like the method it shadows, so a pickled bound method resolves)."""
    if kwargs.get("past_key_values") is None and kwargs.get("layer_past") is None and kwargs.get("cache") is not None:
        kwargs["past_key_values"] = kwargs["cache"]
    return type(self)._update_kv_cache(self, k, v, **kwargs)


# transformers 5.x's FutureWarning when TransformerLens's generate() passes the KV cache to the Hugging Face model
# under its old name: TransformerLens's doing, nothing the user can act on
_PKV_DEPRECATION = r"`past_key_values` is deprecated and will be removed"


def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
    """TransformerLens's own ``generate`` of the bridge with transformers' ``past_key_values`` FutureWarning filtered
    for this call alone; bound per instance like :func:`_update_kv_cache`."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_PKV_DEPRECATION, category=FutureWarning)
        return type(self).generate(self, *args, **kwargs)


def route_cache_keyword(model: Any) -> Any:
    """Make every attention bridge of ``model`` (a model the caller owns) read the Hugging Face cache that
    transformers 5.x passes as ``cache=``, in place (an instance attribute, not a hook), bind its ``generate`` to
    :func:`generate`, and return the model. Idempotent; a no-op on a HookedTransformer (docs/generate.md)."""
    if backend_of(model) != "bridge":
        return model
    if "generate" not in model.__dict__ and callable(getattr(type(model), "generate", None)):
        model.__dict__["generate"] = types.MethodType(generate, model)
    for m in model.modules():
        if isinstance(m, _AttnBridge) and "_update_kv_cache" not in m.__dict__:
            m._update_kv_cache = types.MethodType(_update_kv_cache, m)
    return model


def cache_keyword_routed(model: Any) -> bool:
    """Whether every attention bridge of ``model`` reads ``cache=`` (:func:`route_cache_keyword`); True for a
    HookedTransformer."""
    if backend_of(model) != "bridge":
        return True
    return all("_update_kv_cache" in m.__dict__ for m in model.modules() if isinstance(m, _AttnBridge))


def decode_step(model: Any, tokens: Tensor, cache: Any) -> Tensor:
    """Logits ``[batch, len(tokens), vocab]`` of ``tokens`` following the positions already in ``cache``, which is
    extended by them (unless frozen). A prefill is a step on the whole prompt with an empty cache. ``tokens`` with
    0 positions (an empty prompt) or 0 sequences is an :class:`~tl_steering.errors.InputError`."""
    if not isinstance(tokens, Tensor) or tokens.dim() != 2:
        raise InputError(f"decode_step: tokens must be a [batch, pos] tensor of token ids, got "
                         f"{tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__}")
    if tokens.shape[0] == 0:
        raise InputError("decode_step: tokens has 0 sequences; pass a [batch >= 1, pos] tensor")
    validation.check_length(int(tokens.shape[1]), None, "decode_step: tokens")
    if backend_of(model) == "hooked":
        return model(tokens, past_kv_cache=cache)
    with cache_routing(model):
        return model(tokens, return_type="logits", use_cache=True,
                     **{_cache_kwarg(type(model.original_model)): cache})


@functools.cache
def _cache_kwarg(hf: type) -> str:
    """The keyword Hugging Face model class ``hf`` takes its cache by: ``cache`` (transformers >= 5.x, where
    ``past_key_values`` is deprecated) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def kv_cache_length(cache: Any) -> int:
    """Positions held by ``cache``."""
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    return int(cache[0].past_keys.shape[1])


def _frozen_update(self: Any, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple:
    return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def freeze_kv_cache(cache: Any) -> Any:
    """Freeze ``cache`` in place (and return it): later steps attend to its positions and their own but store
    nothing, so every step sees the same prefix (the benchmark's decode row; HookedTransformer's ``freeze()``)."""
    if hasattr(cache, "freeze"):
        cache.freeze()
        return cache
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            raise ValueError("freeze_kv_cache: run a prefill first (an empty layer has nothing to freeze)")
        layer.update = types.MethodType(_frozen_update, layer)
    return cache


__all__ = ["cache_keyword_routed", "cache_routing", "decode_step", "freeze_kv_cache", "kv_cache", "kv_cache_length",
           "route_cache_keyword"]
