"""What TransformerLens did to a model's weights, read from the model itself (:func:`weight_processing`). See
docs/loading.md, "Weight processing"."""

import dataclasses
import threading
import warnings
import weakref
from typing import Any

import torch

from .hookbase import modules_of
from .detect import backend_of

STEPS = ("compatibility_mode", "fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")
WEIGHT_STEPS = STEPS[1:]
_CHUNK = 1 << 22  # elements per chunk of a float64 reduction (32 MiB): Gemma's unembedding is 168M numbers


@dataclasses.dataclass(frozen=True)
class WeightProcessing:
    """What was done to a model's weights: ``label`` ``"raw"``, ``"tl"`` (a step of :data:`WEIGHT_STEPS` found) or
    ``"unknown"`` (weights on ``meta``, no flag); ``steps`` in :data:`STEPS` order (docs/loading.md)."""

    label: str
    steps: tuple[str, ...] = ()

    @property
    def changes_residual(self) -> bool:
        """Whether the residual stream differs from the raw model's (centred writes)."""
        return "center_writing_weights" in self.steps


def _readable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta" and t.numel() > 0


def _max_relative_mean(w: torch.Tensor, dim: int) -> float:
    """max over the other axes of |mean of ``w`` along ``dim``|, divided by the RMS of ``w`` (float64, chunked)."""
    w = w.detach().movedim(dim, -1)
    rows = w.reshape(-1, w.shape[-1])
    step = max(1, _CHUNK // max(1, rows.shape[1]))
    worst, sq, n = 0.0, 0.0, 0
    for i in range(0, rows.shape[0], step):
        c = rows[i:i + step].to(torch.float64)
        worst = max(worst, float(c.mean(-1).abs().max()))
        sq += float((c * c).sum())
        n += c.numel()
    rms = (sq / max(n, 1)) ** 0.5
    return worst / rms if rms > 0 else 0.0


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-3


def _get(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - a bridge property that cannot build its matrix here
        return None


def _centred(ws: list[Any]) -> bool | None:
    """True when every readable matrix has a zero mean over its last axis (``d_model``); None when none is."""
    ws = [w for w in ws if _readable(w)]
    if not ws:
        return None
    return all(_max_relative_mean(w, -1) <= _tolerance(w.dtype) for w in ws)


def _detect(model: Any) -> WeightProcessing:
    backend = backend_of(model)
    steps: list[str] = []
    if backend == "bridge":
        if getattr(model, "compatibility_mode", False):
            steps.append("compatibility_mode")
        processed = bool(getattr(model, "_weights_processed", False))
        if processed and getattr(getattr(model, "adapter", None), "_fold_ln_requested", True):
            steps.append("fold_ln")
    else:
        processed = None  # a HookedTransformer keeps no flag: read everything from the weights
        if str(getattr(model.cfg, "normalization_type", "")) in ("LNPre", "RMSPre"):
            steps.append("fold_ln")
    readable = any(_readable(p) for p in model.parameters())
    if processed is not False and readable:
        blocks = list(getattr(model, "blocks", []))
        writes = [_get(model, "W_E"), _get(model, "W_pos")]
        for blk in blocks:
            writes += [_get(_get(blk, "attn"), "W_O"), _get(_get(blk, "mlp"), "W_out")]
        if _centred(writes):
            steps.append("center_writing_weights")
        w_u = _get(model, "W_U")
        if _readable(w_u) and _max_relative_mean(w_u, -1) <= _tolerance(w_u.dtype):
            steps.append("center_unembed")
        b_v = [_get(_get(blk, "attn"), "b_V") for blk in blocks]
        b_v = [b for b in b_v if _readable(b)]
        if (processed or any(s in steps for s in WEIGHT_STEPS)) and b_v and all(not bool(b.any()) for b in b_v):
            steps.append("fold_value_biases")
    if any(s in steps for s in WEIGHT_STEPS):
        label = "tl"
    elif processed is False or readable:
        label = "raw"
    else:
        label = "unknown"
    return WeightProcessing(label, tuple(s for s in STEPS if s in steps))


_cache: "weakref.WeakKeyDictionary[Any, tuple[tuple, WeightProcessing]]" = weakref.WeakKeyDictionary()
_warned: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _state_key(model: Any) -> tuple:
    """Changes when the weights or TransformerLens's processing flags change: the ``id`` and in-place ``_version``
    of every parameter of every module inside ``model`` (a bridge's own and the wrapped model's)."""
    flags = (getattr(model, "compatibility_mode", None), getattr(model, "_weights_processed", None),
             str(getattr(getattr(model, "cfg", None), "normalization_type", None)))
    return flags + tuple((id(p), p._version) for m in modules_of(model) for p in m._parameters.values()
                         if p is not None)


def weight_processing(model: Any) -> WeightProcessing:
    """What was done to ``model``'s weights (see the module docstring); cached until a weight or flag changes."""
    key = _state_key(model)
    hit = _cache.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    res = _detect(model)
    with _lock:
        _cache[model] = (key, res)
    return res


def warn_once(model: Any, key: Any, message: str, stacklevel: int = 3, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message)`` the first time ``key`` is seen for ``model`` (one warning per model and key)."""
    with _lock:
        seen = _warned.setdefault(model, set())
        if key in seen:
            return
        seen.add(key)
    warnings.warn(message, category, stacklevel=stacklevel)


def warn_if_processed(model: Any, proc: WeightProcessing) -> None:
    """One warning per model (and processing) when its residual stream is processed (centred writes)."""
    if proc.changes_residual:
        warn_once(model, ("processing", proc.steps),
                  f"this model's weights were processed by TransformerLens ({', '.join(proc.steps)}): its residual "
                  "stream is mean-centred, so directions, norms, angles and every geometry number measured on it "
                  "(deficit, diversity, the tangential/radial split, critical points) differ from the raw model's; "
                  "losses do not. The paper measured raw weights: load with processing='raw' (the default), or use a "
                  "bridge without enable_compatibility_mode() / with enable_compatibility_mode(no_processing=True). "
                  "Recorded in the result's provenance (processing, processing_steps).", stacklevel=4)


__all__ = ["STEPS", "WEIGHT_STEPS", "WeightProcessing", "warn_if_processed", "warn_once", "weight_processing"]
