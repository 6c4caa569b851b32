"""The ONE map from named numbers (the paper's published ids, the pinned names) to a
:class:`~tl_steering.suite.result.SuiteResult`'s values, read through its ``summary()`` (docs/suite.md, "One map of
named numbers"), and the run of the suite that computes the pinned values (:func:`compute_pinned`)."""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from ..reference.pinned import PINNED_SETTINGS
from .result import SuiteResult
from .settings import SuiteSettings

Getter = Callable[[SuiteResult], Any]


@dataclasses.dataclass(frozen=True)
class Number:
    """One named number of a :class:`SuiteResult` (its fields: docs/suite.md, "One map of named numbers")."""

    key: str | Getter
    note: Callable[[SuiteResult], str] = lambda r: ""
    tol: str | None = None
    cast: Callable[[Any], Any] = lambda v: v
    needs: str | None = None

    def get(self, suite: SuiteResult, summary: dict[str, Any] | None = None) -> Any:
        """The value (a float, bool, int, list, or None when one model cannot give it); ``summary``: the result's
        ``summary()`` when the caller has it. A stage that was not run raises KeyError or AttributeError."""
        if not isinstance(self.key, str):
            return self.key(suite)
        s = suite.summary() if summary is None else summary
        if self.needs is not None and not s[self.needs]:
            return None
        return self.cast(s[self.key])


def _t(x: Any) -> list[float]:
    return [float(v) for v in x.reshape(-1).tolist()]


def _deficit_note(r: SuiteResult) -> str:
    d = r.deficit
    return f"mean over {len(d.layers)} layers, 95% CI [{d.mean_ci[0]:.3f}, {d.mean_ci[1]:.3f}]"


def _saddle_note(r: SuiteResult) -> str:
    cr = r.critical
    n_eq, n_conv = int(cr.n_points.sum()), int(cr.n_converged.sum())
    n_starts = sum(int(x.n_starts) for x in cr.results)
    t = cr.totals()
    if n_eq:
        return (
            f"{cr.results[0].method} finder, layers {cr.layers}: {t.get('saddle', 0)} saddles, {t.get('attractor', 0)} "
            f"attractors, {t.get('repeller', 0)} repellers of {n_eq} points ({n_conv} of {n_starts} starts "
            f"converged); the sample: {cr.claim().parts['sample']}")
    method = cr.results[0].method if cr.results else "the"
    return f"no equilibrium found: {n_conv} of {n_starts} starts of the {method} finder converged on layers {cr.layers}"


def _cosines_note(r: SuiteResult) -> str:
    s = r.summary()
    return (f"final pairwise cosine: clean {s['diversity_final_pairwise_cosine']:.3f}, tangential-only "
            f"{s['diversity_final_pairwise_cosine_tangential']:.3f}, radial-only "
            f"{s['diversity_final_pairwise_cosine_radial']:.3f}")


def _none(note: str) -> Number:
    return Number(key=lambda r: None, note=lambda r: note)


_AS_ABOVE = Number(key="deficit_mean", note=lambda r: "as above")
_ALL_LAYERS = {"note": lambda r: "all layers at once"}
_FRACTION = {"note": lambda r: "fraction of layers"}

#: published id -> the SuiteResult value it is compared with (every id of published.json has an entry)
PUBLISHED: dict[str, Number] = {
    "deficit_gpt2": Number(key="deficit_mean", note=_deficit_note),
    "deficit_llama3_8b": _AS_ABOVE,
    "deficit_pythia": _AS_ABOVE,
    "deficit_mistral": _AS_ABOVE,
    "deficit_order_gpt2_llama": _none("needs two models: tests/published runs it where both load"),
    "one_step_prediction_improves": Number(
        key="ffn_contribution_mean", note=lambda r: "(e_A - e_AF) / e_A, mean over layers"),
    "ablation_tangential": Number(key="ablation_delta_loss_tangential", **_ALL_LAYERS),
    "ablation_radial": Number(key="ablation_delta_loss_radial", **_ALL_LAYERS),
    "ablation_radial_like_zero": Number(
        key="ablation_ratio_to_zero_radial",
        note=lambda r: f"dCE(zero FFN) = {r.ablation.delta_loss.get('zero', math.nan):.3f}"),
    "parallel_gpt2_large_delta_ce": Number(
        key="plan_delta_ce", note=lambda r: f"k = {r.plan.k} lowest-C of {r.plan.n_candidates} layers"),
    "parallel_gpt2_large_high_defect_degrades": Number(
        key="plan_high_over_low", note=lambda r: f"dCE(highest {r.plan.k}) / dCE(lowest {r.plan.k})"),
    "parallel_gpt2_large_speedup": Number(
        key="speedup_estimate",
        note=lambda r: f"k = {r.plan.k}; timed on {r.speedup.device or '?'} (the paper: GPU sub-module times)"),
    "critical_mostly_saddles": Number(key="critical_saddle_fraction", needs="critical_n_points", note=_saddle_note),
    "critical_rotational_modes": Number(
        key="critical_rotational_points", needs="critical_n_points",
        note=lambda r: "points with a rotational mode" if int(r.critical.n_points.sum()) else "no equilibrium found"),
    "diversity_attention_contracts": Number(key="diversity_frac_layers_attention_concentrates", **_FRACTION),
    "diversity_ffn_restores": Number(key="diversity_frac_layers_ffn_diversifies", **_FRACTION),
    "diversity_tangential_preserves": Number(key="diversity_tangential_preserves", note=_cosines_note),
    "eq19_radial_coefficient": _none("our split uses u = normalize(FFN input) = resid_mid (sequential blocks)"),
    "low_trust_auto_summaries": _none("not compared: low trust"),
}

#: pinned name -> the SuiteResult value and its tolerance group (smollm2_pinned.json's names)
PINNED: dict[str, Number] = {
    "clean_loss": Number(key="clean_loss", cast=float, tol="loss"),
    "deficit.deficit": Number(key=lambda r: _t(r.deficit.deficit), tol="geometry"),
    "deficit.mean": Number(key="deficit_mean", cast=float, tol="geometry"),
    "deficit.untangented_deficit": Number(key=lambda r: _t(r.deficit.untangented_deficit), tol="geometry"),
    "deficit.ffn_contribution_mean": Number(key="ffn_contribution_mean", cast=float, tol="geometry"),
    "deficit.r2_attention": Number(key=lambda r: _t(r.deficit.r2_attention), tol="geometry"),
    "ablation.clean_loss": Number(key=lambda r: float(r.ablation.clean_loss), tol="loss"),
    **{
        f"ablation.delta_loss.{v}": Number(key=f"ablation_delta_loss_{v}", cast=float, tol="delta_loss")
        for v in ("tangential", "radial", "zero", "random_tangent")},
    **{
        f"ablation.top1_agreement.{v}": Number(
            key=lambda r, v=v: float(r.ablation.top1_agreement[v]), tol="geometry")
        for v in ("tangential", "radial", "zero", "random_tangent")},
    "diversity.pairwise_cosine": Number(key=lambda r: _t(r.diversity.pairwise_cosine), tol="diversity"),
    "diversity.effective_rank": Number(key=lambda r: _t(r.diversity.effective_rank), tol="diversity"),
    **{
        f"diversity.final_pairwise_cosine{s.replace('_', '.')}": Number(
            key=f"diversity_final_pairwise_cosine{s}", cast=float, tol="diversity")
        for s in ("", "_tangential", "_radial")},
    **{
        f"defect.{n}": Number(key=lambda r, n=n: _t(r.defect.scores[n]), tol="ratio")
        for n in ("C", "C_phi", "C1", "C_tan")},
    "defect.nonlinearity": Number(key=lambda r: _t(r.defect.nonlinearity), tol="ratio"),
    "defect.plan": Number(key="plan_layers", cast=list, tol="exact"),
    "defect.gold_delta_ce": Number(key=lambda r: _t(r.defect_gold.delta_ce), tol="delta_loss"),
    "defect.gold_lowest_2": Number(
        key=lambda r: float(r.defect_gold.curves["lowest"][r.defect_gold.k_values.index(2)]), tol="delta_loss"),
    "defect.plan_delta_ce": Number(key="plan_delta_ce", cast=float, tol="delta_loss"),
    "gates.closed_form": Number(key=lambda r: [float(r.gates.gates[lay]) for lay in r.plan.layers], tol="gate"),
    "gates.loss_base_heldout": Number(key=lambda r: float(r.gates.loss_base_heldout), tol="loss"),
    "gates.loss_gated_heldout": Number(key=lambda r: float(r.gates.loss_gated_heldout), tol="loss"),
    "prefix.prefix_bitwise_equal": Number(key="prefix_bitwise_equal", cast=bool, tol="exact"),
    "prefix.kl_at_perturbed": Number(key=lambda r: float(r.prefix.kl[0]), tol="prefix"),
    "prefix.angle_final_mean_later": Number(key=lambda r: float(r.prefix.angle_final[1:].nanmean()), tol="prefix"),
}

#: every named number: published ids and pinned names (disjoint), one map
NUMBERS: dict[str, Number] = {**PUBLISHED, **PINNED}
assert len(NUMBERS) == len(PUBLISHED) + len(PINNED), "published ids and pinned names must not collide"


def published_value(suite: SuiteResult, number_id: str, summary: dict[str, Any] | None = None) -> Any:
    """Our value for a published number (see :data:`PUBLISHED`)."""
    return PUBLISHED[number_id].get(suite, summary)


def pinned_values(suite: SuiteResult) -> dict[str, tuple[Any, str]]:
    """``{pinned name: (value, tolerance group)}`` for every entry of :data:`PINNED`."""
    s = suite.summary()
    return {name: (n.get(suite, s), n.tol) for name, n in PINNED.items()}


def compute_pinned(
    model: Any, tokens: torch.Tensor | None = None, settings: dict[str, Any] | None = None
) -> dict[str, tuple[Any, str]]:
    """Run the suite on ``model`` with ``settings`` (default ``PINNED_SETTINGS``, SmolLM2's; Gemma:
    ``GEMMA_PINNED_SETTINGS``); ``{name: (value, tolerance group)}``.

    The names and the SuiteResult fields they read are :data:`tl_steering.suite.numbers.PINNED` (the one map
    of named numbers). Values are floats, lists of floats, ints, bools or lists of ints (layer lists).
    Timing-dependent quantities are never pinned."""
    from ..data.windows import text_windows
    from .run import run_suite

    s = PINNED_SETTINGS if settings is None else settings
    if tokens is None:
        tokens = text_windows(model, source=s["text"], n_windows=s["windows"], length=s["length"], seed=s["seed"])
    pinned = SuiteSettings(
        stages=["checks", "deficit", "ablation", "diversity", "defect", "gates", "prefix"],
        windows=s["windows"], length=s["length"], n_bootstrap=0,
        ablation_variants=list(s["ablation_variants"]),
        diversity_ablations=list(s["diversity_ablations"]),
        diversity_gains=[], defect_evaluate=False, defect_brackets=False, defect_timing=False,
        defect_gold_layers=list(s["defect_gold_layers"]),
        defect_gold_k_values=[0, 2],
        plan_k=s["defect_k"],
        prefix_layer=s["prefix_layer"],
        prefix_positions=list(s["prefix_positions"]),
        prefix_eps=s["prefix_eps"])
    suite = run_suite(model, tokens, pinned, progress=False, seed=s["seed"])
    return pinned_values(suite)


__all__ = ["NUMBERS", "PINNED", "PUBLISHED", "Number", "compute_pinned", "pinned_values", "published_value"]
