"""On-disk cache of dequantized weights: one verified, atomically written directory per model, source, dtype
(location, key, manifest, atomic writes: docs/loading.md). It knows no model library: it stores a tensor dict plus
whatever files a ``build`` callback writes."""

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

import torch

CACHE_FORMAT = 1
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
_TMP_MARK = ".tmp-"

Build = Callable[[Path], tuple[dict[str, torch.Tensor], dict[str, str]]]


def cache_root() -> Path:
    """``$TL_STEERING_CACHE``, else ``$XDG_CACHE_HOME/tl_steering``, else ``~/.cache/tl_steering``."""
    if os.environ.get("TL_STEERING_CACHE"):
        return Path(os.environ["TL_STEERING_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "tl_steering"


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def entry_dir(name: str, source_sha256: str, dtype: torch.dtype, root: Path | None = None,
              extra: dict[str, str] | None = None) -> Path:
    """Where the entry for this key lives (it need not exist); ``root`` defaults to :func:`cache_root`;
    ``extra`` (more key fields, e.g. the writer's library version) adds a short hash to the name."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    dt = str(dtype).removeprefix("torch.")
    tag = "-" + hashlib.sha256(json.dumps(extra, sort_keys=True).encode()).hexdigest()[:8] if extra else ""
    leaf = f"{safe}-{source_sha256[:16]}-{dt}{tag}-v{CACHE_FORMAT}"
    return (root or cache_root()) / "dequantized" / leaf


def _key(name: str, source_sha256: str, dtype: torch.dtype,
         extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"name": name, "source_sha256": source_sha256, "dtype": str(dtype).removeprefix("torch."),
            "cache_format": str(CACHE_FORMAT), **{str(k): str(v) for k, v in (extra or {}).items()}}


def read_entry(path: Path, key: dict[str, str]) -> dict[str, str] | None:
    """The entry's metadata if ``path`` is a complete entry for ``key`` whose files all hash to its manifest;
    otherwise delete whatever is at ``path`` and return None."""
    if not path.exists():
        return None
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        ok = manifest.get("key") == key and WEIGHTS_FILE in manifest.get("files", {})
        for rel, (size, digest) in manifest["files"].items() if ok else ():
            f = path / rel
            if not f.is_file() or f.stat().st_size != size or file_sha256(f) != digest:
                ok = False
                break
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        shutil.rmtree(path, ignore_errors=True)
        return None
    return dict(manifest.get("metadata", {}))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(parent: Path) -> None:
    """Remove temporary build directories left by processes that no longer run (e.g. killed mid-write)."""
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        if _TMP_MARK not in p.name:
            continue
        try:
            pid = int(p.name.rsplit(_TMP_MARK, 1)[1].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def _dedupe_shared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory; keep the first name of each shared storage (tied weights,
    which the model re-ties on load) and make every kept tensor contiguous."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for k, v in tensors.items():
        v = v.detach()
        ident = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if v.numel() and ident in seen:
            continue
        seen.add(ident)
        out[k] = v.contiguous()
    return out


def write_entry(path: Path, key: dict[str, str], build: Build) -> dict[str, str]:
    """Build an entry in a temporary sibling directory (``build(tmpdir)`` writes its files and returns ``(tensors,
    metadata)``), rename it to ``path`` atomically (docs/loading.md); the metadata (another process's if first)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path.parent)
    tmp = path.parent / f"{path.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tensors, metadata = build(tmp)
        metadata = {str(k): str(v) for k, v in metadata.items()}
        save_file(_dedupe_shared(tensors), str(tmp / WEIGHTS_FILE), metadata={"format": "pt", **key})
        files = {}
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            files[str(f.relative_to(tmp))] = (f.stat().st_size, file_sha256(f))
        manifest = tmp / MANIFEST_FILE
        manifest.write_text(json.dumps({"key": key, "metadata": metadata, "files": files}, indent=1))
        with open(manifest, "rb") as fh:
            os.fsync(fh.fileno())
        try:
            os.replace(tmp, path)
        except OSError:  # a complete entry appeared meanwhile (another process): keep it if it verifies
            existing = read_entry(path, key)
            if existing is None:
                os.replace(tmp, path)
            else:
                metadata = existing
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return metadata


def cached_entry(name: str, source: str | os.PathLike, dtype: torch.dtype, build: Build,
                 source_sha256: str | None = None, root: Path | None = None,
                 extra: dict[str, str] | None = None) -> tuple[Path, dict[str, str], bool]:
    """``(entry directory, metadata, hit)``: the verified cache entry for ``source``, built with ``build`` on a miss
    or a bad entry (``hit`` False); ``extra``: further key fields (e.g. the transformers version)."""
    sha = source_sha256 or file_sha256(source)
    key = _key(name, sha, dtype, extra)
    path = entry_dir(name, sha, dtype, root, extra)
    _remove_stale_temps(path.parent)  # a build killed earlier (any entry) leaves nothing behind, hit or miss
    meta = read_entry(path, key)
    if meta is not None:
        return path, meta, True
    return path, write_entry(path, key, build), False


__all__ = ["CACHE_FORMAT", "cache_root", "cached_entry", "entry_dir", "file_sha256", "read_entry", "write_entry"]
