"""The claims of the suite's own records (the executor's timing, the chosen plan, the measured parallel forward) and
the collection of every section's claim (:func:`suite_claims`, ``SuiteResult.claims()``; docs/suite.md, "Claims")."""

import dataclasses
import math
from typing import Any

from .._util.claims import Claim, as_number, fmt, plural, sgn
from ..parallel.defect_result import ordering_claim
from ..reference import paper_statement

_TIMING_VERDICTS = {"faster": "holds", "slower": "does not hold", "within noise": "undecided"}


def timing_claim(ex: Any) -> Claim:
    """Ours: the plan's whole parallel forward is faster than the original's (an ``ExecutorTiming``; docs/suite.md,
    "Verdicts"). ``parts["status"]``: "faster", "slower", "within noise" or "not judged" (fewer than 3 rounds, no
    finite interval or no run); ``parts["speedup"]``: the speedup and its interval as text."""
    s = as_number(ex.measured_speedup)
    lo, hi = (as_number(x) for x in ex.speedup_interval)
    clo, chi = (as_number(x) for x in ex.speedup_control_interval)
    status, speed = "not judged", f"{fmt(s)} [{fmt(lo)}, {fmt(hi)}]"
    if ex.status != "ok":
        why = f"{ex.status}: {ex.reason}"
    elif not ex.rounds or not (math.isfinite(s) and math.isfinite(lo) and math.isfinite(hi)):
        why = f"{fmt(s)} (one median per model, no spread: not judged)"
    elif ex.rounds < 3:
        why = f"{fmt(s)} ({ex.rounds} alternating rounds: too few for an interval, not judged)"
    else:
        has_control = math.isfinite(clo) and math.isfinite(chi)
        overlap = lo <= 1.0 <= hi or (has_control and lo <= chi and clo <= hi)
        status = "within noise" if overlap else "faster" if lo > 1.0 else "slower"
        cov = as_number(ex.speedup_coverage)
        level = f"{cov:.0%} interval, " if math.isfinite(cov) else ""
        ctrl = (f"; A/A control {fmt(ex.speedup_control)} [{fmt(clo)}, {fmt(chi)}]" if has_control else
                "; no A/A control")
        why = f"{speed} ({level}median of {ex.rounds} alternating rounds{ctrl}): {status}"
    return Claim("the plan's whole parallel forward is faster than the original's",
                 _TIMING_VERDICTS.get(status, "not judged"), why, value=s, interval=(lo, hi), by="ours",
                 parts={"status": status, "speedup": speed})


def plan_choice_claim(pc: Any) -> Claim:
    """Ours: a plan chosen by cheap scores with a fitted correction loses less held out than the paper's lowest-C
    plan on the same windows (a ``PlanChoice``; holds when the ratio is below 1)."""
    statement = "a plan chosen by cheap scores with a fitted correction should lose less than the paper's lowest-C plan"
    p, ratio = pc.plan, as_number(pc.ratio_to_lowest_c)
    if p is None:
        return Claim(statement, "not judged", "no plan was chosen: not judged", by="ours")
    verdict = "not judged" if not math.isfinite(ratio) else "holds" if ratio < 1 else "does not hold"
    vs = "not compared with the lowest-C plan" if verdict == "not judged" else (
        f"{fmt(ratio)}x the lowest-C plan's {sgn(pc.lowest_c_held_out_delta_ce)} on the same windows: "
        f"{'better' if ratio < 1 else 'no better'}")
    corr = f"{p.refit} correction" if p.refit != "none" else "no correction"
    return Claim(statement, verdict, f"the chosen plan ({p.strategy}, {corr}, {plural(p.k, 'layer')}) costs ΔCE "
                 f"{sgn(p.held_out_delta_ce)} nats held out, {vs}", value=ratio, by="ours")


def _phrase(c: Claim) -> str:
    status, of = c.parts["status"], " of the original" if c.parts["status"] == "within noise" else ""
    return f"not judged ({c.why})" if status == "not judged" else f"{status}{of} (speedup {c.parts['speedup']})"


def parallel_claim(r: Any) -> Claim:
    """The paper's speedup claim against the measured whole forward of the lowest-C plan (``r.executor``) and of the
    chosen plan (``r.executor_choice``), with the critical-path estimate (``r.speedup``: a model, not judged); the
    verdict is the lowest-C plan's :func:`timing_claim`."""
    ex = r.executor
    lowest = timing_claim(ex)
    shape = f" (forwards of {' x '.join(str(n) for n in ex.timing_shape)} tokens)" if ex.timing_shape else ""
    why = (f"measured on {ex.device or 'this machine'} against the original{shape}, the lowest-C plan's whole "
           f"forward is {_phrase(lowest)}")
    if r.executor_choice is not None:
        why += f", the chosen plan's {_phrase(timing_claim(r.executor_choice))}"
    if r.speedup is not None and math.isfinite(as_number(r.speedup.speedup)):
        why += (f", and the critical-path estimate from this machine's sub-module median times is "
                f"{fmt(r.speedup.speedup)}x (a model, no interval)")
    return dataclasses.replace(lowest, statement=paper_statement("parallel"), why=why, by="paper")


def _defect(r: Any) -> Claim:
    p = r.plan
    if p is None:
        return ordering_claim(0, 0, math.nan, math.nan, missing="no plan was made: not judged")
    return ordering_claim(p.k, p.n_candidates, p.delta_ce_lowest, p.delta_ce_highest, p.strategy)


#: report section -> (the SuiteResult field that must be set, its claim); the others: the result's own ``claim()``
_OWN = {"defect": ("defect", _defect), "plan_choice": ("plan_choice", lambda r: plan_choice_claim(r.plan_choice)),
        "parallel": ("executor", parallel_claim)}
SECTIONS = ("deficit", "ablation", "diversity", "defect", "plan_choice", "parallel", "gates", "critical", "prefix")


def suite_claims(r: Any) -> dict[str, Claim]:
    """``{section: Claim}`` for every section of :data:`SECTIONS` whose stage ran; a result that lacks what a claim
    reads (an older or foreign file) gets a not-judged claim saying so, never an error."""
    out = {}
    for key in SECTIONS:
        field, claim = _OWN.get(key, (key, lambda r, key=key: getattr(r, key).claim()))
        if getattr(r, field, None) is not None:
            try:
                out[key] = claim(r)
            except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
                why = f"this result lacks what the verdict reads ({type(e).__name__}: {e})"
                out[key] = Claim("", "not judged", why)
    return out


__all__ = ["SECTIONS", "parallel_claim", "plan_choice_claim", "suite_claims", "timing_claim"]
