"""Result objects: typed dataclasses with provenance, ``to_dict()``, ``save()`` / ``load()`` (JSON or
safetensors, never pickle) and ``.plot()`` returning plotly figures.

Every protocol returns a subclass of :class:`Result`. Tensor fields are stored as they are (CPU, their own
dtype); ``to_dict()`` turns them into nested lists tagged with dtype and shape so that ``from_dict`` restores
them exactly. Complex tensors are stored as ``[..., 2]`` real views.
"""

import dataclasses
import datetime as _dt
import json
import math
import platform
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from .errors import InputError

_REGISTRY: dict[str, type] = {}

T = TypeVar("T", bound="Result")


def register(cls: type) -> type:
    """Register a dataclass so that ``from_dict`` can rebuild it by name (no pickle, no import by string)."""
    _REGISTRY[cls.__name__] = cls
    return cls


@register
@dataclasses.dataclass
class Provenance:
    """Where a number came from: enough to reproduce it.

    Attributes:
        model: model name as loaded (e.g. ``"smollm2-135m"``) or the class/config label for a tiny model.
        model_revision: pinned package version or weight hash of the checkpoint, when known.
        tl_version: TransformerLens version string.
        backend: ``"hooked"`` (HookedTransformer) or ``"bridge"`` (TransformerBridge).
        processing: ``"raw"`` (Hugging Face geometry) or ``"tl"`` (folded/centred weights).
        corpus: text source label (e.g. ``"pydoc:8x128:seed0"``).
        n_sequences: number of token windows.
        n_tokens: number of tokens fed to the model.
        seed: RNG seed used by the protocol, if any.
        dtype: model parameter dtype.
        device: model device.
        world_size: number of processes whose tokens the numbers aggregate (torch.distributed; 1 alone).
        package_version: tl_steering version.
        created: UTC timestamp.
        extra: protocol options (layers, exclude_positions, variants, ...).
    """

    model: str = "unknown"
    model_revision: str | None = None
    tl_version: str = "unknown"
    backend: str = "unknown"
    processing: str = "unknown"
    corpus: str = "unknown"
    n_sequences: int = 0
    n_tokens: int = 0
    seed: int | None = None
    dtype: str = "unknown"
    device: str = "unknown"
    world_size: int = 1
    package_version: str = ""
    torch_version: str = dataclasses.field(default_factory=lambda: torch.__version__)
    python_version: str = dataclasses.field(default_factory=platform.python_version)
    created: str = dataclasses.field(
        default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    )
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.package_version:
            from . import __version__

            self.package_version = __version__


# ----------------------------------------------------------------------------------------------------------
# encoding


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        is_complex = t.is_complex()
        if is_complex:
            t = torch.view_as_real(t.resolve_conj())
        dtype = str(t.dtype).removeprefix("torch.")
        if t.dtype == torch.bfloat16:
            t = t.float()
        data = t.tolist()
        return {"__tensor__": True, "dtype": dtype, "complex": is_complex, "shape": list(value.shape),
                "data": _encode_floats(data)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        out["__dataclass__"] = type(value).__name__
        return out
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, float):
        return _encode_floats(value)
    if isinstance(value, complex):
        return {"__complex__": [value.real, value.imag]}
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if hasattr(value, "item"):  # numpy scalars
        return _encode(value.item())
    raise InputError(f"cannot serialise a value of type {type(value).__name__}; results hold tensors, numbers,"
                     " strings, lists and dicts only")


def _encode_floats(x: Any) -> Any:
    """JSON has no NaN/Inf: write them as strings that ``_decode_floats`` reads back."""
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "Infinity" if x > 0 else "-Infinity"
        return x
    if isinstance(x, list):
        return [_encode_floats(v) for v in x]
    return x


_SPECIAL = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _decode_floats(x: Any) -> Any:
    if isinstance(x, str) and x in _SPECIAL:
        return _SPECIAL[x]
    if isinstance(x, list):
        return [_decode_floats(v) for v in x]
    return x


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if value.get("__tensor__"):
            dtype = getattr(torch, value["dtype"])
            data = _decode_floats(value["data"])
            build_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
            t = torch.tensor(data, dtype=build_dtype)
            if value.get("complex"):
                shape = list(value["shape"]) + [2]
                t = torch.view_as_complex(t.reshape(shape).contiguous())
            else:
                t = t.reshape(value["shape"]).to(dtype)
            return t
        if "__complex__" in value:
            re, im = value["__complex__"]
            return complex(re, im)
        if "__dataclass__" in value:
            name = value["__dataclass__"]
            cls = _REGISTRY.get(name)
            if cls is None:
                raise InputError(f"unknown result type {name!r} in file; was it saved by a newer tl_steering?")
            kwargs = {k: _decode(v) for k, v in value.items() if k != "__dataclass__"}
            names = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in kwargs.items() if k in names})
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, str) and value in _SPECIAL:
        return _SPECIAL[value]
    return value


# ----------------------------------------------------------------------------------------------------------
# base class


@dataclasses.dataclass
class Result:
    """Base of every tl_steering result.

    Subclasses are dataclasses (decorate them with ``@register`` and ``@dataclasses.dataclass``) whose fields
    are tensors, numbers, strings, lists/dicts of those, nested registered dataclasses, and a ``provenance``.
    """

    provenance: Provenance = dataclasses.field(default_factory=Provenance)

    kind: ClassVar[str] = "result"

    # -- serialisation ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, tensors as ``{"__tensor__", dtype, shape, data}`` records; JSON-serialisable."""
        return _encode(self)

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        obj = _decode(data)
        if not isinstance(obj, cls):
            raise InputError(f"the data holds a {type(obj).__name__}, not a {cls.__name__}")
        return obj

    def save(self, path: str | Path) -> Path:
        """Save as JSON (``*.json``) or safetensors (``*.safetensors``: tensors in the file, the rest in its
        metadata). Never pickle."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            tensors: dict[str, torch.Tensor] = {}
            meta = self._split_tensors(self.to_dict(), tensors, prefix="")
            save_file(tensors, str(path), metadata={"tl_steering": json.dumps(meta)})
        else:
            path.write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False))
        return path

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        path = Path(path)
        if not path.exists():
            raise InputError(f"no result file at {path}")
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                meta = json.loads(f.metadata()["tl_steering"])
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            data = cls._join_tensors(meta, tensors)
            return cls.from_dict(data)
        return cls.from_dict(json.loads(path.read_text()))

    @staticmethod
    def _split_tensors(node: Any, out: dict[str, torch.Tensor], prefix: str) -> Any:
        if isinstance(node, dict):
            if node.get("__tensor__"):
                t = _decode(node)
                if t.is_complex():
                    t = torch.view_as_real(t)
                out[prefix] = t.contiguous()
                return {"__tensor_ref__": prefix, "complex": node["complex"], "dtype": node["dtype"]}
            return {k: Result._split_tensors(v, out, f"{prefix}.{k}" if prefix else k) for k, v in node.items()}
        if isinstance(node, list):
            return [Result._split_tensors(v, out, f"{prefix}.{i}") for i, v in enumerate(node)]
        return node

    @staticmethod
    def _join_tensors(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
        if isinstance(node, dict):
            if "__tensor_ref__" in node:
                t = tensors[node["__tensor_ref__"]]
                if node.get("complex"):
                    t = torch.view_as_complex(t.contiguous())
                return _encode(t)
            return {k: Result._join_tensors(v, tensors) for k, v in node.items()}
        if isinstance(node, list):
            return [Result._join_tensors(v, tensors) for v in node]
        return node

    # -- display ----------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Headline scalars of the result (subclasses override)."""
        return {}

    def plot(self):  # pragma: no cover - overridden
        raise NotImplementedError(f"{type(self).__name__} has no plot")


register(Result)

__all__ = ["Provenance", "Result", "register"]
