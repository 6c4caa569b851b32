"""The ONE map from named numbers to :class:`~tl_steering.suite.result.SuiteResult` fields.

:data:`NUMBERS` holds every number somebody compares against:

* the paper's published numbers, keyed by their id in ``tl_steering/reference/published.json`` (the report's
  summary table and ``tests/published`` read them through :func:`published_value`);
* the pinned SmolLM2 regression values, keyed by their name in ``tl_steering/reference/smollm2_pinned.json``
  with a tolerance group (``tl_steering.reference.pinned`` reads them through :func:`pinned_values`).

Adding a protocol's number means adding one entry here. See docs/suite.md.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from .result import SuiteResult

Getter = Callable[[SuiteResult], Any]


@dataclasses.dataclass(frozen=True)
class Number:
    """One named number of a :class:`SuiteResult`.

    Attributes:
        get: the value (a float, bool, int, list, or None when one model cannot give it).
        note: how ours was measured (shown beside the value in the report).
        tol: the pinned tolerance group (None for a published number).
    """

    get: Getter
    note: Callable[[SuiteResult], str] = lambda r: ""
    tol: str | None = None


def _t(x: Any) -> list[float]:
    return [float(v) for v in x.reshape(-1).tolist()]


def _ratio_high_low(r: SuiteResult) -> float:
    return r.plan.high_over_low


def _deficit_note(r: SuiteResult) -> str:
    d = r.deficit
    return f"mean over {len(d.layers)} layers, 95% CI [{d.mean_ci[0]:.3f}, {d.mean_ci[1]:.3f}]"


def _final_cos(r: SuiteResult, ablation: str | None) -> float:
    v = r.diversity
    if ablation is None:
        return v.final_diversity.get("pairwise_cosine", math.nan)
    return v.final_diversity_under_ablation.get(ablation, {}).get("pairwise_cosine", math.nan)


def _tangential_preserves(r: SuiteResult) -> bool | None:
    clean, tan, rad = _final_cos(r, None), _final_cos(r, "tangential"), _final_cos(r, "radial")
    return (abs(tan - clean) < abs(rad - clean)) if math.isfinite(tan + rad + clean) else None


def _critical_points(r: SuiteResult) -> tuple[int, int, int]:
    cr = r.critical
    return int(cr.n_points.sum()), int(cr.n_converged.sum()), sum(int(x.n_starts) for x in cr.results)


def _saddle_note(r: SuiteResult) -> str:
    cr = r.critical
    n_eq, n_conv, n_starts = _critical_points(r)
    t = cr.totals()
    if n_eq:
        return (
            f"{cr.results[0].method} finder, layers {cr.layers}: {t.get('saddle', 0)} saddles, {t.get('attractor', 0)} "
            f"attractors, {t.get('repeller', 0)} repellers of {n_eq} points ({n_conv} of {n_starts} starts "
            f"converged); the sample: {cr.claim()['sample']}"
        )
    method = cr.results[0].method if cr.results else "the"
    return f"no equilibrium found: {n_conv} of {n_starts} starts of the {method} finder converged on layers {cr.layers}"


def _speedup_note(r: SuiteResult) -> str:
    return f"k = {r.plan.k}; timed on {r.speedup.device or '?'} (the paper: GPU sub-module times)"


def _none(note: str) -> Number:
    return Number(get=lambda r: None, note=lambda r: note)


_AS_ABOVE = Number(get=lambda r: r.deficit.mean, note=lambda r: "as above")

#: published id -> the SuiteResult value it is compared with (every id of published.json has an entry)
PUBLISHED: dict[str, Number] = {
    "deficit_gpt2": Number(get=lambda r: r.deficit.mean, note=_deficit_note),
    "deficit_llama3_8b": _AS_ABOVE,
    "deficit_pythia": _AS_ABOVE,
    "deficit_mistral": _AS_ABOVE,
    "deficit_order_gpt2_llama": _none("needs two models: tests/published runs it where both load"),
    "one_step_prediction_improves": Number(
        get=lambda r: r.deficit.ffn_contribution_mean, note=lambda r: "(e_A - e_AF) / e_A, mean over layers"
    ),
    "ablation_tangential": Number(
        get=lambda r: r.ablation.delta_loss.get("tangential", math.nan), note=lambda r: "all layers at once"
    ),
    "ablation_radial": Number(
        get=lambda r: r.ablation.delta_loss.get("radial", math.nan), note=lambda r: "all layers at once"
    ),
    "ablation_radial_like_zero": Number(
        get=lambda r: r.ablation.ratio_to_zero.get("radial", math.nan),
        note=lambda r: f"dCE(zero FFN) = {r.ablation.delta_loss.get('zero', math.nan):.3f}",
    ),
    "parallel_gpt2_large_delta_ce": Number(
        get=lambda r: r.plan.delta_ce_lowest,
        note=lambda r: f"k = {r.plan.k} lowest-C of {r.plan.n_candidates} layers",
    ),
    "parallel_gpt2_large_high_defect_degrades": Number(
        get=_ratio_high_low, note=lambda r: f"dCE(highest {r.plan.k}) / dCE(lowest {r.plan.k})"
    ),
    "parallel_gpt2_large_speedup": Number(get=lambda r: r.speedup.speedup, note=_speedup_note),
    "critical_mostly_saddles": Number(
        get=lambda r: r.critical.saddle_fraction() if _critical_points(r)[0] else None, note=_saddle_note
    ),
    "critical_rotational_modes": Number(
        get=lambda r: r.critical.totals().get("rotational", 0) if _critical_points(r)[0] else None,
        note=lambda r: "points with a rotational mode" if _critical_points(r)[0] else "no equilibrium found",
    ),
    "diversity_attention_contracts": Number(
        get=lambda r: r.diversity.summary()["frac_layers_attention_concentrates"],
        note=lambda r: "fraction of layers",
    ),
    "diversity_ffn_restores": Number(
        get=lambda r: r.diversity.summary()["frac_layers_ffn_diversifies"],
        note=lambda r: "fraction of layers",
    ),
    "diversity_tangential_preserves": Number(
        get=_tangential_preserves,
        note=lambda r: (
            f"final pairwise cosine: clean {_final_cos(r, None):.3f}, tangential-only "
            f"{_final_cos(r, 'tangential'):.3f}, radial-only {_final_cos(r, 'radial'):.3f}"
        ),
    ),
    "eq19_radial_coefficient": _none(
        "our split uses u = normalize(FFN input) = resid_mid (sequential blocks)"
    ),
    "low_trust_auto_summaries": _none("not compared: low trust"),
}


def _div_final(name: str) -> Getter:
    return lambda r: float(r.diversity.final_diversity_under_ablation[name]["pairwise_cosine"])


#: pinned name -> the SuiteResult value and its tolerance group (smollm2_pinned.json's names)
PINNED: dict[str, Number] = {
    "clean_loss": Number(get=lambda r: float(r.checks.clean_loss), tol="loss"),
    "deficit.deficit": Number(get=lambda r: _t(r.deficit.deficit), tol="geometry"),
    "deficit.mean": Number(get=lambda r: float(r.deficit.mean), tol="geometry"),
    "deficit.untangented_deficit": Number(get=lambda r: _t(r.deficit.untangented_deficit), tol="geometry"),
    "deficit.ffn_contribution_mean": Number(
        get=lambda r: float(r.deficit.ffn_contribution_mean), tol="geometry"
    ),
    "deficit.r2_attention": Number(get=lambda r: _t(r.deficit.r2_attention), tol="geometry"),
    "ablation.clean_loss": Number(get=lambda r: float(r.ablation.clean_loss), tol="loss"),
    **{
        f"ablation.delta_loss.{v}": Number(
            get=lambda r, v=v: float(r.ablation.delta_loss[v]), tol="delta_loss"
        )
        for v in ("tangential", "radial", "zero", "random_tangent")
    },
    **{
        f"ablation.top1_agreement.{v}": Number(
            get=lambda r, v=v: float(r.ablation.top1_agreement[v]), tol="geometry"
        )
        for v in ("tangential", "radial", "zero", "random_tangent")
    },
    "diversity.pairwise_cosine": Number(get=lambda r: _t(r.diversity.pairwise_cosine), tol="diversity"),
    "diversity.effective_rank": Number(get=lambda r: _t(r.diversity.effective_rank), tol="diversity"),
    "diversity.final_pairwise_cosine": Number(
        get=lambda r: float(r.diversity.final_diversity["pairwise_cosine"]), tol="diversity"
    ),
    "diversity.final_pairwise_cosine.tangential": Number(get=_div_final("tangential"), tol="diversity"),
    "diversity.final_pairwise_cosine.radial": Number(get=_div_final("radial"), tol="diversity"),
    **{
        f"defect.{n}": Number(get=lambda r, n=n: _t(r.defect.scores[n]), tol="ratio")
        for n in ("C", "C_phi", "C1", "C_tan")
    },
    "defect.nonlinearity": Number(get=lambda r: _t(r.defect.nonlinearity), tol="ratio"),
    "defect.plan": Number(get=lambda r: list(r.plan.layers), tol="exact"),
    "defect.gold_delta_ce": Number(get=lambda r: _t(r.defect_gold.delta_ce), tol="delta_loss"),
    "defect.gold_lowest_2": Number(
        get=lambda r: float(r.defect_gold.curves["lowest"][r.defect_gold.k_values.index(2)]), tol="delta_loss"
    ),
    "defect.plan_delta_ce": Number(get=lambda r: float(r.plan.delta_ce_lowest), tol="delta_loss"),
    "gates.closed_form": Number(
        get=lambda r: [float(r.gates.gates[lay]) for lay in r.plan.layers], tol="gate"
    ),
    "gates.loss_base_heldout": Number(get=lambda r: float(r.gates.loss_base_heldout), tol="loss"),
    "gates.loss_gated_heldout": Number(get=lambda r: float(r.gates.loss_gated_heldout), tol="loss"),
    "prefix.prefix_bitwise_equal": Number(get=lambda r: bool(r.prefix.prefix_bitwise_equal), tol="exact"),
    "prefix.kl_at_perturbed": Number(get=lambda r: float(r.prefix.kl[0]), tol="prefix"),
    "prefix.angle_final_mean_later": Number(
        get=lambda r: float(r.prefix.angle_final[1:].nanmean()), tol="prefix"
    ),
}

#: every named number: published ids and pinned names (disjoint), one map
NUMBERS: dict[str, Number] = {**PUBLISHED, **PINNED}
assert len(NUMBERS) == len(PUBLISHED) + len(PINNED), "published ids and pinned names must not collide"


def published_value(suite: SuiteResult, number_id: str) -> Any:
    """Our value for a published number (see :data:`PUBLISHED`)."""
    return PUBLISHED[number_id].get(suite)


def pinned_values(suite: SuiteResult) -> dict[str, tuple[Any, str]]:
    """``{pinned name: (value, tolerance group)}`` for every entry of :data:`PINNED`."""
    return {name: (n.get(suite), n.tol) for name, n in PINNED.items()}


__all__ = [
    "NUMBERS",
    "PINNED",
    "PUBLISHED",
    "Number",
    "pinned_values",
    "published_value",
]
