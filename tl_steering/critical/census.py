"""A census of a field's equilibria that can decide "mostly saddles" (docs/critical_points.md section 11): an upper
bound on the attractors and repellers (Chao1 of how often the power rows of F and -F from independent uniform starts
reached each) against the saddles found, a lower bound; "supported" when the saddles outnumber that upper bound,
else "not decided" (never "rejected")."""

import dataclasses
from typing import Any

from .finder import find_equilibria
from .options import CENSUS_LANDSCAPE_SOLVES, FinderOptions, finder_options
from .results import ASSUMPTIONS, CensusResult, census_of, check_level


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
    level = check_level(level)  # before the finder runs
    opts = dataclasses.replace(finder_options(options), landscape_solves=landscape_solves)
    return census_of(find_equilibria(field, dim, n_starts=n_starts, seed=seed, options=opts), level)


__all__ = ["ASSUMPTIONS", "CensusResult", "census", "census_of"]
