"""Pinned regression values measured by this package on SmolLM2-135M (and Gemma-3-270M when installed).

:func:`compute_pinned` runs every protocol once on small settings and returns a flat ``{name: value}`` dict;
``scripts/regenerate_pinned.py`` writes it to ``smollm2_pinned.json`` and ``tests/published/test_smollm2_pinned.py``
recomputes it and compares. Any change to a definition then shows up as a test failure. The tolerances survive
the ~1e-5 relative activation differences between TransformerLens 4.x bridges and TL 3.9 HookedTransformer.
"""

import math
from typing import Any

import torch

PINNED_SETTINGS: dict[str, Any] = {
    "text": "pydoc",
    "windows": 4,
    "length": 64,
    "seed": 0,
    "processing": "raw",
    "ablation_variants": ["tangential", "radial", "zero", "random_tangent"],
    "diversity_ablations": ["tangential", "radial"],
    "defect_k": 15,
    "defect_gold_layers": [0, 1, 10, 20, 29],
    "prefix_layer": 15,
    "prefix_positions": [16],
    "prefix_eps": 1e-2,
}

# tolerance groups: |ours - pinned| <= abs + rel * |pinned|
TOLERANCES: dict[str, dict[str, float]] = {
    "loss": {"abs": 2e-3, "rel": 0.0, "why": "mean CE in nats; fp32 logits over a 49k vocabulary"},
    "delta_loss": {
        "abs": 5e-3,
        "rel": 2e-3,
        "why": "difference of two mean CEs; radial/zero ablations amplify",
    },
    "geometry": {
        "abs": 2e-4,
        "rel": 0.0,
        "why": "cosines/deficits in [0, 2] from float64 geometry on fp32 activations",
    },
    "ratio": {"abs": 1e-4, "rel": 2e-3, "why": "relative RMS ratios (C_l) of a difference of FFN outputs"},
    "diversity": {
        "abs": 2e-4,
        "rel": 1e-3,
        "why": "mean pairwise cosine / effective rank of token directions",
    },
    "gate": {"abs": 1e-4, "rel": 1e-3, "why": "closed-form least-squares gates"},
    "prefix": {
        "abs": 1e-5,
        "rel": 5e-2,
        "why": "KL/angle of a 1e-2 perturbation: small numbers, loose relative",
    },
    "exact": {"abs": 0.0, "rel": 0.0, "why": "structural: counts and layer lists"},
}


def _tensor_list(x: torch.Tensor) -> list[float]:
    return [float(v) for v in x.reshape(-1).tolist()]


def compute_pinned(model: Any, tokens: torch.Tensor | None = None) -> dict[str, tuple[Any, str]]:
    """Run the protocols on ``model`` with :data:`PINNED_SETTINGS`; ``{name: (value, tolerance group)}``.

    Values are floats, lists of floats, ints, bools or lists of ints (layer lists). Timing-dependent quantities
    are never pinned.
    """
    from ..backends import adapt
    from ..data import text_tokens
    from ..gates import calibrate_gates
    from ..prefix import prefix_sensitivity
    from ..protocols import angular_deficit, diversity, ffn_ablation, parallel_defect

    s = PINNED_SETTINGS
    ad = adapt(model)
    if tokens is None:
        tokens = text_tokens(
            model, source=s["text"], n_windows=s["windows"], length=s["length"], seed=s["seed"]
        )
    out: dict[str, tuple[Any, str]] = {}
    out["clean_loss"] = (float(ad.loss_per_token(tokens).mean()), "loss")

    d = angular_deficit(model, tokens, n_bootstrap=0, seed=s["seed"])
    out["deficit.deficit"] = (_tensor_list(d.deficit), "geometry")
    out["deficit.mean"] = (float(d.mean), "geometry")
    out["deficit.untangented_deficit"] = (_tensor_list(d.untangented_deficit), "geometry")
    out["deficit.ffn_contribution_mean"] = (float(d.ffn_contribution_mean), "geometry")
    out["deficit.r2_attention"] = (_tensor_list(d.r2_attention), "geometry")

    a = ffn_ablation(model, tokens, keep=tuple(s["ablation_variants"]), seed=s["seed"], n_bootstrap=0)
    out["ablation.clean_loss"] = (float(a.clean_loss), "loss")
    for v in s["ablation_variants"]:
        out[f"ablation.delta_loss.{v}"] = (float(a.delta_loss[v]), "delta_loss")
        out[f"ablation.top1_agreement.{v}"] = (float(a.top1_agreement[v]), "geometry")

    v = diversity(model, tokens, ablations=tuple(s["diversity_ablations"]), gains=(), seed=s["seed"])
    out["diversity.pairwise_cosine"] = (_tensor_list(v.pairwise_cosine), "diversity")
    out["diversity.effective_rank"] = (_tensor_list(v.effective_rank), "diversity")
    out["diversity.final_pairwise_cosine"] = (float(v.final_diversity["pairwise_cosine"]), "diversity")
    for name in s["diversity_ablations"]:
        out[f"diversity.final_pairwise_cosine.{name}"] = (
            float(v.final_diversity_under_ablation[name]["pairwise_cosine"]),
            "diversity",
        )

    c = parallel_defect(model, tokens, evaluate=False, timing=False, seed=s["seed"])
    for name in ("C", "C_phi", "C1", "C_tan"):
        out[f"defect.{name}"] = (_tensor_list(c.scores[name]), "ratio")
    out["defect.nonlinearity"] = (_tensor_list(c.nonlinearity), "ratio")
    plan = c.plan(s["defect_k"])
    out["defect.plan"] = (plan, "exact")
    # the gold standard (single-layer dCE and the lowest-C curve) on a few layers: 1 forward per layer
    g = parallel_defect(
        model,
        tokens,
        layers=s["defect_gold_layers"],
        evaluate=True,
        k_values=[0, 2],
        n_random=0,
        timing=False,
        seed=s["seed"],
    )
    out["defect.gold_delta_ce"] = (_tensor_list(g.delta_ce), "delta_loss")
    out["defect.gold_lowest_2"] = (float(g.curves["lowest"][1]), "delta_loss")
    from ..hooks import parallel_blocks

    out["defect.plan_delta_ce"] = (
        float(ad.loss_per_token(tokens, parallel_blocks(model, plan)).mean()) - out["clean_loss"][0],
        "delta_loss",
    )

    g = calibrate_gates(model, tokens, method="closed_form", plan=plan, seed=s["seed"])
    out["gates.closed_form"] = ([float(g.gates[lay]) for lay in plan], "gate")
    out["gates.loss_base_heldout"] = (float(g.loss_base_heldout), "loss")
    out["gates.loss_gated_heldout"] = (float(g.loss_gated_heldout), "loss")

    p = prefix_sensitivity(
        model,
        tokens,
        layer=s["prefix_layer"],
        position=s["prefix_positions"],
        eps=s["prefix_eps"],
        seed=s["seed"],
    )
    out["prefix.prefix_bitwise_equal"] = (bool(p.prefix_bitwise_equal), "exact")
    out["prefix.kl_at_perturbed"] = (float(p.kl[0]), "prefix")
    out["prefix.angle_final_mean_later"] = (float(p.angle_final[1:].nanmean()), "prefix")
    return out


def compare(pinned: dict[str, Any], measured: dict[str, tuple[Any, str]]) -> list[str]:
    """Mismatches between a pinned file's ``values`` and :func:`compute_pinned` output (empty when all agree)."""
    problems = []
    tol = pinned.get("tolerances", TOLERANCES)
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
                    f"tolerance group {group!r})"
                )
    return problems


__all__ = ["PINNED_SETTINGS", "TOLERANCES", "compare", "compute_pinned"]
