"""Wrapping a Hugging Face causal LM into a TransformerLens model, on the device asked for or refused
(docs/loading.md)."""

import contextlib
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from .. import validation
from ..errors import InputError, ModelLoadError, ModelNotSupportedError
from .decoding import route_cache_keyword
from .detect import Backend, Processing, _HookedTransformer, _TransformerBridge, parameter_device, tl_version


def move_to_device(model: Any, device: torch.device) -> Any:
    """Move ``model`` to ``device`` and check that every parameter got there; keep ``cfg.device`` truthful."""
    if any(not validation.same_device(p.device, device) for p in model.parameters()):
        model.to(device)
    wrong = sorted({str(p.device) for p in model.parameters() if not validation.same_device(p.device, device)})
    if wrong:
        raise ModelLoadError(f"asked for device {device} but parameters stayed on {wrong} after .to({device!s})")
    actual = parameter_device(model)
    cfg = getattr(model, "cfg", None)
    if hasattr(cfg, "device"):
        with contextlib.suppress(Exception):  # a frozen config: the parameters are what counts
            cfg.device = actual if not isinstance(cfg.device, str) else str(actual)
    return model


def check_options(backend: str, processing: str) -> None:
    """Refuse an unknown ``backend`` or ``processing``, and ``backend="hooked"`` on a TransformerLens without
    HookedTransformer, before any weight is read."""
    validation.as_choice(backend, "backend", ("bridge", "hooked"))
    validation.as_choice(processing, "processing", ("raw", "tl"))
    if backend == "hooked" and _HookedTransformer is None:
        raise ModelNotSupportedError(
            f"backend='hooked' needs HookedTransformer, which TransformerLens {tl_version()} removed (4.0). "
            "Use backend='bridge', or install transformer-lens 3.9 (pip install 'transformer-lens==3.9.*').")


def wrap_hf(hf_model: Any, tokenizer: Any, backend: Backend, processing: Processing,
            device: str | torch.device | None, label: str, hf_config_dir: str | Path | None = None,
            tl_name: str | None = None) -> Any:
    """Wrap a Hugging Face causal LM into a HookedTransformer (TL 3.9) or TransformerBridge.

    Args:
        hf_model: the HF model (on CPU, eval mode).
        tokenizer: a tokenizer loadable from a local directory (TL reloads it by ``name_or_path``).
        backend: "bridge" (TL 3.9 and 4.x) or "hooked" (TL 3.9 only).
        processing: "raw" (no LN folding, no centring: Hugging Face geometry) or "tl" (TL's processed weights).
        device: target device (None: CPU). Checked before anything is built; the weights are moved there.
        label: name for the directory holding config and tokenizer (must not contain "llama"/"gemma": TL 3.9
            infers the architecture from that name).
        hf_config_dir: directory with config.json and tokenizer files; created in a temp dir if None.
        tl_name: HookedTransformer only: the official TransformerLens name whose built-in config to use (e.g.
            ``"google/gemma-3-270m"``; TL 3.9 reads Gemma 3 configs by name and refuses them from a local
            directory). The weights still come from ``hf_model``; nothing is downloaded.
    """
    check_options(backend, processing)
    # a model dispatched by accelerate (from_pretrained(device_map=...), dispatch_model): layers on several devices,
    # or offloaded to CPU / disk and loaded by accelerate's hooks at forward time; it cannot be moved as a whole
    dispatched = bool(getattr(hf_model, "hf_device_map", None))
    if dispatched and (device is not None or backend != "bridge"):
        raise InputError("this Hugging Face model was dispatched over devices by accelerate (hf_device_map): wrap it "
                         "with backend='bridge' and device=None (its placement is kept), or load it without "
                         "device_map")
    dev = validation.as_device(device)
    hf_model.eval()
    # TL 3.9 reads config.architectures and fails on None
    hf_model.config.architectures = [type(hf_model).__name__]
    if hf_config_dir is None:
        safe = "".join(c if c.isalnum() else "-" for c in label.lower())
        for word in ("llama", "gemma", "gpt2", "neox", "pythia", "mistral"):
            safe = safe.replace(word, "m")
        hf_config_dir = tempfile.mkdtemp(prefix=f"tlsteering-{safe}-")
        hf_model.config.save_pretrained(hf_config_dir)
        tokenizer.save_pretrained(hf_config_dir)
        from transformers import AutoTokenizer

        # TL reloads the tokenizer by name_or_path: it must point at a local directory
        tokenizer = AutoTokenizer.from_pretrained(str(hf_config_dir))
    if backend == "bridge":
        # boot_transformers(hf_model=...) records the device without moving the weights: move_to_device does
        try:
            model = _TransformerBridge.boot_transformers(str(hf_config_dir), hf_model=hf_model, tokenizer=tokenizer,
                                                         device=str(dev))
        except ValueError as e:
            if dispatched and "offload" in str(e):  # TL 3.9's bridge refuses layers offloaded to disk
                raise ModelNotSupportedError(
                    f"TransformerLens {tl_version()} cannot wrap a model with layers offloaded to disk/meta ({e}); "
                    "use TransformerLens 4.x, or keep every layer in memory") from e
            raise
        if processing == "tl":
            model.enable_compatibility_mode()
        route_cache_keyword(model)  # generate()'s KV cache on transformers 5.x (backends/decoding.py)
        if dispatched:  # accelerate placed (and maybe offloaded) the layers: keep that placement
            return model
        return move_to_device(model, dev)
    import transformer_lens.loading_from_pretrained as lp

    fold = processing == "tl"
    src = tl_name or str(hf_config_dir)
    # the HF model's dtype, as HookedTransformer.from_pretrained(dtype=...) sets it: parameters and cfg.dtype
    dtype = next(hf_model.parameters()).dtype
    cfg = lp.get_pretrained_model_config(src, device=str(dev), fold_ln=fold, dtype=dtype)
    state_dict = lp.get_pretrained_state_dict(src, cfg, hf_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = _HookedTransformer(cfg, tokenizer, move_to_device=False)
    model.load_and_process_state_dict(state_dict, fold_ln=fold, center_writing_weights=fold and cfg.normalization_type
                                      in ("LN", "LNPre"), center_unembed=fold, fold_value_biases=fold,
                                      refactor_factored_attn_matrices=False)
    model.eval()
    return move_to_device(model, dev)


__all__ = ["check_options", "move_to_device", "wrap_hf"]
