"""Large tensors of a JSON result in a safetensors file beside it (``Result.save("x.json")``; docs/protocols.md):
:func:`split` replaces the ``sidecar_fields`` records of a saved tree by references and returns the tensors."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import hashlib

import torch

from .errors import ResultFileError

KEY = "__sidecar__"
SUFFIX = ".tensors.safetensors"


#: what the codec (tl_steering.results) gives this module: a record's kind -> its sidecar fields; a tensor
#: record -> the tensor; a tree with ``{"__tensor_ref__"}`` references + the tensors -> the tree with records
FieldsOf = Callable[[str], tuple[str, ...]]
Decode = Callable[[dict], torch.Tensor]
Join = Callable[[Any, dict[str, torch.Tensor]], Any]


def sidecar_path(path: Path) -> Path:
    """``dir/name.json`` -> ``dir/name.tensors.safetensors``."""
    return path.with_name(path.stem + SUFFIX)


def split(node: Any, out: dict[str, torch.Tensor], fields_of: FieldsOf, decode: Decode, prefix: str = "") -> Any:
    """``node`` (a ``Result.to_dict()`` tree) with the sidecar fields' tensor records replaced by
    ``{"__tensor_ref__": name, ...}``; the tensors are added to ``out`` under ``name``."""
    if isinstance(node, list):
        return [split(v, out, fields_of, decode, f"{prefix}.{i}") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    fields = fields_of(node.get("__kind__", ""))
    new = {}
    for k, v in node.items():
        name = f"{prefix}.{k}" if prefix else k
        if k in fields and isinstance(v, dict) and v.get("__tensor__"):
            t = decode(v)
            if t.is_complex():
                t = torch.view_as_real(t)
            out[name] = t.contiguous()
            new[k] = {"__tensor_ref__": name, "complex": v["complex"], "dtype": v["dtype"]}
        else:
            new[k] = split(v, out, fields_of, decode, name)
    return new


def save(data: dict, path: Path, fields_of: FieldsOf, decode: Decode) -> dict:
    """Write the sidecar of ``data`` (a to_dict tree) beside ``path`` when it holds sidecar tensors; returns the
    tree to write as JSON (with ``"__sidecar__"`` naming the file)."""
    tensors: dict[str, torch.Tensor] = {}
    data = split(data, tensors, fields_of, decode)
    if tensors:
        from safetensors.torch import save_file

        side = sidecar_path(path)
        save_file(tensors, str(side), metadata={"tl_steering": "sidecar of " + path.name})
        data[KEY] = {"file": side.name, "sha256": _sha256(side)}
    return data


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def move(src: Path, dst: Path) -> None:
    """Rename the sidecar of the JSON ``src`` to that of ``dst`` (when there is one), before ``src`` itself is
    renamed to ``dst`` (an atomic checkpoint write); the hash in the JSON still holds."""
    import os

    if sidecar_path(src).exists():
        os.replace(sidecar_path(src), sidecar_path(dst))


def load(data: Any, path: Path, join: Join) -> Any:
    """``data`` (a loaded JSON tree) with the sidecar's tensors joined back in (unchanged without ``"__sidecar__"``)."""
    if not isinstance(data, dict) or KEY not in data:
        return data
    from safetensors import safe_open

    ref = data.pop(KEY)
    name, digest = (ref.get("file"), ref.get("sha256")) if isinstance(ref, dict) else (None, None)
    if not isinstance(name, str) or Path(name).name != name or not isinstance(digest, str):
        raise ResultFileError(f"malformed {KEY} record {ref!r}")
    side = path.parent / name
    if not side.exists():
        side = sidecar_path(path)
    if not side.exists():
        raise ResultFileError(f"its tensors are in a sidecar file {name!r} that is not beside it ({path.parent}); "
                              "copy the .tensors.safetensors file with the JSON")
    if _sha256(side) != digest:
        raise ResultFileError(f"the sidecar {side.name} is not the one saved with this JSON (SHA-256 differs): "
                              "another save overwrote it; save the result again")
    try:
        with safe_open(str(side), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError / OSError
        raise ResultFileError(f"sidecar {side.name}: not a readable safetensors file ({type(e).__name__}: {e})"
                              ) from None
    try:
        return join(data, tensors)
    except KeyError as e:
        raise ResultFileError(f"tensor {e} named in the JSON is missing from the sidecar {side.name}") from None


__all__ = ["KEY", "SUFFIX", "load", "move", "save", "sidecar_path", "split"]
