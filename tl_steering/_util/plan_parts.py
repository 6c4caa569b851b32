"""The parts of a :class:`~tl_steering.parallel.plan_result.ParallelPlan`'s fitted correction (:class:`PlanPart`),
and the check that a call was given all of them (:func:`check_complete`; why: docs/parallel.md, "Refit")."""

from collections.abc import Mapping
from typing import Any

from ..errors import InputError

#: the parts of each refit's correction, in call-argument names
REQUIRED_PARTS: dict[str, tuple[str, ...]] = {"none": (), "gate": ("gates",), "affine": ("gates", "biases"),
                                             "linear": ("gates", "biases", "linears")}
_SOURCE = {"gates": "plan.corrections()[0]", "biases": "plan.corrections()[1]", "linears": "plan.linear_maps()"}


class PlanPart(dict):
    """A ``{layer: value}`` dict that is one part (``"gates"``, ``"biases"`` or ``"linears"``) of the fitted
    correction of a plan with refit ``refit`` and layers ``layers``. It behaves as the plain dict it is."""

    def __init__(self, items: Mapping[int, Any], part: str, refit: str, layers: list[int]):
        super().__init__(items)
        self.part, self.refit, self.layers = part, refit, list(layers)

    def __repr__(self) -> str:
        return f"PlanPart({self.part} of a refit={self.refit!r} plan, {dict.__repr__(self)})"


def check_complete(caller: str, gates: Mapping | None, biases: Mapping | None, linears: Mapping | None,
                   whole: str = "parallelize(model, plan)") -> None:
    """Raise :class:`InputError` when the arguments hold some parts of a plan's correction but not all of them;
    ``whole`` is the call that takes the plan itself (named in the error)."""
    given = {"gates": gates, "biases": biases, "linears": linears}
    tagged = [v for v in given.values() if isinstance(v, PlanPart)]
    if not tagged:
        return
    refits = {v.refit for v in tagged}
    if len(refits) > 1:
        raise InputError(f"{caller}: the corrections come from plans with different refits ({sorted(refits)}); "
                         "pass the parts of ONE plan (or the plan itself)")
    refit = refits.pop()
    # an empty part is still given (refit="gate" has no biases: corrections() returns {} for them)
    missing = [p for p in REQUIRED_PARTS.get(refit, ()) if given[p] is None]
    if missing:
        what = ", ".join(f"{p}={_SOURCE[p]}" for p in missing)
        raise InputError(
            f"{caller}: given part of a refit={refit!r} plan's correction without its {' and '.join(missing)}; the "
            f"blocks would run a partial correction, not the fitted one (it can be worse than no correction). Pass "
            f"the plan itself, {whole} (its layers and every fitted correction), or add {what}")


__all__ = ["PlanPart", "REQUIRED_PARTS", "check_complete"]
