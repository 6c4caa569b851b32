"""The paper's published numbers beside ours: one row per number of tl_steering/reference/published.json
(docs/published.md), read through the suite's one map of named numbers (:data:`tl_steering.suite.numbers.PUBLISHED`),
each judged by the one band check (:func:`tl_steering.reference.band_check`)."""

import dataclasses
from typing import Any

from ..reference import band_check, published_numbers
from ..suite.numbers import PUBLISHED
from ..suite.result import SuiteResult

#: a paper model -> the names ours may contain (gpt2 is matched exactly: "gpt2" is inside "gpt2-large")
_ALIASES = {"gpt2-large": ("gpt2-large",), "pythia": ("pythia",), "mistral-7b": ("mistral",),
            "llama-3-8b": ("llama-3-8b", "meta-llama-3-8b")}


def _same_model(paper_model: str, ours: str) -> bool:
    ours = ours.lower()
    return any(ours in ("gpt2", "openai-community/gpt2") if n == "gpt2" else any(a in ours for a in _ALIASES.get(n, ()))
               for n in (m.strip() for m in paper_model.split(",")))


#: published numbers that are a timing of ours with no interval (shown for orientation, not judged) and that one
#: model cannot give (an ordering across models)
UNJUDGED_TIMINGS, TWO_MODELS = ("parallel_gpt2_large_speedup",), ("deficit_order_gpt2_llama",)


def _verdict(pub: dict[str, Any], value: Any) -> Any:
    """:func:`band_check` of one row (not judged where the number is not regressed or needs two models; a timing
    estimate with no interval, :data:`UNJUDGED_TIMINGS`, says where it falls, for orientation)."""
    v = band_check(value if pub["regress"] and pub["id"] not in TWO_MODELS else None, pub)
    if pub["id"] in UNJUDGED_TIMINGS and v.parts["against"]:
        return dataclasses.replace(v, verdict="not judged", why=f"not judged: one estimate from sub-module median "
                                   f"times with no interval ({v.why}, for orientation only)")
    return v


def _paper_value(pub: dict[str, Any]) -> str:
    if pub["value"] is not None:
        return f"{pub['value']:g}"
    if pub["range"] is not None:
        return f"{pub['range'][0]:g} - {pub['range'][1]:g}"
    return pub["tolerance"] if pub["regress"] else pub["metric"]


def _value_and_note(r: SuiteResult, number_id: str, summary: dict[str, Any]) -> tuple[Any, str]:
    n = PUBLISHED.get(number_id)
    if n is None:
        return None, "not computed by the suite"
    try:
        return n.get(r, summary), n.note(r)
    except (AttributeError, KeyError):  # a stage that was not run: not in the headline, its field None
        return None, "its stage was not run"


def comparison_rows(r: SuiteResult) -> list[dict[str, Any]]:
    """One row per published number (tl_steering/reference/published.json) with our value beside it and its
    ``verdict`` (a :class:`~tl_steering._util.claims.Claim`)."""
    model_name = r.model.name
    device = r.speedup.device if r.speedup is not None else ""
    rows, summary = [], r.summary()
    for pub in published_numbers():
        value, note = _value_and_note(r, pub["id"], summary)
        if not pub["regress"]:
            relation = "not compared (definition)" if pub["spec_row"] == 9 else "not compared (low trust)"
        elif value is None:
            relation = "not comparable from one model"
        elif pub["model"] == "all":
            relation = "same protocol, other model (the paper's value spans its models)"
        elif _same_model(pub["model"], model_name):
            relation = "same protocol, same model"
        else:
            relation = "same protocol, other model"
        if pub["id"] == "parallel_gpt2_large_speedup" and relation.startswith("same protocol"):
            relation += "; CPU timing" if "cpu" in str(device) else ""
        rows.append({"id": pub["id"], "spec_row": pub["spec_row"], "claim": pub["description"],
                     "paper_model": pub["model_label"], "paper_value": _paper_value(pub), "paper_number": pub["value"],
                     "paper_range": pub["range"], "band": pub["band"], "tolerance": pub["tolerance"],
                     "certainty": pub["certainty"], "ours": value, "ours_note": note, "our_model": model_name,
                     "relation": relation, "verdict": _verdict(pub, value), "regress": pub["regress"]})
    return rows


__all__ = ["TWO_MODELS", "UNJUDGED_TIMINGS", "comparison_rows"]
