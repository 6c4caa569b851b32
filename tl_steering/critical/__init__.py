"""Critical points of a field on the sphere: nonlinear projective equilibria, their tangent spectra, and the
"mostly saddles" claim (see docs/critical_points.md).

One finder (:data:`DEFAULT_FINDER`) with one set of settings (:data:`DEFAULT_OPTIONS`, a :class:`FinderOptions`)
is the default of every entry point:

* :mod:`.fields`: calling conventions of a field, relative residual, tangent basis;
* :mod:`.dynamics`: the flow phase (power iteration, edge tracking); :mod:`.solver`: its Levenberg-Marquardt end
  game; :mod:`.landscape`: the solution-landscape phase (deflated Newton);
* :mod:`.spectrum`: tangent spectra and labels; :mod:`.results`: result classes and the claim test;
* :mod:`.finder`: :func:`find_equilibria`, :func:`classify_point` for any torch field;
* :mod:`.model`: :func:`critical_points` / :func:`critical_field` / :func:`critical_census` for TransformerLens models;
* :mod:`.census`: :func:`census`, the bounds that can decide "mostly saddles" for all equilibria of a field.
"""

from .census import CensusResult, census
from .fields import relative_residual, tangent_basis
from .finder import classify_point, find_equilibria
from .model import FIELDS, CriticalField, critical_census, critical_field, critical_points
from .options import DEFAULT_FINDER, DEFAULT_OPTIONS, METHODS, FinderOptions
from .results import CriticalPointsResult, EquilibriaResult, PointClassification, clopper_pearson, saddle_verdict
from .spectrum import DENSE_MAX_DIM, LABELS

__all__ = [
    "DEFAULT_FINDER",
    "DEFAULT_OPTIONS",
    "DENSE_MAX_DIM",
    "FIELDS",
    "LABELS",
    "METHODS",
    "CensusResult",
    "CriticalField",
    "CriticalPointsResult",
    "EquilibriaResult",
    "FinderOptions",
    "PointClassification",
    "census",
    "classify_point",
    "clopper_pearson",
    "critical_census",
    "critical_field",
    "critical_points",
    "find_equilibria",
    "relative_residual",
    "saddle_verdict",
    "tangent_basis",
]
