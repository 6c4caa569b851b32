"""The backend room: the ONLY package of tl_steering that imports ``transformer_lens`` or ``transformers``
or touches torch's private hook state (its modules: docs/architecture.md). The rest of the package talks to a model
only through the names re-exported here."""

from .adapter import ModelAdapter, ModelInfo, adapt, check_finite
from .detect import Backend, Processing, backend_of, first_output, hooked_available, tl_version, weights_fingerprint
from .lifecycle import hook_guard, hook_points, hooks_silenced
from .wrapping import wrap_hf
from ..metrics import next_token_loss
from .decoding import cache_routing, decode_step, freeze_kv_cache, kv_cache, kv_cache_length
from .loading import gemma_gguf_path, load_model, smollm2_gguf_path, tiny_hf_model, tiny_model

__all__ = [
    "Backend",
    "ModelAdapter",
    "ModelInfo",
    "Processing",
    "adapt",
    "backend_of",
    "cache_routing",
    "check_finite",
    "decode_step",
    "first_output",
    "freeze_kv_cache",
    "gemma_gguf_path",
    "hook_guard",
    "hook_points",
    "hooked_available",
    "hooks_silenced",
    "kv_cache",
    "kv_cache_length",
    "load_model",
    "next_token_loss",
    "smollm2_gguf_path",
    "tiny_hf_model",
    "tiny_model",
    "tl_version",
    "weights_fingerprint",
    "wrap_hf",
]
