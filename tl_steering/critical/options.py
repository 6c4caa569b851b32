"""The one finder of equilibria and its settings, read by every entry point (docs/critical_points.md, "The one way
in"): :func:`~tl_steering.critical.find_equilibria`, :func:`~tl_steering.critical_points`, the census, the suite
and the report all run :data:`DEFAULT_FINDER` with :data:`DEFAULT_OPTIONS` unless the caller passes other options.
"""

import dataclasses
from typing import Any

import numpy as np

from ..errors import InputError

#: the finder every entry point runs: the flow finder (power iteration of F and -F, edge tracking between basins,
#: Levenberg-Marquardt end game), then the solution-landscape phase (deflated Newton along tangent eigenvectors)
DEFAULT_FINDER = "landscape"
#: the finders a caller can name (one)
METHODS: tuple[str, ...] = (DEFAULT_FINDER,)
#: starts per layer of critical_points and find_equilibria (half token directions on a model, half random)
DEFAULT_N_STARTS = 16

#: converged points closer than this (radians) are one point (u and -u are distinct)
DEDUP_ANGLE = 1e-6
#: a row stops when its residual has not halved over this many iterations
PATIENCE = 8
#: labels use tol = LABEL_TOL * max|eig|; an eigenvalue is rotational when |Im| > ROT_RATIO * |Re|
LABEL_TOL, ROT_RATIO = 1e-6, 0.1
#: real tangent eigenvectors per side of zero per point from which the landscape starts
LANDSCAPE_DIRS = 2
_INTS = {"max_iter": 0, "pre_iter": 0, "edge_pairs": 0, "landscape_solves": 0, "n_eigs": 1}


@dataclasses.dataclass(frozen=True)
class FinderOptions:
    """Settings of the finder (docs/critical_points.md sections 2, 3, 6.2 and 9).

    Attributes:
        tol: a row has converged when its relative residual ||P_u F|| / ||F|| is <= tol.
        max_iter: Levenberg-Marquardt iterations of a power or edge row's end game, Newton iterations of a
            landscape row.
        pre_iter: power-iteration steps per row and sign.
        edge_pairs: pairs of basins whose boundary saddle is tracked (half per sign).
        landscape_solves: most deflated Newton rows of the landscape phase (0: the flow finder alone).
        n_eigs: eigenvalues per end with ARPACK (eigensolver "arpack")."""

    tol: float = 1e-10
    max_iter: int = 60
    pre_iter: int = 200
    edge_pairs: int = 12
    landscape_solves: int = 40
    n_eigs: int = 6

    def __post_init__(self) -> None:
        if isinstance(self.tol, bool) or not (isinstance(self.tol, (int, float)) and 0 < self.tol < 1):
            raise InputError(f"tol must be a float in (0, 1); got {self.tol!r}")
        for name, low in _INTS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise InputError(f"{name} must be an int >= {low}; got {value!r}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: the settings every entry point uses unless its caller passes others
DEFAULT_OPTIONS = FinderOptions()
#: the census's budget (docs/critical_points.md section 11): the landscape run until exhausted or 256 solves
CENSUS_LANDSCAPE_SOLVES = 256


def finder_options(options: "FinderOptions | dict[str, Any] | None") -> FinderOptions:
    """``options`` as :class:`FinderOptions`: None gives :data:`DEFAULT_OPTIONS`, a dict overrides its fields."""
    if options is None:
        return DEFAULT_OPTIONS
    if isinstance(options, FinderOptions):
        return options
    if isinstance(options, dict):
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(FinderOptions)})
        if unknown:
            raise InputError(f"unknown finder options {unknown}; FinderOptions has "
                             f"{[f.name for f in dataclasses.fields(FinderOptions)]}")
        return dataclasses.replace(DEFAULT_OPTIONS, **options)
    raise InputError(f"options must be a FinderOptions, a dict of its fields or None; got {type(options).__name__}")


__all__ = ["CENSUS_LANDSCAPE_SOLVES", "DEFAULT_FINDER", "DEFAULT_N_STARTS", "DEFAULT_OPTIONS", "METHODS",
           "FinderOptions", "finder_options"]
