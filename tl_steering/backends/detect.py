"""Which TransformerLens is installed and which model class a model is, the site vocabulary and the bit-exact
weight fingerprint. See docs/architecture.md."""

import functools
import importlib.metadata
from typing import Any, Literal

import torch
from torch import Tensor

from transformer_lens.model_bridge import TransformerBridge as _TransformerBridge

from ..errors import ModelNotSupportedError

try:  # TL 3.x
    from transformer_lens import HookedTransformer as _HookedTransformer  # type: ignore[attr-defined]
except ImportError:  # TL 4.x
    _HookedTransformer = None


@functools.cache  # the imported package cannot change inside a process; parsing its metadata costs ~1 ms a call
def tl_version() -> str:
    """Installed TransformerLens version (from the package metadata)."""
    try:
        return importlib.metadata.version("transformer-lens")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def hooked_available() -> bool:
    """Whether ``HookedTransformer`` exists in the installed TransformerLens (3.x yes, 4.x no)."""
    return _HookedTransformer is not None


Backend = Literal["hooked", "bridge"]
Processing = Literal["raw", "tl"]
_SITE_HOOK = {s: f"hook_{s}" for s in ("resid_pre", "attn_out", "resid_mid", "mlp_in", "mlp_out", "resid_post")}
_SITE_HOOK["ln2_normalized"] = "ln2.hook_normalized"
SITES: tuple[str, ...] = (*_SITE_HOOK, "ffn_input")


def backend_of(model: Any) -> Backend:
    """``"hooked"`` or ``"bridge"``; raises :class:`ModelNotSupportedError` for anything else."""
    if isinstance(model, _TransformerBridge):
        return "bridge"
    if _HookedTransformer is not None and isinstance(model, _HookedTransformer):
        return "hooked"
    raise ModelNotSupportedError(
        f"expected a TransformerLens HookedTransformer or TransformerBridge, got {type(model).__name__}. "
        "Load one with tl_steering.load_model(...) or TransformerBridge.boot_transformers(...).")


def parameter_device(model: torch.nn.Module) -> torch.device:
    """Where the model's weights are (the first parameter's device; cpu for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def first_output(out: Any) -> Tensor:
    """Bridge components may return tuples: keep the hidden states."""
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A hash of every parameter and buffer (bit-exact), to prove a call left the weights alone; a tensor offloaded
    by accelerate (``meta`` device) contributes its name, dtype and shape only (docs/scale_out.md)."""
    import hashlib

    h = hashlib.sha256()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        if t.device.type == "meta":
            h.update(f"offloaded{tuple(t.shape)}".encode())
            continue
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
