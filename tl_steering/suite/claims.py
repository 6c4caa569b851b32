"""The claims of the suite's own records (the executor's timing, the chosen plan, the measured parallel forward) and
the collection of every section's claim (:func:`suite_claims`, ``SuiteResult.claims()``; docs/suite.md, "Claims")."""

import math
from typing import Any

from .._util.display import as_number, fmt, plural, sgn
from ..parallel.defect_result import ordering_claim
from ..reference import paper_statement
from ..stats import Claim

_TIMING_VERDICTS = {"faster": "holds", "slower": "does not hold", "within noise": "undecided"}


def timing_claim(ex: Any) -> Claim:
    """Ours: the plan's parallel forward is faster than the original (an ``ExecutorTiming``).

    "within noise" (undecided) when the speedup's interval holds 1 or overlaps the A/A control's interval (the
    original timed against itself the same way); else "faster" (interval above 1: holds) or "slower" (below: does
    not hold). Fewer than 3 alternating rounds, no finite interval, a skipped or unsupported plan: not judged.
    ``parts["status"]`` holds the status, ``parts["speedup"]`` the speedup with its interval as text.
    """
    statement = "the plan's whole parallel forward is faster than the original's"
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
        ctrl = f"; A/A control {fmt(ex.speedup_control)} [{fmt(clo)}, {fmt(chi)}]" if has_control else "; no A/A control"
        why = f"{speed} ({level}median of {ex.rounds} alternating rounds{ctrl}): {status}"
    return Claim(statement, _TIMING_VERDICTS.get(status, "not judged"), why, value=s, interval=(lo, hi), by="ours",
                 parts={"status": status, "speedup": speed})


def plan_choice_claim(pc: Any) -> Claim:
    """Ours: a plan chosen by cheap scores with a fitted correction loses less held out than the paper's lowest-C
    plan on the same windows (a ``PlanChoice``; holds when the ratio is below 1)."""
    statement = "a plan chosen by cheap scores with a fitted correction should lose less than the paper's lowest-C plan"
    p = pc.plan
    if p is None:
        return Claim(statement, "not judged", "no plan was chosen: not judged", by="ours")
    ratio, low = as_number(pc.ratio_to_lowest_c), pc.lowest_c_held_out_delta_ce
    if not math.isfinite(ratio):
        verdict, vs = "not judged", "not compared with the lowest-C plan"
    else:
        verdict = "holds" if ratio < 1 else "does not hold"
        vs = f"{fmt(ratio)}x the lowest-C plan's {sgn(low)} on the same windows: {'better' if ratio < 1 else 'no better'}"
    corr = f"{p.refit} correction" if p.refit != "none" else "no correction"
    return Claim(statement, verdict, f"the chosen plan ({p.strategy}, {corr}, {plural(p.k, 'layer')}) costs ΔCE "
                 f"{sgn(p.held_out_delta_ce)} nats held out, {vs}", value=ratio, by="ours")


def _phrase(c: Claim) -> str:
    status, speed = c.parts["status"], c.parts["speedup"]
    return {"within noise": f"within noise of the original (speedup {speed})", "faster": f"faster (speedup {speed})",
            "slower": f"slower (speedup {speed})"}.get(status, f"not judged ({c.why})")


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
    return Claim(paper_statement("parallel"), lowest.verdict, why, value=lowest.value, interval=lowest.interval,
                 parts=lowest.parts)


def _defect(r: Any) -> Claim:
    p = r.plan
    if p is None:
        return ordering_claim(0, 0, math.nan, math.nan, missing="no plan was made: not judged")
    return ordering_claim(p.k, p.n_candidates, p.delta_ce_lowest, p.delta_ce_highest, p.strategy)


#: report section -> (the SuiteResult field that must be set, its claim)
SECTIONS: dict[str, tuple[str, Any]] = {
    "deficit": ("deficit", lambda r: r.deficit.claim()),
    "ablation": ("ablation", lambda r: r.ablation.claim()),
    "diversity": ("diversity", lambda r: r.diversity.claim()),
    "defect": ("defect", _defect),
    "plan_choice": ("plan_choice", lambda r: plan_choice_claim(r.plan_choice)),
    "parallel": ("executor", parallel_claim),
    "gates": ("gates", lambda r: r.gates.claim()),
    "critical": ("critical", lambda r: r.critical.claim()),
    "prefix": ("prefix", lambda r: r.prefix.claim()),
}


def suite_claims(r: Any) -> dict[str, Claim]:
    """``{section: Claim}`` for every section of :data:`SECTIONS` whose stage ran; a result that lacks what a claim
    reads (an older or foreign file) gets a not-judged claim saying so, never an error."""
    out = {}
    for key, (field, claim) in SECTIONS.items():
        if getattr(r, field, None) is None:
            continue
        try:
            out[key] = claim(r)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
            out[key] = Claim("", "not judged", f"this result lacks what the verdict reads ({type(e).__name__}: {e})")
    return out


__all__ = ["SECTIONS", "parallel_claim", "plan_choice_claim", "suite_claims", "timing_claim"]
