"""Float64 activations for the protocols (:func:`activation64`). Nothing here knows TransformerLens's classes."""

from jaxtyping import Float
from torch import Tensor

from .. import geometry as geo
from ..backends import check_finite


def activation64(cache: dict[str, Tensor], name: str, layer: int | None, site: str) -> Float[Tensor, "b p d"]:
    """A cached activation as float64, after checking it is finite (NonFiniteError names layer and site)."""
    x = cache[name]
    check_finite(x, layer, site)
    return geo.to64(x)


__all__ = ["activation64"]
