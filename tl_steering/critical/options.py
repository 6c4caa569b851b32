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

_INTS = {"max_iter": 0, "patience": 1, "pre_iter": 0, "edge_pairs": 0, "landscape_dirs": 1, "landscape_solves": 0,
         "n_eigs": 1}
_FRACTIONS = ("tol", "dedup_angle", "label_tol")


@dataclasses.dataclass(frozen=True)
class FinderOptions:
    """Settings of the finder (docs/critical_points.md sections 2, 3, 6.2 and 9).

    Attributes:
        tol: a row has converged when its relative residual ||P_u F|| / ||F|| is <= tol.
        dedup_angle: converged points closer than this (radians) are one point (u and -u are distinct).
        max_iter: Levenberg-Marquardt iterations of a power or edge row's end game, Newton iterations of a
            landscape row.
        patience: a row stops when its residual has not halved over this many iterations.
        pre_iter: power-iteration steps per row and sign.
        edge_pairs: pairs of basins whose boundary saddle is tracked (half per sign).
        landscape_dirs: real tangent eigenvectors per side of zero per point from which the landscape starts.
        landscape_solves: most deflated Newton rows of the landscape phase (0: the flow finder alone).
        label_tol: labels use tol = label_tol * max|eig|.
        rot_ratio: an eigenvalue is rotational when |Im| > rot_ratio * |Re|.
        n_eigs: eigenvalues per end with ARPACK (eigensolver "arpack").
    """

    tol: float = 1e-10
    dedup_angle: float = 1e-6
    max_iter: int = 60
    patience: int = 8
    pre_iter: int = 200
    edge_pairs: int = 8
    landscape_dirs: int = 2
    landscape_solves: int = 32
    label_tol: float = 1e-6
    rot_ratio: float = 0.1
    n_eigs: int = 6

    def __post_init__(self) -> None:
        for name in _FRACTIONS:
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 < value < 1):
                raise InputError(f"{name} must be a float in (0, 1); got {value!r}")
        if isinstance(self.rot_ratio, bool) or not (isinstance(self.rot_ratio, (int, float)) and self.rot_ratio >= 0):
            raise InputError(f"rot_ratio must be a float >= 0; got {self.rot_ratio!r}")
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
