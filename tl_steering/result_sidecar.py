"""Large tensors of a JSON result in a safetensors file beside it (``Result.save("x.json")``; docs/protocols.md).

A result class lists the tensor fields that go to the sidecar in ``sidecar_fields`` (a ClassVar; e.g.
``ParallelPlan``: its gates, biases and ``[k, d_model, d_model]`` linear maps). :func:`split` replaces those
tensor records, wherever such a record sits in the saved tree (a suite result holds plans), by references and
returns the tensors; ``Result.save`` writes them to ``<stem>.tensors.safetensors`` and names the file in the
JSON (``"__sidecar__"``); ``Result.load`` reads them back (exact: safetensors stores the raw bytes). A JSON file
without ``"__sidecar__"`` (every file written before) loads as before.
"""

from pathlib import Path
from typing import Any

import torch

from .errors import ResultFileError

KEY = "__sidecar__"
SUFFIX = ".tensors.safetensors"


def sidecar_path(path: Path) -> Path:
    """``dir/name.json`` -> ``dir/name.tensors.safetensors``."""
    return path.with_name(path.stem + SUFFIX)


def split(node: Any, out: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """``node`` (a ``Result.to_dict()`` tree) with the sidecar fields' tensor records replaced by
    ``{"__tensor_ref__": name, ...}``; the tensors are added to ``out`` under ``name``."""
    from .results import _REGISTRY, _decode

    if isinstance(node, list):
        return [split(v, out, f"{prefix}.{i}") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    cls = _REGISTRY.get(node.get("__kind__", ""))
    fields = getattr(cls, "sidecar_fields", ()) if cls is not None else ()
    new = {}
    for k, v in node.items():
        name = f"{prefix}.{k}" if prefix else k
        if k in fields and isinstance(v, dict) and v.get("__tensor__"):
            t = _decode(v)
            if t.is_complex():
                t = torch.view_as_real(t)
            out[name] = t.contiguous()
            new[k] = {"__tensor_ref__": name, "complex": v["complex"], "dtype": v["dtype"]}
        else:
            new[k] = split(v, out, name)
    return new


def save(data: dict, path: Path) -> dict:
    """Write the sidecar of ``data`` (a to_dict tree) beside ``path`` when it holds sidecar tensors; returns the
    tree to write as JSON (with ``"__sidecar__"`` naming the file)."""
    tensors: dict[str, torch.Tensor] = {}
    data = split(data, tensors)
    if tensors:
        from safetensors.torch import save_file

        side = sidecar_path(path)
        save_file(tensors, str(side), metadata={"tl_steering": "sidecar of " + path.name})
        data[KEY] = side.name
    return data


def load(data: Any, path: Path) -> Any:
    """``data`` (a loaded JSON tree) with the sidecar's tensors joined back in (unchanged without ``"__sidecar__"``)."""
    if not isinstance(data, dict) or KEY not in data:
        return data
    from safetensors import safe_open

    from .results import Result

    name = data.pop(KEY)
    side = path.parent / str(name)
    if Path(str(name)).name != str(name) or not side.exists():
        raise ResultFileError(f"its tensors are in a sidecar file {name!r} that is not beside it ({side}); copy "
                              "the .tensors.safetensors file with the JSON")
    try:
        with safe_open(str(side), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError / OSError
        raise ResultFileError(f"sidecar {side.name}: not a readable safetensors file ({type(e).__name__}: {e})"
                              ) from None
    try:
        return Result._join_tensors(data, tensors)
    except KeyError as e:
        raise ResultFileError(f"tensor {e} named in the JSON is missing from the sidecar {side.name}") from None


__all__ = ["KEY", "SUFFIX", "load", "save", "sidecar_path", "split"]
