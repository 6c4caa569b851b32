"""The report's verdicts (:func:`band_verdict`, :func:`timing_verdict`, :func:`section_verdicts`), pure functions of
the numbers of a :class:`~tl_steering.suite.SuiteResult`, never a fixed text (docs/suite.md, "Verdicts")."""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from ..suite import SuiteResult


def _num(x: Any) -> float:
    """``x`` as a float (NaN for None, a bool or anything that is not a number)."""
    if x is None or isinstance(x, bool):
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def fmt(x: Any, digits: int = 3) -> str:
    """A number as short text: ``digits`` significant digits, ``n/a`` for NaN / None."""
    v = _num(x)
    return "n/a" if not math.isfinite(v) else f"{v:.{digits}g}"


def sgn(x: Any) -> str:
    """A signed number (a loss change): ``+0.123``, ``-0.0456``, ``n/a``."""
    v = _num(x)
    return "n/a" if not math.isfinite(v) else f"{v:+.3g}"


def span(lo: Any, hi: Any) -> str:
    """``lo–hi``, ``≥ lo`` or ``≤ hi`` (a band or range with an open end)."""
    if lo is None and hi is None:
        return "any value"
    if hi is None:
        return f"≥ {fmt(lo, 4)}"
    if lo is None:
        return f"≤ {fmt(hi, 4)}"
    return f"{fmt(lo, 4)}–{fmt(hi, 4)}"


def _n(k: int, noun: str) -> str:
    """``1 layer``, ``3 layers``."""
    return f"{k} {noun}" + ("" if k == 1 else "s")


def _inside(v: float, lo: Any, hi: Any) -> bool:
    return (lo is None or v >= lo) and (hi is None or v <= hi)


# ----------------------------------------------------------------------------------------------------------
# one published number


@dataclasses.dataclass(frozen=True)
class BandVerdict:
    """Our value against one published number.

    Attributes:
        status: ``"inside range"``, ``"outside range"``, ``"inside band"``, ``"outside band"``, ``"holds"``,
            ``"does not hold"`` or ``"not judged"``.
        reference: what the verdict used: ``"paper's range"``, ``"tolerance band"``, ``"shape"`` or ``""``.
        text: the sentence for the page (plain text).
    """

    status: str
    reference: str
    text: str

    @property
    def ok(self) -> bool | None:
        """True inside / holds, False outside / does not hold, None when not judged."""
        if self.status == "not judged":
            return None
        return self.status in ("inside range", "inside band", "holds")


def band_verdict(ours: Any, paper_range: Any = None, band: Any = None, paper_number: Any = None) -> BandVerdict:
    """Our value ``ours`` against a published number.

    The paper's published range (``paper_range``, ``[lo, hi]``) decides where there is one: a value outside it is
    "outside the paper's range" even when the wider tolerance band holds it (the band is named beside it). Without a
    range, the tolerance band (``band``, ``[lo, hi]``, either end None) of the paper's single number
    (``paper_number``) or threshold decides. A bool is a shape target: "holds" / "does not hold".
    """
    if isinstance(ours, bool):
        return BandVerdict("holds" if ours else "does not hold", "shape", "holds" if ours else "does not hold")
    v = _num(ours)
    if not math.isfinite(v) or (paper_range is None and band is None):
        return BandVerdict("not judged", "", "not judged")
    if paper_range is not None:
        lo, hi = paper_range
        if _inside(v, lo, hi):
            return BandVerdict("inside range", "paper's range", f"inside the paper's range {span(lo, hi)}")
        where = "above" if hi is not None and v > hi else "below"
        text = f"outside the paper's range {span(lo, hi)}, {where} it"
        if band is not None:
            text += ("; inside" if _inside(v, *band) else "; also outside") + f" the tolerance band {span(*band)}"
        return BandVerdict("outside range", "paper's range", text)
    around = f" around the paper's {fmt(paper_number)}" if paper_number is not None else ""
    if _inside(v, *band):
        return BandVerdict("inside band", "tolerance band", f"inside the tolerance band {span(*band)}{around}")
    return BandVerdict("outside band", "tolerance band", f"outside the tolerance band {span(*band)}{around}")


#: published numbers that are a timing of ours with no interval: their band is shown for orientation, not judged
UNJUDGED_TIMINGS = ("parallel_gpt2_large_speedup",)


def row_verdict(row: dict[str, Any]) -> BandVerdict:
    """:func:`band_verdict` of one row of :func:`tl_steering.report.comparison.comparison_rows` (a timing estimate with no
    interval, :data:`UNJUDGED_TIMINGS`, is "not judged": where it falls is said, for orientation)."""
    if not row.get("regress", True) or row.get("id") == "deficit_order_gpt2_llama":
        return BandVerdict("not judged", "", "not judged")
    v = band_verdict(row.get("ours"), row.get("paper_range"), row.get("band"), row.get("paper_number"))
    if row.get("id") in UNJUDGED_TIMINGS and v.status != "not judged":
        return BandVerdict("not judged", v.reference, f"not judged: one estimate from sub-module median times with "
                                                      f"no interval ({v.text}, for orientation only)")
    return v


# ----------------------------------------------------------------------------------------------------------
# timings


@dataclasses.dataclass(frozen=True)
class TimingVerdict:
    """A measured speedup against the noise of its measurement.

    Attributes:
        status: ``"within noise"``, ``"faster"``, ``"slower"`` or ``"not judged"`` (no rounds: one median each).
        text: the speedup with its interval, the A/A control's, and the status (plain text).
    """

    status: str
    text: str


def timing_verdict(speedup: Any, interval: Any, control: Any = None, speedup_control_interval: Any = None,
                   rounds: int = 0, coverage: Any = None) -> TimingVerdict:
    """The verdict on a speedup measured as the median of paired ratios over ``rounds`` alternating rounds.

    "within noise" when its interval holds 1 or overlaps the A/A control's interval (the baseline timed against
    itself the same way); else "faster" (interval above 1) or "slower" (below 1). Without rounds or a finite
    interval: "not judged" (a single median has no spread).
    """
    s = _num(speedup)
    lo, hi = (_num(x) for x in (interval if interval is not None else (math.nan, math.nan)))
    if not rounds or not (math.isfinite(s) and math.isfinite(lo) and math.isfinite(hi)):
        return TimingVerdict("not judged", f"{fmt(s)} (one median per model, no spread: not judged)")
    if rounds < 3:
        return TimingVerdict("not judged", f"{fmt(s)} ({rounds} alternating rounds: too few for an interval, "
                                           "not judged)")
    clo, chi = (_num(x) for x in (speedup_control_interval if speedup_control_interval is not None else (math.nan, math.nan)))
    has_control = math.isfinite(clo) and math.isfinite(chi)
    if lo <= 1.0 <= hi or (has_control and lo <= chi and clo <= hi):
        status = "within noise"
    else:
        status = "faster" if lo > 1.0 else "slower"
    cov = _num(coverage)
    level = f"{cov:.0%} interval, " if math.isfinite(cov) else ""
    ctrl = f"; A/A control {fmt(control)} [{fmt(clo)}, {fmt(chi)}]" if has_control else "; no A/A control"
    return TimingVerdict(status, f"{fmt(s)} [{fmt(lo)}, {fmt(hi)}] ({level}median of {rounds} alternating rounds"
                                 f"{ctrl}): {status}")


def executor_verdict(ex: Any) -> TimingVerdict:
    """:func:`timing_verdict` of an :class:`~tl_steering.suite.result.ExecutorTiming` (a skipped or unsupported
    plan: ``not judged`` with the reason)."""
    if ex is None:
        return TimingVerdict("not judged", "not run")
    if ex.status != "ok":
        return TimingVerdict("not judged", f"{ex.status}: {ex.reason}")
    return timing_verdict(ex.measured_speedup, getattr(ex, "speedup_interval", None),
                          getattr(ex, "speedup_control", None), getattr(ex, "speedup_control_interval", None),
                          getattr(ex, "rounds", 0), getattr(ex, "speedup_coverage", None))


def median_spread(times: list[float]) -> str:
    """``median [low, high] s`` of a list of seconds (the order-statistic interval of the median)."""
    from ..stats import median_interval

    if not times:
        return "n/a"
    m, lo, hi, _ = median_interval(times)
    return f"{m:.4g} s [{lo:.4g}, {hi:.4g}]"


# ----------------------------------------------------------------------------------------------------------
# one sentence per section


def _published() -> dict[str, dict[str, Any]]:
    from ..reference import published_numbers

    return {p["id"]: p for p in published_numbers()}


def _pv(number_id: str, r: SuiteResult) -> Any:
    from ..suite import published_value

    try:
        return published_value(r, number_id)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if math.isfinite(x) else "n/a"


def deficit_sentence(r: SuiteResult) -> str:
    pub = _published()
    lo, hi = pub["deficit_gpt2"]["value"], pub["deficit_llama3_8b"]["value"]
    d = r.deficit
    m = _num(d.mean)
    ci = list(d.mean_ci) if d.mean_ci is not None else [math.nan, math.nan]
    where = ("between the paper's GPT-2 and Llama-3-8B values" if lo <= m <= hi else
             "below the paper's GPT-2 value" if m < lo else "above the paper's Llama-3-8B value")
    f = _num(d.ffn_contribution_mean)
    ffn = (f"adding the FFN improves the one-step angular prediction by {_pct(f)}" if f > 0 else
           f"adding the FFN does not improve the one-step angular prediction ({_pct(f)})" if math.isfinite(f) else
           "the FFN's one-step contribution is not available")
    return (f"The paper: attention alone misses part of each block's change of direction, more in larger models "
            f"(mean deficit {fmt(lo)} on GPT-2, {fmt(hi)} on Llama-3-8B), and the FFN steers the rest; here the mean "
            f"deficit is {fmt(m)} (95% CI [{fmt(ci[0])}, {fmt(ci[1])}]), {where}, and {ffn}.")


def ablation_sentence(r: SuiteResult) -> str:
    pub = _published()
    tr, rr = pub["ablation_tangential"]["range"], pub["ablation_radial"]["range"]
    dl = r.ablation.delta_loss
    tan, rad, zero = (_num(dl.get(k)) for k in ("tangential", "radial", "zero"))
    vt = band_verdict(tan, tr, pub["ablation_tangential"]["band"])
    vr = band_verdict(rad, rr, pub["ablation_radial"]["band"])
    if not (math.isfinite(tan) and math.isfinite(rad)):
        verdict = "not judged (a variant was not run)"
    elif tan >= rad:
        verdict = "the claim does not hold: tangential-only is not cheaper than radial-only"
    elif tan <= tr[1]:
        verdict = f"the claim holds: tangential-only costs {fmt(rad / tan if tan > 0 else math.inf)}x less"
    else:
        verdict = ("the ordering holds (tangential-only is cheaper) but the tangential part does not preserve the "
                   "model's quality as the paper says")
    zero_txt = f", zero FFN {sgn(zero)}" if math.isfinite(zero) else ""
    return (f"The paper: keeping only the tangential part of every FFN write preserves most of the model's quality "
            f"(ΔCE {span(*tr)} nats over its models) while keeping only the radial part collapses it ({span(*rr)} "
            f"nats, like removing the FFN); here tangential-only costs {sgn(tan)} nats ({vt.text}) and radial-only "
            f"{sgn(rad)} ({vr.text}){zero_txt}: {verdict}.")


def diversity_sentence(r: SuiteResult) -> str:
    pub = _published()
    att, ffn = _pv("diversity_attention_contracts", r), _pv("diversity_ffn_restores", r)
    tan = _pv("diversity_tangential_preserves", r)
    va = band_verdict(att, None, pub["diversity_attention_contracts"]["band"])
    vf = band_verdict(ffn, None, pub["diversity_ffn_restores"]["band"])
    vt = band_verdict(tan)
    parts = [v.ok for v in (va, vf, vt)]
    held = sum(1 for p in parts if p)
    judged = sum(1 for p in parts if p is not None)
    tan_txt = ("closer to the clean model's than the radial-only model's" if tan is True else
               "not closer to the clean model's than the radial-only model's" if tan is False else "not compared")
    verdict = ("the claim holds" if judged and held == judged else
               "the claim does not hold" if judged and held == 0 else f"{held} of {judged} parts hold")
    return (f"The paper: attention usually contracts the token directions, the FFN often restores their diversity, "
            f"and the tangential part preserves it; here attention concentrates the directions in {_pct(_num(att))} "
            f"of the layers ({'most' if va.ok else 'not most'}), the FFN diversifies them in {_pct(_num(ffn))} "
            f"({'at least a quarter' if vf.ok else 'fewer than a quarter'}), and the tangential-only model's final "
            f"diversity is {tan_txt}: {verdict}.")


def defect_sentence(r: SuiteResult) -> str:
    pub = _published()
    p = pub["parallel_gpt2_large_delta_ce"]
    thr = pub["parallel_gpt2_large_high_defect_degrades"]["band"][0]
    plan = r.plan
    if plan is None:
        return ("The paper: the layers of lowest defect C can run in parallel at a small cost; here no plan was "
                "made: not judged.")
    lo, ratio = _num(plan.delta_ce_lowest), _num(plan.high_over_low)
    vd = band_verdict(lo, None, p["band"], p["value"])
    which = "lowest-C" if plan.strategy == "lowest_C" else f"{plan.strategy}-chosen"
    hi = _num(plan.delta_ce_highest)
    if math.isinf(ratio):
        order = f"the {_n(plan.k, 'highest-C layer')} cost {hi:+.3g} nats while the plan costs nothing (the ordering holds)"
    elif not math.isfinite(ratio):
        order = "the highest-C control was not measured"
    elif ratio >= thr:
        order = f"the {_n(plan.k, 'highest-C layer')} cost {fmt(ratio)}x as much (at least {fmt(thr)}x: the ordering holds)"
    elif ratio > 1:
        order = (f"the {_n(plan.k, 'highest-C layer')} cost only {fmt(ratio)}x as much (below the {fmt(thr)}x threshold "
                 f"[I]: weaker than the paper's sharp degradation)")
    else:
        order = f"the {_n(plan.k, 'highest-C layer')} cost {fmt(ratio)}x as much (not more: the ordering does not hold)"
    return (f"The paper: the layers of lowest defect C can run in parallel at a small cost (ΔCE {sgn(p['value'])} "
            f"nats with {p.get('k', 18)} of GPT-2-large's {p.get('n_layers', 36)} layers) while the highest-C layers "
            f"degrade sharply; here the {plan.k} {which} of {_n(plan.n_candidates, 'layer')} cost ΔCE {lo:+.3g} nats "
            f"({vd.text}), and {order}.")


def plan_choice_sentence(r: SuiteResult) -> str:
    pc = r.plan_choice
    p = pc.plan if pc is not None else None
    if p is None:
        return "Ours, not the paper's: a cheap planner with a fitted correction; no plan was chosen: not judged."
    held, low, ratio = _num(p.held_out_delta_ce), _num(pc.lowest_c_held_out_delta_ce), _num(pc.ratio_to_lowest_c)
    if not math.isfinite(ratio):
        verdict = "not compared with the lowest-C plan"
    elif ratio < 1:
        verdict = f"{fmt(ratio)}x the lowest-C plan's {sgn(low)} on the same windows: better"
    else:
        verdict = f"{fmt(ratio)}x the lowest-C plan's {sgn(low)} on the same windows: no better"
    corr = f"{p.refit} correction" if p.refit != "none" else "no correction"
    return (f"Ours, not the paper's claim [ours]: a plan chosen by cheap scores with a fitted correction should lose "
            f"less than the paper's lowest-C plan; here the chosen plan ({p.strategy}, {corr}, {_n(p.k, 'layer')}) costs "
            f"ΔCE {sgn(held)} nats held out, {verdict}.")


def parallel_sentence(r: SuiteResult) -> str:
    pub = _published()["parallel_gpt2_large_speedup"]
    v = executor_verdict(r.executor)
    out = (f"The paper: making 18 of GPT-2-large's 36 layers parallel would speed a forward up by about "
           f"{fmt(pub['value'])}x (an estimate from sub-module times on a GPU, not a measured forward); here, "
           f"measured on {r.executor.device or 'this machine'} against the original{_shape(r.executor)}, the "
           f"lowest-C plan's whole forward is {_status_phrase(v)}")
    if r.executor_choice is not None:
        out += f", the chosen plan's {_status_phrase(executor_verdict(r.executor_choice))}"
    if r.speedup is not None and math.isfinite(_num(r.speedup.speedup)):
        out += (f", and the critical-path estimate from this machine's sub-module median times is "
                f"{fmt(r.speedup.speedup)}x (a model, no interval)")
    return out + "."


def _shape(ex: Any) -> str:
    shape = list(getattr(ex, "timing_shape", []) or [])
    return f" (forwards of {' x '.join(str(n) for n in shape)} tokens)" if shape else ""


def _status_phrase(v: TimingVerdict) -> str:
    head = v.text.split(" (", 1)[0]
    return {"within noise": f"within noise of the original (speedup {head})",
            "faster": f"faster (speedup {head})",
            "slower": f"slower (speedup {head})"}.get(v.status, f"not judged ({v.text})")


def gates_sentence(r: SuiteResult) -> str:
    s = r.gates.summary()
    base, gated, frac = (_num(s.get(k)) for k in ("delta_ce_base_heldout", "delta_ce_gated_heldout",
                                                  "recovered_fraction_heldout"))
    calib = _num(s.get("improvement_calib"))
    claim = ("Ours, not the paper's claim [ours]: one scalar gate per parallel FFN, fitted on calibration windows, "
             "should recover part of the plan's loss; here")
    if not s.get("n_gates"):
        return f"{claim} no gate was fitted (the plan is empty): not judged."
    if not math.isfinite(frac):
        return f"{claim} the recovered fraction is not defined (the plan costs nothing held out): not judged."
    move = f"ΔCE held out {base:+.3g} → {gated:+.3g}"
    if frac <= 0:
        fit = f" although they lower the calibration loss by {fmt(calib)} nats" if calib > 0 else ""
        return (f"{claim} the gates do not recover the loss held out: they make it worse ({move}, recovered "
                f"fraction {frac:.3g}){fit}.")
    return f"{claim} the gates recover {_pct(frac)} of the plan's loss held out ({move})."


def critical_sentence(r: SuiteResult) -> str:
    """The paper's claim in its three parts (``CriticalPointsResult.claim()``): "not attractors" is decided by one
    verified attractor, "rotational modes" by the share of points with one, "mostly saddles" by no sample here
    (the found set's fraction and why it does not decide are given; docs/critical_points.md section 4)."""
    cr = r.critical
    c = cr.claim()
    n = int(cr.n_points.sum())
    claim = ("The paper: the FFN field's equilibria on the sphere are mostly saddles with rotational modes, not "
             "attractors; here")
    if n == 0:
        return f"{claim} no equilibrium was found on layers {list(cr.layers)}: not judged."
    na = c["not_attractors"]
    if na["attractors"]:
        attr = (f"'not attractors' fails: {_n(na['attractors'], 'verified attractor')} on "
                f"{len(na['layers_with_attractor'])} of {_n(na['n_layers'], 'layer')}")
    else:
        attr = "'not attractors' is not contradicted: no attractor in this sample"
    rm = c["rotational_modes"]
    rot = (f"rotational modes: {rm['rotational']} of {n} points ({_pct(rm['fraction'])}, 95% CI "
           f"[{_pct(rm['ci_low'])}, {_pct(rm['ci_high'])}]: {rm['verdict']})")
    p = c["pooled"]
    sad = (f"'mostly saddles' is not decided by this sample: {p['saddles']} of {n} found are saddles "
           f"({_pct(p['fraction'])}, 95% CI [{_pct(p['ci_low'])}, {_pct(p['ci_high'])}]), but {c['why_undecided']}")
    miss = c["parity"]["missing_at_least"]
    par = (f"; by the Poincaré-Hopf parity at least {miss} equilibri{'um' if miss == 1 else 'a'} went unfound"
           if miss else "")
    return f"{claim} {attr}; {rot}; {sad}{par}."


def prefix_sentence(r: SuiteResult) -> str:
    p = r.prefix
    s = p.summary()
    bitwise, max_angle = bool(s.get("prefix_bitwise_equal")), _num(s.get("prefix_max_angle"))
    if bitwise:
        before = "every earlier position is bit-identical: the claim holds"
    elif math.isfinite(max_angle) and max_angle < 1e-6:
        before = f"earlier positions move by at most {max_angle:.2g} rad (rounding): the claim holds"
    else:
        before = f"earlier positions move by up to {fmt(max_angle)} rad: the claim does not hold"
    later = _num(s.get("angle_final_mean_later"))
    later_txt = f"; later positions move by {fmt(later)} rad on average at the last layer" if math.isfinite(later) \
        else ""
    return (f"The paper: the dynamics are causal and prefix-indexed, so a perturbation at position j leaves every "
            f"earlier position unchanged; here, perturbing layer {p.perturb_layer} at positions {list(p.positions)}, "
            f"{before}{later_txt}.")


#: page section -> its sentence (the sections of tl_steering.report.page.SECTIONS, and "parallel")
SENTENCES: dict[str, Callable[[SuiteResult], str]] = {
    "deficit": deficit_sentence,
    "ablation": ablation_sentence,
    "diversity": diversity_sentence,
    "defect": defect_sentence,
    "plan_choice": plan_choice_sentence,
    "parallel": parallel_sentence,
    "gates": gates_sentence,
    "critical": critical_sentence,
    "prefix": prefix_sentence,
}

#: the result field each sentence needs (None there: no sentence)
_NEEDS = {"parallel": "executor"}


def section_verdicts(r: SuiteResult) -> dict[str, str]:
    """``{section: sentence}`` for every section whose stage ran (plain text; see :data:`SENTENCES`); a result that
    lacks a number a sentence reads gets a sentence saying so, never a page that fails to render."""
    out = {}
    for key, fn in SENTENCES.items():
        if getattr(r, _NEEDS.get(key, key), None) is None:
            continue
        try:
            out[key] = fn(r)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:  # a result saved without a field
            out[key] = f"No verdict: this result lacks what the verdict reads ({type(e).__name__}: {e})."
    return out


__all__ = [
    "SENTENCES",
    "BandVerdict",
    "TimingVerdict",
    "band_verdict",
    "executor_verdict",
    "median_spread",
    "row_verdict",
    "section_verdicts",
    "timing_verdict",
]
