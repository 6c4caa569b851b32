"""The paper's published numbers and statements (``published.json``), the one check of a value against a published
number (:func:`band_check`), and this package's pinned SmolLM2 and Gemma values (``smollm2_pinned.json``,
``gemma3_pinned.json``), as versioned data (docs/published.md)."""

import copy
import functools
import json
import math
from importlib import resources
from typing import Any

from .._util.claims import Claim, as_number, fmt, span
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
    ``protocol``, ``certainty``, ``regress``, ``notes``, ...); ``regress_only``: without the rows that must not be
    regressed against (definitions, low-trust numbers)."""
    rows = published_data()["numbers"]
    return [r for r in rows if r["regress"]] if regress_only else rows


def published_number(number_id: str) -> dict[str, Any]:
    """One published number by its ``id`` (e.g. ``"deficit_gpt2"``)."""
    for row in published_numbers():
        if row["id"] == number_id:
            return row
    ids = ", ".join(r["id"] for r in published_numbers())
    raise InputError(f"no published number {number_id!r}; known ids: {ids}")


class _Number(dict):
    """A published number's row that formats as its value, or its range where it has no value."""

    def __format__(self, spec: str) -> str:
        return fmt(self["value"]) if self["value"] is not None else span(*self["range"])


def paper_statement(key: str) -> str:
    """The paper's statement ``key`` (``published.json``, "claims": deficit, ablation, diversity, defect, parallel,
    critical, prefix), its numbers filled in from the published numbers (``{id}``: the value or range,
    ``{id[k]}``: a field of that row)."""
    claims = _load(PUBLISHED_FILE)["claims"]
    if key not in claims:
        raise InputError(f"no statement {key!r} in {PUBLISHED_FILE}; known: {', '.join(claims)}")
    return claims[key].format_map({r["id"]: _Number(r) for r in _load(PUBLISHED_FILE)["numbers"]})


def band_check(ours: Any, number: str | dict[str, Any], by_range: bool = True) -> Claim:
    """Our value ``ours`` against one published number (its ``id`` or row): the one band check of the claims, the
    report's comparison table and ``tests/published``; with ``by_range`` the paper's range decides where there is
    one, else the tolerance band (either end None) (docs/published.md)."""
    row = published_number(number) if isinstance(number, str) else number
    rng, band, v = (row["range"] if by_range else None), row["band"], as_number(ours)

    def claim(ok: bool | None, why: str, against: str) -> Claim:
        verdict = {True: "holds", False: "does not hold", None: "not judged"}[ok]
        return Claim(row["description"], verdict, why, value=ours, parts={"against": against})

    def inside(lo: Any, hi: Any) -> bool:
        return (lo is None or v >= lo) and (hi is None or v <= hi)

    if isinstance(ours, bool):
        return claim(ours, "holds" if ours else "does not hold", "shape")
    if not math.isfinite(v) or (rng is None and band is None):
        return claim(None, "not judged", "")
    if rng is None:
        around = f" around the paper's {fmt(row['value'])}" if row["value"] is not None else ""
        where = "inside" if inside(*band) else "outside"
        return claim(inside(*band), f"{where} the tolerance band {span(*band)}{around}", "tolerance band")
    if inside(*rng):
        return claim(True, f"inside the paper's range {span(*rng)}", "paper's range")
    where = "above" if rng[1] is not None and v > rng[1] else "below"
    also = "" if band is None else f"; {'inside' if inside(*band) else 'also outside'} the tolerance band {span(*band)}"
    return claim(False, f"outside the paper's range {span(*rng)}, {where} it{also}", "paper's range")


def pinned_values(model: str = "smollm2-135m") -> dict[str, Any]:
    """The pinned regression values of ``model`` (a key of :data:`PINNED_FILES`: SmolLM2-135M by default,
    Gemma-3-270M): settings, tolerances, values, provenance."""
    if model not in PINNED_FILES:
        raise InputError(f"no pinned values for {model!r}; pinned models: {', '.join(PINNED_FILES)}")
    return copy.deepcopy(_load(PINNED_FILES[model]))


__all__ = [
    "band_check", "paper_statement", "PINNED_FILE", "PINNED_FILES", "PUBLISHED_FILE", "pinned_values",
    "published_data", "published_number", "published_numbers"]
