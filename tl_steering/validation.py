"""Strict argument checks shared by every public entry point and the CLI (docs/architecture.md, bad input)."""

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from ._util.checks import _is_int, as_int  # noqa: F401 - as_int re-exported (it needs no torch)
from .errors import (ArgumentTypeError, DeviceMismatchError, DeviceUnavailableError, InputError, LayerIndexError,
                     NonFiniteError)


def as_float(value: Any, name: str) -> float:
    """``value`` as a finite float (int or float; not bool, str or None)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value).__name__ != "bool_"
    if isinstance(value, torch.Tensor):
        ok = value.dim() == 0 and value.dtype != torch.bool and not value.is_complex()
    if not ok:
        raise ArgumentTypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(v := float(value)):
        raise InputError(f"{name} must be finite, got {v}")
    return v


def as_bool(value: Any, name: str) -> bool:
    """``value`` as a bool: only True/False (not 0/1, not "yes")."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise ArgumentTypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def as_choice(value: Any, name: str, choices: Sequence[str]) -> str:
    """``value`` as one of the strings ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise InputError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def as_choices(value: Any, name: str, choices: Sequence[str]) -> list[str]:
    """One choice or a sequence of choices (each a string among ``choices``); None and other types refused."""
    if isinstance(value, str):
        value = [value]
    if value is None or not isinstance(value, (list, tuple)):
        raise ArgumentTypeError(f"{name} must be one of {tuple(choices)} or a list of them, got {value!r}")
    bad = [v for v in value if not isinstance(v, str) or v not in choices]
    if bad:
        raise InputError(f"unknown {name} value(s) {bad}; choose among {tuple(choices)}")
    if not value:
        raise InputError(f"{name} is empty; choose among {tuple(choices)}")
    return list(value)


def as_int_list(value: Any, name: str, *, allow_empty: bool = True) -> list[int]:
    """A sequence of ints (a list, tuple, range or 1-d integer tensor), each checked by :func:`as_int`; a bare int
    (:func:`as_layers` takes "one or many") and a string (not iterated character by character) are refused."""
    if value is None:
        raise ArgumentTypeError(f"{name} must be a sequence of ints, got None")
    if isinstance(value, (str, bytes)):
        raise ArgumentTypeError(f"{name} must be a sequence of ints, got the string {value!r}; "
                                f"write {name}=[...] with int entries")
    if isinstance(value, torch.Tensor):
        if value.dim() > 1:
            raise ArgumentTypeError(f"{name} must be 1-d, got a tensor of shape {tuple(value.shape)}")
        value = list(value.reshape(-1))
    if not isinstance(value, Sequence):  # a set, a generator ...
        try:
            value = list(value)
        except TypeError:
            raise ArgumentTypeError(f"{name} must be a sequence of ints, got {value!r} "
                                    f"({type(value).__name__})") from None
    out = []
    for i, v in enumerate(value):
        if not _is_int(v):
            raise ArgumentTypeError(f"{name}[{i}] must be an int, got {v!r} ({type(v).__name__})")
        out.append(int(v))
    if not out and not allow_empty:
        raise InputError(f"{name} is empty")
    return out


def as_layer(value: Any, n_layers: int, name: str = "layer") -> int:
    """One layer index (negative counts from the end), checked against ``n_layers``; returns 0..n_layers-1."""
    if not _is_int(value):
        raise ArgumentTypeError(f"{name} must be an int layer index, got {value!r} ({type(value).__name__})")
    v = int(value)
    if not -n_layers <= v < n_layers:
        raise LayerIndexError(f"{name} {v} is out of range: this model has {n_layers} layers (0..{n_layers - 1})")
    return v % n_layers


def as_layers(value: Any, n_layers: int, name: str = "layers", *, allow_none: bool = True,
              allow_empty: bool = False) -> list[int]:
    """A layer selection (an int, a sequence of ints, None for all layers when ``allow_none``) as the sorted,
    distinct valid indices; other types are refused naming ``name``, indices out of range raise LayerIndexError."""
    if value is None:
        if allow_none:
            return list(range(n_layers))
        raise ArgumentTypeError(f"{name} must be an int or a sequence of ints, got None")
    if _is_int(value):
        return [as_layer(value, n_layers, name)]
    if isinstance(value, (bool, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0):
        raise ArgumentTypeError(f"{name} must be an int or a sequence of ints, got {value!r} "
                                f"({type(value).__name__})")
    items = as_int_list(value, name)
    out = sorted({as_layer(v, n_layers, f"{name}[{i}] = layer") for i, v in enumerate(items)})
    if not out and not allow_empty:
        raise InputError(f"empty {name} selection: pass None for all layers or a non-empty list")
    return out


def as_positions(value: Any, name: str = "exclude_positions") -> tuple[int, ...]:
    """A set of position indices (ints; negative count from the end), sorted and de-duplicated."""
    if _is_int(value):
        return (int(value),)
    return tuple(sorted(set(as_int_list(value, name))))


def check_length(n_pos: int, n_ctx: int | None, what: str = "tokens") -> None:
    """Refuse sequences of 0 positions (an empty prompt) or longer than the model's context (a bare IndexError or
    reshape error deep in the model otherwise)."""
    if n_pos == 0:
        raise InputError(f"{what} has sequences of 0 positions (an empty prompt): nothing to run; give at least one "
                         "token: tokenize non-empty text, or start the prompt with the BOS token "
                         "(model.to_tokens(text, prepend_bos=True))")
    if n_ctx and n_pos > n_ctx:
        raise InputError(f"{what} has sequences of length {n_pos}, longer than the model's context n_ctx="
                         f"{n_ctx}; cut them to at most {n_ctx} positions (e.g. tokens[:, :{n_ctx}])")


_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "meta")


def check_not_meta(tokens: Any, what: str = "tokens") -> None:
    """Refuse a tensor on the ``meta`` device (shapes, no values: built under ``torch.device("meta")`` or
    accelerate's ``init_empty_weights``); a forward on it fails deep inside the model with a bare RuntimeError."""
    if isinstance(tokens, torch.Tensor) and tokens.device.type == "meta":
        raise DeviceMismatchError(
            f"{what} are on the 'meta' device: a meta tensor has a shape but no values, so no model can run on it. "
            f"Build them on a real device (torch.tensor(ids) or model.to_tokens(text), then .to(the model's "
            "device)); a tensor created under `with torch.device('meta')` or accelerate's init_empty_weights() is "
            "meta")


def as_device(value: Any, name: str = "device") -> torch.device:
    """A device that exists here: ``None`` -> cpu; unknown strings (``"tpu"``, ``"bogus"``) and devices this
    machine does not have (``"cuda"`` without a GPU, ``"cuda:3"`` with one GPU) are errors, raised before any
    model is loaded."""
    if value is None:
        return torch.device("cpu")
    if not isinstance(value, (str, torch.device)):
        raise ArgumentTypeError(f"{name} must be a string like 'cpu' or 'cuda:0' or a torch.device, got "
                                f"{value!r} ({type(value).__name__})")
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        raise InputError(f"{name}={str(value)!r} is not a device; use one of {_DEVICE_TYPES} "
                         "(with an index for GPUs, e.g. 'cuda:0')") from None
    if dev.type not in _DEVICE_TYPES:
        raise InputError(f"{name}={str(value)!r}: device type {dev.type!r} is not supported; use one of "
                         f"{_DEVICE_TYPES}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"{name}={str(value)!r} was asked for but CUDA is not available here "
                f"(torch {torch.__version__}, torch.cuda.is_available() is False); use device='cpu'")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise DeviceUnavailableError(f"{name}={str(value)!r}: this machine has {n} CUDA device(s) "
                                         f"(cuda:0..cuda:{n - 1})")
    elif dev.type in ("mps", "xpu"):
        backend = getattr(torch.backends, "mps", None) if dev.type == "mps" else getattr(torch, "xpu", None)
        if not (backend and backend.is_available()):
            raise DeviceUnavailableError(f"{name}={str(value)!r}: {dev.type.upper()} is not available here; use "
                                         "device='cpu'")
    return dev


def same_device(actual: torch.device, wanted: torch.device) -> bool:
    """Whether a parameter on ``actual`` satisfies a request for ``wanted`` (``cuda`` matches ``cuda:0``...)."""
    actual, wanted = torch.device(actual), torch.device(wanted)
    return actual.type == wanted.type and (None in (wanted.index, actual.index) or actual.index == wanted.index)


def _site_of(param_name: str) -> str:
    n = param_name.lower()
    for key, site in (("attn", "attention"), ("mlp", "FFN"), ("ln1", "norm before attention"),
                      ("ln2", "norm before the FFN"), ("norm", "norm")):
        if key in n:
            return site
    return "block"


def all_finite(x: torch.Tensor) -> bool:
    """Whether every entry of ``x`` is finite (a NaN or Inf makes the sum non-finite: one fast reduction decides)."""
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def check_weights_finite(model: torch.nn.Module, layers: Sequence[int] | None = None, where: str = "") -> None:
    """Raise :class:`~tl_steering.errors.NonFiniteError` naming the layer, the site (attention, FFN, norm) and
    the parameter when a weight of the chosen blocks (all when ``layers`` is None) holds NaN or Inf."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return
    idx = range(len(blocks)) if layers is None else layers
    for layer in idx:
        for pname, p in blocks[layer].named_parameters():
            if p.device.type == "meta":  # offloaded by accelerate: loaded (and used) only inside the forward
                continue
            if p.is_floating_point() and not all_finite(p):
                n_nan = int(torch.isnan(p).sum())
                n_inf = int(torch.isinf(p).sum())
                at = f"{where}: " if where else ""
                raise NonFiniteError(
                    f"{at}non-finite weights at layer {layer}, {_site_of(pname)} (blocks.{layer}.{pname}: "
                    f"{n_nan} NaN and {n_inf} Inf values); the model's weights are broken there (a failed "
                    "load or an in-place edit), not the input")


__all__ = [
    "all_finite", "as_bool", "as_choice", "as_choices", "as_device", "as_float", "as_int", "as_int_list", "as_layer",
    "as_layers", "as_positions", "check_length", "check_weights_finite", "same_device"]
