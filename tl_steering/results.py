"""Result objects: typed dataclasses with provenance, ``to_dict()``, ``save()`` / ``load()`` (``NAME.json`` with
``NAME.safetensors``, never pickle) and ``.plot()`` returning plotly figures (docs/protocols.md, "Saving and loading
results")."""

import contextlib
import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import threading
import typing
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import jaxtyping
import torch
from beartype import BeartypeConf
from beartype.door import is_bearable

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


def register(cls: type) -> type:
    """Register a dataclass under its ``kind`` and ``format_version`` (default 1) so that files of it load; its
    ``added_fields`` (fields added after its first files, each with a default) may be missing from a file
    (docs/protocols.md, "Saving and loading results"). Two classes may not share a kind (the same class again,
    e.g. on a module reload, replaces itself)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"register expects a dataclass, got {cls!r}")
    key = kind_of(cls)
    old = _REGISTRY.get(key)
    if old is not None and old is not cls and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise TypeError(f"result kind {key!r} is already registered by {old.__module__}.{old.__qualname__}; "
                        f"give {cls.__module__}.{cls.__qualname__} its own `kind = \"...\"`")
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    for name in getattr(cls, "added_fields", ()):
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
    """Where a number came from: enough to reproduce it (its fields: docs/protocols.md, "Conventions shared by
    every protocol")."""

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
        default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
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


def _encode(value: Any, tensors: dict[str, torch.Tensor] | None = None, at: str = "") -> Any:
    """``value`` as a JSON tree. A tensor goes into ``tensors`` under its place ``at`` in the tree, which keeps a
    reference to it, or, without ``tensors``, inline as nested lists (``to_dict``)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().resolve_conj().resolve_neg()
        is_complex = t.is_complex()
        if is_complex:
            t = torch.view_as_real(t)
        head = {"dtype": str(t.dtype).removeprefix("torch."), "complex": is_complex, "shape": list(value.shape)}
        if tensors is not None:
            name = at if at not in tensors else f"{at}#{len(tensors)}"
            tensors[name] = t.clone(memory_format=torch.contiguous_format)  # safetensors refuses shared storage
            return {"__tensor_ref__": name, **head}
        data = (t.float() if t.dtype == torch.bfloat16 else t).tolist()
        return {"__tensor__": True, **head, "data": _encode_floats(data)}
    here = (lambda k: f"{at}.{k}" if at else str(k))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        if _REGISTRY.get(kind_of(cls)) is not cls:
            raise InputError(f"cannot serialise {cls.__name__}: decorate it with @tl_steering.results.register")
        out = {f.name: _encode(getattr(value, f.name), tensors, here(f.name)) for f in dataclasses.fields(value)}
        return {**out, "__kind__": kind_of(cls), "__format__": getattr(cls, "format_version", 1)}
    if isinstance(value, dict):
        return {str(k): _encode(v, tensors, here(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v, tensors, here(i)) for i, v in enumerate(value)]
    if isinstance(value, float):
        return _encode_floats(value)
    if isinstance(value, complex):
        return {"__complex__": [_encode_floats(value.real), _encode_floats(value.imag)]}
    if isinstance(value, str) and value in _SPECIAL:  # a string that reads like a non-finite float keeps its type
        return {"__str__": value}
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if hasattr(value, "item"):  # numpy scalars
        return _encode(value.item())
    raise InputError(f"cannot serialise a value of type {type(value).__name__}; results hold tensors, numbers,"
                     " strings, lists and dicts only")


def _encode_floats(x: Any) -> Any:
    """JSON has no NaN/Inf: write them as strings that ``_decode`` reads back."""
    if isinstance(x, list):
        return [_encode_floats(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else "Infinity" if x > 0 else "-Infinity"
    return x


_SPECIAL = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _decode(value: Any, tensors: dict[str, torch.Tensor], where: str = "") -> Any:
    """Rebuild tensors (inline, or by reference from ``tensors``) and registered dataclasses; strict: unknown kinds,
    missing, unknown or wrong-typed fields raise :class:`ResultFileError` naming the field (``where`` is the path of
    the value inside the file)."""
    if isinstance(value, dict):
        if value.get("__tensor__"):
            return _decode_tensor(value, where)
        if "__tensor_ref__" in value:
            if (t := tensors.get(value["__tensor_ref__"])) is None:
                raise ResultFileError(f"{where}: tensor {value['__tensor_ref__']!r} is not in the tensors file")
            return torch.view_as_complex(t.contiguous()) if value.get("complex") else t
        if "__complex__" in value:
            re, im = (_decode(v, tensors) for v in value["__complex__"])
            return complex(re, im)
        if "__kind__" in value:
            return _decode_record(value, tensors, where)
        if set(value) == {"__str__"}:
            return value["__str__"]
        return {k: _decode(v, tensors, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str) and value in _SPECIAL:
        return _SPECIAL[value]
    return value


def _decode_tensor(value: dict, where: str) -> torch.Tensor:
    try:
        dtype = getattr(torch, value["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{value['dtype']!r} is not a torch dtype")
        data = _decode(value["data"], {})
        t = torch.tensor(data, dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
        if value.get("complex"):
            return torch.view_as_complex(t.reshape([*value["shape"], 2]).contiguous())
        return t.reshape(value["shape"]).to(dtype)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise ResultFileError(f"{where or 'tensor'}: malformed tensor record ({type(e).__name__}: {e})") from None


def import_result_modules() -> None:
    """Import every module of the package, registering every result kind (``import tl_steering`` is lazy); modules
    whose optional dependencies are missing are passed over."""
    import importlib
    import pkgutil

    for m in pkgutil.walk_packages(importlib.import_module(__package__).__path__, f"{__package__}."):
        if not m.name.endswith(".__main__"):
            with contextlib.suppress(ImportError):
                importlib.import_module(m.name)


def _decode_record(value: dict, tensors: dict[str, torch.Tensor], where: str) -> Any:
    kind = value["__kind__"]
    if isinstance(kind, str) and kind not in _REGISTRY:
        import_result_modules()
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ResultFileError(f"{where or 'file'}: unknown result kind {kind!r}; known kinds: "
                              f"{sorted(_REGISTRY)} (saved by another tl_steering version?)")
    version = value.get("__format__", 1)
    have = getattr(cls, "format_version", 1)
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
    missing = sorted(set(fields) - set(data) - set(getattr(cls, "added_fields", ())))
    if missing:
        raise ResultFileError(f"{label}: missing field(s) {missing} for {kind!r}; the file is incomplete")
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - unresolvable annotations: check nothing rather than fail to load
        hints = {}
    kwargs, late = {}, {}
    for name, raw in data.items():
        v = _decode(raw, tensors, f"{label}.{name}")
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


def to_bytes(value: Any) -> bytes:
    """``value`` (anything a result may hold: results, registered records, tensors, numbers, strings, lists,
    dicts) as bytes: the length of its JSON tree, the tree, then one safetensors blob of its tensors. What
    :func:`tl_steering.data.sharding.send_object` sends between ranks (no pickle: only known kinds decode)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    tree = json.dumps(_encode(value, tensors)).encode()
    return len(tree).to_bytes(8, "little") + tree + save(tensors)


def from_bytes(data: bytes) -> Any:
    """The value :func:`to_bytes` wrote, tensors bit for bit."""
    from safetensors.torch import load

    n = int.from_bytes(data[:8], "little")
    return _decode(json.loads(data[8:8 + n]), load(data[8 + n:]))


def _write(path: Path, data: bytes) -> None:
    """Write to a temporary name beside ``path``, then rename: a killed write leaves no half file under ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _json(text: str | bytes, what: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultFileError(f"{what}not valid JSON ({e}): the file is truncated or corrupted; save the result "
                              "again") from None


def _read(path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """The JSON tree of the result named by ``path`` (its JSON or its tensors file) and its tensors; files of
    earlier versions too (docs/protocols.md, "Saving and loading results")."""
    from safetensors import safe_open
    from safetensors.torch import load

    js = path
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                whole = {k: f.get_tensor(k) for k in f.keys()} if "tl_steering" in meta else None
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError / OSError
            raise ResultFileError(f"not a readable safetensors file ({type(e).__name__}: {e}); the file is truncated"
                                  " or corrupted") from None
        if whole is not None:  # the whole-file format of earlier versions
            return _json(meta["tl_steering"], "its metadata: "), whole
        if "tl_steering_result" not in meta:
            raise ResultFileError("a safetensors file without tl_steering metadata (not saved by Result.save)")
        js = path.with_suffix(".json")
        if not js.exists():
            raise ResultFileError(f"it holds the tensors of a result whose fields are in {js.name}, which is not "
                                  "beside it: copy NAME.json with NAME.safetensors")
    try:
        tree = _json(js.read_bytes(), "" if js == path else f"{js.name}: ")
    except OSError as e:
        raise ResultFileError(f"cannot read {js.name} ({type(e).__name__}: {e})") from None
    ref = tree.pop("__sidecar__", None) if isinstance(tree, dict) else None
    if ref is None:
        return tree, {}
    # the tensors file: NAME.safetensors, else (earlier versions, a renamed pair) NAME.tensors.safetensors or the
    # name recorded; the first whose SHA-256 is the one recorded (another is the file of another save)
    name, digest = (ref.get("file"), ref.get("sha256")) if isinstance(ref, dict) else (None, None)
    if not isinstance(name, str) or Path(name).name != name or not isinstance(digest, str):
        raise ResultFileError(f"malformed __sidecar__ record {ref!r}")
    names = (js.with_suffix(".safetensors"), js.with_name(js.stem + ".tensors.safetensors"), js.parent / name)
    found = [p for p in dict.fromkeys(names) if p.exists()]
    if not found:
        raise ResultFileError(f"its tensors file {name!r} is not beside it: copy NAME.safetensors with NAME.json")
    for p in found:
        blob = p.read_bytes()
        if hashlib.sha256(blob).hexdigest() == digest:
            try:
                return tree, load(blob)
            except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError
                raise ResultFileError(f"{p.name}: not a readable safetensors file ({e})") from None
    raise ResultFileError(f"{found[0].name} is not the tensors file saved with {js.name} (SHA-256 differs): a "
                          "later or interrupted save wrote it; save the result again")


@dataclasses.dataclass
class Result:
    """Base of every tl_steering result: a ``@register``-ed dataclass whose fields are tensors, numbers, strings,
    lists/dicts of those, nested registered dataclasses, and a ``provenance``."""

    provenance: Provenance = dataclasses.field(default_factory=Provenance)

    kind: ClassVar[str] = "result"
    format_version: ClassVar[int] = 1

    # -- serialisation ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, tensors inline as ``{"__tensor__", dtype, complex, shape, data}`` records; strict JSON."""
        return _encode(self)

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        """Rebuild a result from :meth:`to_dict` output. Strict: an unknown kind or format version, a missing,
        unknown or wrong-typed field raises :class:`~tl_steering.errors.ResultFileError` naming it."""
        return cls._build(data, {})

    @classmethod
    def _build(cls: type[T], data: Any, tensors: dict[str, torch.Tensor]) -> T:
        if not isinstance(data, dict) or "__kind__" not in data:
            raise ResultFileError(f"not a tl_steering result record (expected a dict with '__kind__', got "
                                  f"{type(data).__name__})")
        obj = _decode(data, tensors)
        if not isinstance(obj, cls):
            raise ResultFileError(f"the data holds a {type(obj).__name__} ({kind_of(type(obj))!r}), "
                                  f"not a {cls.__name__}")
        return obj

    def save(self, path: str | Path) -> Path:
        """Save as ``NAME.json`` and ``NAME.safetensors``, ``path`` naming either (docs/protocols.md, "Saving and
        loading results"); returns ``path``."""
        from safetensors.torch import save

        if Path(path).suffix not in (".json", ".safetensors"):
            raise InputError(f"a result is saved as NAME.json (its fields) with NAME.safetensors (its tensors): give "
                             f"a path ending in .json or .safetensors, got {str(path)!r}")
        js, st, tensors = Path(path).with_suffix(".json"), Path(path).with_suffix(".safetensors"), {}
        tree = _encode(self, tensors)
        blob = save(tensors, metadata={"tl_steering_result": js.name})
        tree["__sidecar__"] = {"file": st.name, "sha256": hashlib.sha256(blob).hexdigest()}
        js.parent.mkdir(parents=True, exist_ok=True)
        _write(st, blob)
        _write(js, json.dumps(tree, indent=1, allow_nan=False).encode())
        return Path(path)

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        """Load a result saved by :meth:`save` (``path``: either file; files of earlier versions too); every failure
        raises :class:`~tl_steering.errors.ResultFileError` naming the file and the field."""
        path = Path(path)
        if not path.exists():
            raise ResultFileError(f"no result file at {path}")
        try:
            return cls._build(*_read(path))
        except ResultFileError as e:
            raise ResultFileError(f"{path}: {e}") from None

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
