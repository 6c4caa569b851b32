"""Compatibility module: the finder and classifier now live in :mod:`tl_steering.critical` (see
docs/critical_points.md). Import from ``tl_steering`` or ``tl_steering.critical``."""

from .critical.fields import Field, relative_residual, tangent_basis, tangent_part
from .critical.finder import METHODS, classify_point, find_equilibria
from .critical.results import EquilibriaResult, PointClassification
from .critical.spectrum import DENSE_MAX_DIM, LABELS, _resolve_eigensolver  # noqa: F401

__all__ = [
    "DENSE_MAX_DIM",
    "LABELS",
    "METHODS",
    "EquilibriaResult",
    "Field",
    "PointClassification",
    "classify_point",
    "find_equilibria",
    "relative_residual",
    "tangent_basis",
    "tangent_part",
]
