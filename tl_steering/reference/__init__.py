"""The paper's published numbers (``published.json``) and this package's pinned SmolLM2 and Gemma values
(``smollm2_pinned.json``, ``gemma3_pinned.json``), as versioned data (docs/published.md)."""

import copy
import functools
import json
from importlib import resources
from typing import Any

from ..errors import InputError

PUBLISHED_FILE = "published.json"
PINNED_FILE = "smollm2_pinned.json"
#: model name -> its pinned-values file (settings: tl_steering.reference.pinned.PINNED_MODELS)
PINNED_FILES = {"smollm2-135m": PINNED_FILE, "gemma-3-270m": "gemma3_pinned.json"}


@functools.lru_cache(maxsize=4)
def _load(name: str) -> dict[str, Any]:
    path = resources.files(__name__).joinpath(name)
    if not path.is_file():
        raise InputError(f"reference file {name} is missing from the tl_steering package; reinstall it")
    return json.loads(path.read_text(encoding="utf-8"))


def published_data() -> dict[str, Any]:
    """The whole ``published.json`` (paper, sources, certainty tags, tolerance policy, numbers, models)."""
    return copy.deepcopy(_load(PUBLISHED_FILE))


def published_numbers(regress_only: bool = False) -> list[dict[str, Any]]:
    """Every published number as a dict (``id``, ``model``, ``metric``, ``value``, ``range``, ``band``,
    ``protocol``, ``certainty``, ``regress``, ``notes``, ...).

    Args:
        regress_only: drop the rows that must not be regressed against (definitions, low-trust numbers).
    """
    rows = published_data()["numbers"]
    return [r for r in rows if r["regress"]] if regress_only else rows


def published_number(number_id: str) -> dict[str, Any]:
    """One published number by its ``id`` (e.g. ``"deficit_gpt2"``)."""
    for row in published_numbers():
        if row["id"] == number_id:
            return row
    ids = ", ".join(r["id"] for r in published_numbers())
    raise InputError(f"no published number {number_id!r}; known ids: {ids}")


def pinned_values(model: str = "smollm2-135m") -> dict[str, Any]:
    """The pinned regression values of ``model`` (a key of :data:`PINNED_FILES`: SmolLM2-135M by default,
    Gemma-3-270M): settings, tolerances, values, provenance."""
    if model not in PINNED_FILES:
        raise InputError(f"no pinned values for {model!r}; pinned models: {', '.join(PINNED_FILES)}")
    return copy.deepcopy(_load(PINNED_FILES[model]))


__all__ = [
    "PINNED_FILE",
    "PINNED_FILES",
    "PUBLISHED_FILE",
    "pinned_values",
    "published_data",
    "published_number",
    "published_numbers",
]
