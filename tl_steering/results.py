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
import typing
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import jaxtyping
import torch
from beartype import BeartypeConf
from beartype.door import is_bearable

from . import result_sidecar
from ._util.display import short_value, wrap_items
from .errors import InputError, ResultFileError

# kind -> class. A file names its record by kind and format version ("__kind__", "__format__"), never by a
# Python path: no import by string, no pickle.
_REGISTRY: dict[str, type] = {}

T = TypeVar("T", bound="Result")


def kind_of(cls: type) -> str:
    """The registry key of a class: its own ``kind`` class attribute, else its class name."""
    own = cls.__dict__.get("kind")
    return own if isinstance(own, str) and own else cls.__name__


def format_version_of(cls: type) -> int:
    v = getattr(cls, "format_version", 1)
    return v if isinstance(v, int) and not isinstance(v, bool) else 1


def added_fields_of(cls: type) -> tuple[str, ...]:
    """Fields a class gained after files of its format version were written (``added_fields``, a class
    attribute): a file without one of them loads with the field's default. Every other field must be in the file
    (a missing one means the file is incomplete). Each listed field needs a default (checked by ``register``)."""
    v = getattr(cls, "added_fields", ())
    return tuple(v) if isinstance(v, (tuple, list)) else ()


def register(cls: type) -> type:
    """Register a dataclass under its explicit ``kind`` (a class attribute; the class name when it has none)
    and ``format_version`` (default 1), so that ``from_dict`` can rebuild it. Two different classes may not
    share a kind: a duplicate raises (re-registering the same class, e.g. on a module reload, replaces it)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"register expects a dataclass, got {cls!r}")
    key = kind_of(cls)
    old = _REGISTRY.get(key)
    if old is not None and old is not cls and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise TypeError(f"result kind {key!r} is already registered by {old.__module__}.{old.__qualname__}; "
                        f"give {cls.__module__}.{cls.__qualname__} its own `kind = \"...\"`")
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    for name in added_fields_of(cls):
        f = by_name.get(name)
        if f is None or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING):
            raise TypeError(f"{cls.__qualname__}.added_fields names {name!r}, which is not a field with a default")
    _REGISTRY[key] = cls
    own = cls.__dict__.get("__repr__")
    code = getattr(getattr(own, "__wrapped__", own), "__code__", None)
    if "Result" in globals() and issubclass(cls, Result) and code is not None and code.co_filename == "<string>":
        cls.__repr__ = Result.__repr__  # the dataclass's field dump (tensor contents) gives way to the short form
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
        processing: ``"raw"`` (Hugging Face geometry) or ``"tl"`` (processed by TransformerLens), read from the
            model; ``processing_steps``: which steps (docs/loading.md, "Weight processing").
        user_hooks: hook points that carried hooks not made by tl_steering during the call (docs/hooks.md).
        interventions: the tl_steering hook factories whose hooks were on the model during the call (e.g.
            ``"ffn_component(keep='tangential', layers=all)"``; docs/hooks.md).
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

    kind: ClassVar[str] = "provenance"
    added_fields: ClassVar[tuple[str, ...]] = ("world_size", "processing_steps", "user_hooks", "interventions")

    model: str = "unknown"
    model_revision: str | None = None
    tl_version: str = "unknown"
    backend: str = "unknown"
    processing: str = "unknown"
    processing_steps: list[str] = dataclasses.field(default_factory=list)
    user_hooks: list[str] = dataclasses.field(default_factory=list)
    interventions: list[str] = dataclasses.field(default_factory=list)
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
            from ._util import __version__

            self.package_version = __version__


def tensor_field(*shape: int, dtype: torch.dtype = torch.float64) -> Any:
    """A dataclass field whose default is a new tensor of ``shape`` and ``dtype`` (float64 by default), NaN-filled
    when floating (not measured), else zero."""
    fill = math.nan if dtype.is_floating_point else 0
    return dataclasses.field(default_factory=lambda: torch.full(shape, fill, dtype=dtype))


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
        cls = type(value)
        if _REGISTRY.get(kind_of(cls)) is not cls:
            raise InputError(f"cannot serialise {cls.__name__}: decorate it with @tl_steering.results.register")
        out = {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        out["__kind__"] = kind_of(cls)
        out["__format__"] = format_version_of(cls)
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


def _decode(value: Any, where: str = "") -> Any:
    """Rebuild tensors and registered dataclasses; strict: unknown kinds, missing, unknown or wrong-typed fields
    raise :class:`ResultFileError` naming the field (``where`` is the path of the value inside the file)."""
    if isinstance(value, dict):
        if value.get("__tensor__"):
            return _decode_tensor(value, where)
        if "__complex__" in value:
            re, im = value["__complex__"]
            return complex(re, im)
        if "__kind__" in value:
            return _decode_record(value, where)
        return {k: _decode(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str) and value in _SPECIAL:
        return _SPECIAL[value]
    return value


def _decode_tensor(value: dict, where: str) -> torch.Tensor:
    try:
        dtype = getattr(torch, value["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{value['dtype']!r} is not a torch dtype")
        data = _decode_floats(value["data"])
        build_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
        t = torch.tensor(data, dtype=build_dtype)
        if value.get("complex"):
            shape = list(value["shape"]) + [2]
            return torch.view_as_complex(t.reshape(shape).contiguous())
        return t.reshape(value["shape"]).to(dtype)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise ResultFileError(f"{where or 'tensor'}: malformed tensor record ({type(e).__name__}: {e})") from None


# Modules that define registered results. ``import tl_steering`` is lazy (it imports no protocol), so a file may
# name a kind whose module has not been imported yet: it is imported on first need.
RESULT_MODULES = ("tl_steering.critical.census", "tl_steering.critical.results", "tl_steering.parallel.defect_result", "tl_steering.parallel.plan_result",
                  "tl_steering.parallel.scores", "tl_steering.probing.result", "tl_steering.protocols.ablation",
                  "tl_steering.protocols.deficit", "tl_steering.protocols.diversity", "tl_steering.protocols.gates",
                  "tl_steering.protocols.prefix", "tl_steering.suite.result", "tl_steering.suite.settings")


def _import_result_modules() -> None:
    import importlib

    for name in RESULT_MODULES:
        importlib.import_module(name)


def _decode_record(value: dict, where: str) -> Any:
    kind = value["__kind__"]
    if isinstance(kind, str) and kind not in _REGISTRY:
        _import_result_modules()
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ResultFileError(f"{where or 'file'}: unknown result kind {kind!r}; known kinds: "
                              f"{sorted(_REGISTRY)} (saved by another tl_steering version?)")
    version = value.get("__format__", 1)
    have = format_version_of(cls)
    if version != have:
        newer = isinstance(version, int) and version > have
        raise ResultFileError(
            f"{where or 'file'}: {kind!r} record has format version {version!r}; this tl_steering reads version "
            f"{have}" + (" (the file was written by a newer tl_steering: upgrade)" if newer else ""))
    label = where or kind
    data = {k: v for k, v in value.items() if k not in ("__kind__", "__format__")}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ResultFileError(f"{label}: unknown field(s) {unknown} for {kind!r} (fields: {sorted(fields)})")
    missing = sorted(set(fields) - set(data) - set(added_fields_of(cls)))
    if missing:
        raise ResultFileError(f"{label}: missing field(s) {missing} for {kind!r}; the file is incomplete")
    hints = _type_hints(cls)
    kwargs, late = {}, {}
    for name, raw in data.items():
        v = _decode(raw, f"{label}.{name}")
        tp = hints.get(name)
        if tp is not None and not _has_type(v, tp):
            raise ResultFileError(f"{label}.{name}: expected {_type_name(tp)}, got {_value_desc(v)}")
        (kwargs if fields[name].init else late)[name] = v
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ResultFileError(f"{label}: the fields do not make a valid {kind!r} ({e})") from None
    for name, v in late.items():
        object.__setattr__(obj, name, v)
    return obj


def _type_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - unresolvable annotations: check nothing rather than fail to load
        return {}


# a decoded value against its field's annotation, by beartype (jaxtyping's tensor annotations are classes it
# checks with isinstance); the PEP 484 tower lets an int stand for a float (JSON writes 2.0 as 2 only if it was 2)
_TOWER = BeartypeConf(is_pep484_tower=True)


def _has_type(v: Any, tp: Any) -> bool:
    try:
        return is_bearable(v, tp, conf=_TOWER)
    except Exception:  # noqa: BLE001 - an annotation beartype cannot check: check nothing rather than fail to load
        return True


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, jaxtyping.AbstractArray):
        return f"a tensor {tp.__name__}"
    return str(tp).replace("typing.", "").replace("torch.Tensor", "Tensor") if typing.get_origin(tp) else tp.__name__


def _value_desc(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {str(v.dtype).removeprefix('torch.')} tensor of shape {tuple(v.shape)}"
    r = repr(v)
    return f"{type(v).__name__} {r[:60]}{'...' if len(r) > 60 else ''}"


def _sidecar_fields(kind: str) -> tuple[str, ...]:
    return tuple(getattr(_REGISTRY.get(kind), "sidecar_fields", ()))


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
    format_version: ClassVar[int] = 1

    # -- serialisation ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, tensors as ``{"__tensor__", dtype, shape, data}`` records; JSON-serialisable."""
        return _encode(self)

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        """Rebuild a result from :meth:`to_dict` output. Strict: an unknown kind or format version, a missing,
        unknown or wrong-typed field raises :class:`~tl_steering.errors.ResultFileError` naming it."""
        if not isinstance(data, dict) or "__kind__" not in data:
            raise ResultFileError(f"not a tl_steering result record (expected a dict with '__kind__', got "
                                  f"{type(data).__name__})")
        obj = _decode(data)
        if not isinstance(obj, cls):
            raise ResultFileError(f"the data holds a {type(obj).__name__} ({kind_of(type(obj))!r}), "
                                  f"not a {cls.__name__}")
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
        else:  # the classes' sidecar_fields go to <stem>.tensors.safetensors (tl_steering.result_sidecar)
            data = result_sidecar.save(self.to_dict(), path, _sidecar_fields, _decode)
            path.write_text(json.dumps(data, indent=1, allow_nan=False))
        return path

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        """Load a result saved by :meth:`save`. Every failure (truncated or corrupted file, unknown kind,
        missing / unknown / wrong-typed field) raises :class:`~tl_steering.errors.ResultFileError` naming the
        file and the field."""
        path = Path(path)
        if not path.exists():
            raise ResultFileError(f"no result file at {path}")
        try:
            if path.suffix == ".safetensors":
                data = cls._read_safetensors(path)
            else:
                try:
                    data = json.loads(path.read_text())
                except json.JSONDecodeError as e:
                    raise ResultFileError(f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): the "
                                          "file is truncated or corrupted; save the result again") from None
                except (OSError, UnicodeDecodeError) as e:
                    raise ResultFileError(f"cannot read it ({type(e).__name__}: {e})") from None
                data = result_sidecar.load(data, path, cls._join_tensors)
            return cls.from_dict(data)
        except ResultFileError as e:
            raise ResultFileError(f"{path}: {e}") from None

    @classmethod
    def _read_safetensors(cls, path: Path) -> Any:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta_text = (f.metadata() or {}).get("tl_steering")
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError / OSError
            raise ResultFileError(f"not a readable safetensors file ({type(e).__name__}: {e}); the file is "
                                  "truncated or corrupted") from None
        if meta_text is None:
            raise ResultFileError("a safetensors file without tl_steering metadata (not saved by Result.save)")
        try:
            meta = json.loads(meta_text)
        except json.JSONDecodeError as e:
            raise ResultFileError(f"corrupted tl_steering metadata ({e.msg})") from None
        try:
            return cls._join_tensors(meta, tensors)
        except KeyError as e:
            raise ResultFileError(f"tensor {e} named in the metadata is missing from the file") from None

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
                return t  # the stored bytes as they are (_decode keeps a tensor)
            return {k: Result._join_tensors(v, tensors) for k, v in node.items()}
        if isinstance(node, list):
            return [Result._join_tensors(v, tensors) for v in node]
        return node

    # -- display ----------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        """A few lines: kind, model and corpus, the headline numbers of :meth:`summary`, tensor shapes (never
        tensor contents)."""
        p = self.provenance
        head = f"{type(self).__name__}({p.model}, {p.backend}/{p.processing}, {p.corpus}, seed={p.seed})"
        try:
            summ = self.summary()
        except Exception as e:  # noqa: BLE001 - a repr must not raise
            summ = {"summary": f"unavailable ({type(e).__name__})"}
        lines = [head] + wrap_items(f"{k}={short_value(v)}" for k, v in summ.items())
        shapes = [f"{f.name}{list(v.shape)}" for f in dataclasses.fields(self)
                  if isinstance(v := getattr(self, f.name), torch.Tensor)]
        if shapes:
            lines += wrap_items(shapes, prefix="tensors: ", max_lines=2)
        return "\n  ".join(lines)

    def summary(self) -> dict[str, Any]:
        """Headline scalars of the result (subclasses override)."""
        return {}

    def plot(self):  # pragma: no cover - overridden
        raise NotImplementedError(f"{type(self).__name__} has no plot")


register(Result)

__all__ = ["Provenance", "Result", "register", "tensor_field"]
