"""A census of a field's equilibria that can decide "mostly saddles" (docs/critical_points.md section 11): an upper
bound on the attractors and repellers (Chao1 of how often the power rows of F and -F from independent uniform starts
reached each) against the saddles found, a lower bound; "supported" when the saddles outnumber that upper bound,
else "not decided" (never "rejected")."""

import dataclasses
import math
from typing import Any

from .._util.claims import Claim, pct
from ..errors import InputError
from ..reference import paper_statement
from ..results import Result, register
from ..stats import chao1
from .finder import find_equilibria
from .options import CENSUS_LANDSCAPE_SOLVES, FinderOptions, finder_options
from .results import EquilibriaResult


def _abundance(res: EquilibriaResult, label: str) -> list[int]:
    """Per point of ``label``, the power-iteration rows of its sign (F for attractors, -F for repellers: the random
    starts' samples of that map's basins) that reached it; a point found only otherwise (the other sign's rows,
    the landscape) counts once, as a singleton (which raises the estimate)."""
    kinds, rows = res.options.get("row_kind", []), res.options.get("row_point", [])
    tag = "/power+" if label == "attractor" else "/power-"
    hits = [0] * res.n_points
    for kind, p in zip(kinds, rows):
        if p >= 0 and kind.endswith(tag):
            hits[p] += 1
    return [max(1, hits[i]) for i, lab in enumerate(res.labels) if lab == label]


@register
@dataclasses.dataclass
class CensusResult(Result):
    """The census of one field (module docstring; fields: docs/critical_points.md section 11, "Result fields")."""

    equilibria: EquilibriaResult = dataclasses.field(default_factory=EquilibriaResult)
    attractors: dict[str, float] = dataclasses.field(default_factory=dict)
    repellers: dict[str, float] = dataclasses.field(default_factory=dict)
    saddles: int = 0
    degenerate: int = 0
    non_saddles_high: float = math.nan
    share_low: float = math.nan
    verdict: str = "no equilibria"
    level: float = 0.95
    assumptions: str = ""

    kind = "census"

    def summary(self) -> dict[str, Any]:
        return {"points": self.equilibria.n_points, "saddles_found": self.saddles,
                "attractors_found": int(self.attractors.get("observed", 0)),
                "attractors_estimate": self.attractors.get("estimate"), "attractors_high": self.attractors.get("ci_high"),
                "repellers_found": int(self.repellers.get("observed", 0)),
                "repellers_estimate": self.repellers.get("estimate"), "repellers_high": self.repellers.get("ci_high"),
                "degenerate": self.degenerate, "non_saddles_high": self.non_saddles_high,
                "share_low": self.share_low, "verdict": self.verdict, "level": self.level}

    def claim(self) -> Claim:
        """The paper's claim judged by the census: "mostly saddles" holds when the saddles found outnumber the upper
        bound on every other equilibrium; any attractor found contradicts "not attractors" (then "partly holds")."""
        n_attr = int(self.attractors.get("observed", 0))
        if self.equilibria.n_points == 0:
            return Claim(paper_statement("critical"), "not judged", "no equilibrium was found: not judged",
                         parts=self.summary())
        bound = (f"{self.saddles} saddles found, at most {self.non_saddles_high:.1f} attractors, repellers and "
                 f"degenerate points ({self.level:.0%} upper bound): saddles are at least {pct(self.share_low)}")
        if self.verdict != "supported":
            verdict, why = "undecided", f"'mostly saddles' is not decided: {bound}"
        else:
            verdict = "partly holds" if n_attr else "holds"
            why = f"'mostly saddles' holds: {bound}" + (f"; but {n_attr} attractors were found" if n_attr else "")
        return Claim(paper_statement("critical"), verdict, why, value=self.share_low, interval=(self.share_low, 1.0),
                     parts=self.summary())


ASSUMPTIONS = ("independent uniform starts sample the basins of the power map of F and -F with replacement; every "
               "attractor and repeller is a stable fixed point of that map (the shifted map where the plain one "
               "rotates) and has a basin; stable points whose basins the starts cannot sample are covered only "
               "statistically by the upper bound; the saddles are those found")


def census(field: Any, dim: int, n_starts: int = 64, seed: int = 0, landscape_solves: int = CENSUS_LANDSCAPE_SOLVES,
           level: float = 0.95, options: FinderOptions | dict[str, Any] | None = None) -> CensusResult:
    """The census of the equilibria of ``field`` on S^{dim-1} (module docstring).

    Args:
        field: a torch field R^d -> R^d (as :func:`find_equilibria`), e.g. ``critical_field(model, layer)``.
        dim: d.
        n_starts: independent seeded Gaussian starts (the power iteration of F and of -F from each).
        seed: their seed.
        landscape_solves: Newton solves of the landscape phase (the saddle search; every one found raises the lower
            bound, so the default is find_equilibria's full budget).
        level: level of the upper bounds on attractors and repellers.
        options: the finder's options (:class:`~tl_steering.critical.options.FinderOptions`; None: the default
            every entry point uses); ``landscape_solves`` replaces its budget."""
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0.0 < float(level) < 1.0:
        raise InputError(f"level must be in (0, 1), got {level!r}")
    opts = dataclasses.replace(finder_options(options), landscape_solves=landscape_solves)
    res = find_equilibria(field, dim, n_starts=n_starts, seed=seed, options=opts)
    att, rep = chao1(_abundance(res, "attractor"), level), chao1(_abundance(res, "repeller"), level)
    saddles, degenerate = res.labels.count("saddle"), res.labels.count("degenerate")
    high = att["ci_high"] + rep["ci_high"] + degenerate
    share = saddles / (saddles + high) if saddles + high > 0 else math.nan
    verdict = "no equilibria" if res.n_points == 0 else "supported" if saddles > high else "not decided"
    return CensusResult(provenance=res.provenance, equilibria=res, attractors=att, repellers=rep, saddles=saddles,
                        degenerate=degenerate, non_saddles_high=high, share_low=share, verdict=verdict,
                        level=float(level), assumptions=ASSUMPTIONS)


__all__ = ["ASSUMPTIONS", "CensusResult", "census"]
