"""Pinned regression values measured by this package on SmolLM2-135M and Gemma-3-270M: their settings and tolerances
(the suite computes them: ``tl_steering.suite.numbers.compute_pinned``; docs/published.md, "Pinned values")."""

import math
from typing import Any

from . import PINNED_FILES

PINNED_SETTINGS: dict[str, Any] = {
    "text": "pydoc", "windows": 4, "length": 64, "seed": 0, "processing": "raw",
    "ablation_variants": ["tangential", "radial", "zero", "random_tangent"],
    "diversity_ablations": ["tangential", "radial"], "defect_k": 15, "defect_gold_layers": [0, 1, 10, 20, 29],
    "prefix_layer": 15, "prefix_positions": [16], "prefix_eps": 1e-2}

#: Gemma-3-270M (18 layers; forwards ~10x SmolLM2's, 262k vocabulary): 2 windows x 64 tokens, plan k = L/2 = 9,
#: gold layers first / second / local / global / last, prefix perturbed at the middle layer
GEMMA_PINNED_SETTINGS: dict[str, Any] = {**PINNED_SETTINGS, "windows": 2, "defect_k": 9,
                                         "defect_gold_layers": [0, 1, 5, 11, 17], "prefix_layer": 9}

#: model name -> (file in tl_steering/reference/, settings)
PINNED_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm2-135m": (PINNED_FILES["smollm2-135m"], PINNED_SETTINGS),
    "gemma-3-270m": (PINNED_FILES["gemma-3-270m"], GEMMA_PINNED_SETTINGS)}

# tolerance groups: |ours - pinned| <= abs + rel * |pinned|
TOLERANCES: dict[str, dict[str, float]] = {
    "loss": {"abs": 2e-3, "rel": 0.0, "why": "mean CE in nats; fp32 logits over a 49k vocabulary"},
    "delta_loss": {"abs": 5e-3, "rel": 2e-3, "why": "difference of two mean CEs; radial/zero ablations amplify"},
    "geometry": {"abs": 2e-4, "rel": 0.0,
                 "why": "cosines/deficits in [0, 2] from float64 geometry on fp32 activations"},
    "ratio": {"abs": 1e-4, "rel": 2e-3, "why": "relative RMS ratios (C_l) of a difference of FFN outputs"},
    "diversity": {"abs": 2e-4, "rel": 1e-3, "why": "mean pairwise cosine / effective rank of token directions"},
    "gate": {"abs": 1e-4, "rel": 1e-3, "why": "closed-form least-squares gates"},
    "prefix": {"abs": 1e-5, "rel": 5e-2, "why": "KL/angle of a 1e-2 perturbation: small numbers, loose relative"},
    "exact": {"abs": 0.0, "rel": 0.0, "why": "structural: counts and layer lists"},
}

#: the cross-backend acceptance (the same weights on TL 3.9 HookedTransformer and a bridge): rtol 1e-4 on geometry
#: (abs floor 1e-6 for values near 0), 1e-4 nats on losses; ratios, gates and diversity as geometry; the prefix
#: numbers (KL / angle of a 1e-2 perturbation, ~1e-4) keep their own relative bound
BACKEND_TOLERANCES: dict[str, dict[str, float]] = {
    "loss": {"abs": 1e-4, "rel": 0.0, "why": "1e-4 nats"},
    "delta_loss": {"abs": 1e-4, "rel": 0.0, "why": "1e-4 nats"},
    "geometry": {"abs": 1e-6, "rel": 1e-4, "why": "rtol 1e-4"},
    "ratio": {"abs": 1e-6, "rel": 1e-4, "why": "rtol 1e-4"},
    "diversity": {"abs": 1e-6, "rel": 1e-4, "why": "rtol 1e-4"},
    "gate": {"abs": 1e-6, "rel": 1e-4, "why": "rtol 1e-4"},
    "prefix": {"abs": 1e-7, "rel": 1e-2, "why": "small numbers of a 1e-2 perturbation"},
    "exact": {"abs": 0.0, "rel": 0.0, "why": "structural"},
}


def compare(
    pinned: dict[str, Any], measured: dict[str, tuple[Any, str]], tolerances: dict[str, Any] | None = None
) -> list[str]:
    """Mismatches between a pinned file's ``values`` and ``compute_pinned`` output (empty when all agree).

    ``tolerances`` overrides the file's groups (e.g. :data:`BACKEND_TOLERANCES` to compare two backends' runs:
    pass one run as ``{"values": {name: {"value": v, "tol": group}}}``, see :func:`as_pinned`)."""
    problems = []
    tol = tolerances or pinned.get("tolerances", TOLERANCES)
    for name, entry in pinned["values"].items():
        if name not in measured:
            problems.append(f"{name}: pinned but no longer computed")
            continue
        want, group = entry["value"], entry["tol"]
        got = measured[name][0]
        t = tol[group]
        if group == "exact" or isinstance(want, bool):
            if got != want:
                problems.append(f"{name}: got {got!r}, pinned {want!r}")
            continue
        w = want if isinstance(want, list) else [want]
        g = got if isinstance(got, list) else [got]
        if len(w) != len(g):
            problems.append(f"{name}: {len(g)} values, pinned {len(w)}")
            continue
        for i, (x, y) in enumerate(zip(g, w)):
            if isinstance(y, str):  # NaN / Infinity as written by the JSON encoder
                y = float(y)
            if math.isnan(y) and math.isnan(x):
                continue
            bound = t["abs"] + t["rel"] * abs(y)
            if not abs(x - y) <= bound:
                where = f"[{i}]" if isinstance(want, list) else ""
                problems.append(
                    f"{name}{where}: got {x:.6g}, pinned {y:.6g} (|diff| {abs(x - y):.2g} > {bound:.2g}, "
                    f"tolerance group {group!r})")
    return problems


def group_problems(pinned: dict[str, Any], measured: dict[str, tuple[Any, str]], group: str) -> list[str]:
    """:func:`compare` restricted to the values of one tolerance group of a pinned file (one test per group)."""
    sub = {"tolerances": pinned["tolerances"],
           "values": {k: v for k, v in pinned["values"].items() if v["tol"] == group}}
    return compare(sub, measured)


def as_pinned(measured: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    """``compute_pinned`` output in the file's ``{"values": ...}`` form (to :func:`compare` two runs)."""
    return {"values": {name: {"value": value, "tol": group} for name, (value, group) in measured.items()}}


__all__ = [
    "BACKEND_TOLERANCES", "group_problems", "GEMMA_PINNED_SETTINGS", "PINNED_MODELS", "PINNED_SETTINGS",
    "TOLERANCES", "as_pinned", "compare"]
