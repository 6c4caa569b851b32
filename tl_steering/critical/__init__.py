"""Critical points of a field on the sphere: nonlinear projective equilibria, their tangent spectra, and the
"mostly saddles" claim (see docs/critical_points.md).

One finder (:data:`DEFAULT_FINDER`) with one set of settings (:data:`DEFAULT_OPTIONS`, a :class:`FinderOptions`)
is the default of every entry point:

* :mod:`.fields`: calling conventions of a field, relative residual, Householder tangent basis;
* :mod:`.dynamics`: the flow phase (power iteration, edge tracking); :mod:`.solver`: its Levenberg-Marquardt end
  game; :mod:`.landscape`: the solution-landscape phase (deflated Newton);
* :mod:`.spectrum`: tangent spectra and labels; :mod:`.results`: result classes and the claim test;
* :mod:`.finder`: :func:`find_equilibria`, :func:`classify_point` for any torch field;
* :mod:`.model`: :func:`critical_points` / :func:`critical_field` / :func:`critical_census` for TransformerLens models;
* :mod:`.census`: :func:`~.census.census`, the bounds that can decide "mostly saddles" for all equilibria of a field."""

from typing import TYPE_CHECKING

from .._util.lazy import lazy_attributes

# lazy (PEP 562): the suite's settings (read by the CLI before it imports torch or TransformerLens) import .options
_LAZY = {
    **{n: ".fields" for n in ("relative_residual",)},
    **{n: ".finder" for n in ("classify_point", "find_equilibria")},
    **{n: ".model" for n in ("FIELDS", "CriticalField", "critical_census", "critical_field", "critical_points")},
    **{n: ".options" for n in ("DEFAULT_FINDER", "DEFAULT_OPTIONS", "METHODS", "FinderOptions")},
    **{n: ".results" for n in ("CensusResult", "CriticalPointsResult", "EquilibriaResult", "PointClassification",
                               "clopper_pearson", "saddle_verdict")},  # census(): the module tl_steering.critical.census
    **{n: ".spectrum" for n in ("DENSE_MAX_DIM", "LABELS")}}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

if TYPE_CHECKING:
    from .fields import relative_residual  # noqa: F401
    from .finder import classify_point, find_equilibria  # noqa: F401
    from .model import FIELDS, CriticalField, critical_census, critical_field, critical_points  # noqa: F401
    from .options import DEFAULT_FINDER, DEFAULT_OPTIONS, METHODS, FinderOptions  # noqa: F401
    from .results import (CensusResult, CriticalPointsResult, EquilibriaResult, PointClassification,  # noqa: F401
                          clopper_pearson, saddle_verdict)
    from .spectrum import DENSE_MAX_DIM, LABELS  # noqa: F401

__all__ = [
    "DEFAULT_FINDER", "DEFAULT_OPTIONS", "DENSE_MAX_DIM", "FIELDS", "LABELS", "METHODS", "CensusResult",
    "CriticalField", "CriticalPointsResult", "EquilibriaResult", "FinderOptions", "PointClassification",
    "classify_point", "clopper_pearson", "critical_census", "critical_field", "critical_points",
    "find_equilibria", "relative_residual", "saddle_verdict"]
