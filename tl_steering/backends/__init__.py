"""The backend room: the ONLY package of tl_steering that imports ``transformer_lens`` or ``transformers``
or touches torch's private hook state (its modules: docs/architecture.md). The rest of the package talks to a model
only through the names re-exported here."""

from .adapter import ModelAdapter, ModelInfo, adapt, check_finite
from .detect import backend_of, hooked_available, tl_version, weights_fingerprint
from .lifecycle import hook_guard, hooks_silenced
from .decoding import cache_routing, decode_step, freeze_kv_cache, kv_cache, kv_cache_length
from .loading import load_model, smollm2_gguf_path, tiny_hf_model, tiny_model, wrap_hf

__all__ = [
    "ModelAdapter", "ModelInfo", "adapt", "backend_of", "cache_routing", "check_finite", "decode_step",
    "freeze_kv_cache", "hook_guard", "hooked_available", "hooks_silenced", "kv_cache", "kv_cache_length",
    "load_model", "smollm2_gguf_path", "tiny_hf_model", "tiny_model", "tl_version", "weights_fingerprint",
    "wrap_hf"]
