"""Synthetic fields with planted equilibria of chosen Morse indices, the coverage check of a finder
(docs/critical_points.md sections 8.1 and 9): a linear, non-normal field F(u) = A u whose only equilibria are the
real eigenvectors ±v_j of A, with ground truth from ``numpy.linalg.eig``; optionally a quartic term that keeps them."""

import dataclasses

import numpy as np
import torch
from torch import Tensor

from tl_steering.errors import InputError


@dataclasses.dataclass
class PlantedField:
    """A linear field with known equilibria.

    Attributes:
        matrix: A, ``[d, d]`` float64.
        points: the equilibria, ``[n, d]`` (±v_j), unit rows.
        lambdas: λ of each point.
        index: Morse index of each point.
        labels: "attractor" (index 0), "repeller" (index d - 1) or "saddle".
    """

    matrix: Tensor
    points: Tensor
    lambdas: Tensor
    index: list[int]
    labels: list[str]
    axes: Tensor | None = None
    coupling: Tensor | None = None

    @property
    def dim(self) -> int:
        return int(self.matrix.shape[0])

    def __call__(self, u: Tensor) -> Tensor:
        out = u @ self.matrix.to(u.dtype).T
        if self.coupling is None or self.axes is None:
            return out
        y = (u @ self.axes.to(u.dtype)) ** 2  # x_j² along the 8 planted axes
        i, k = torch.triu_indices(y.shape[-1], y.shape[-1], 1)
        return out + (y[..., i] * y[..., k]) @ self.coupling.to(u.dtype).T


def planted_field(dim: int, seed: int = 0, non_normal: float = 0.3, quartic: float = 0.0) -> PlantedField:
    """A field on S^{dim-1} with 16 planted equilibria of Morse indices 0, 1, 2, 3, d/2, d-3, d-2, d-1 (each ±).

    With ``quartic`` = γ > 0 the field is nonlinear: F(u) = A u + γ Z_8 W p(x), x = Z_8ᵀ u the coordinates along
    the 8 planted axes (T's first 8 columns are then diagonal, so the real eigenvectors of A are the axes z_j),
    p(x) = (x_i² x_k²)_{i<k} and W a seeded Gaussian d × 28 matrix whose columns have norm ~γ (scaled by 1/√d), in the basis Z. p and its first
    derivative vanish at every axis, so ±z_j stay equilibria with the linear field's λ and tangent spectrum (same
    indices and labels), while the great circles between axes are no longer invariant and further equilibria may
    appear (they are not part of the ground truth).

    Args:
        dim: d, a multiple of 4, at least 12 (so that d/2 is even and there are (d - 8)/2 >= 2 rotation pairs).
        seed: seed of the basis, the pairs' values and the non-normal part.
        non_normal: scale of T's strictly upper part (0: a normal matrix).
        quartic: γ, the scale of the quartic coupling (0: the linear field).
    """
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 12 or dim % 4:
        raise InputError(f"dim must be a multiple of 4 and >= 12; got {dim!r}")
    rng = np.random.default_rng(seed)
    n_pairs = (dim - 8) // 2
    above = (dim // 2 - 4) // 2  # pairs whose real part lies above μ_5: index(μ_5) = 4 + 2·above = d/2
    reals = np.array([4.0, 3.5, 3.0, 2.5, 0.2, -2.5, -3.0, -3.5])
    a = np.concatenate([rng.uniform(0.5, 2.0, above), rng.uniform(-2.0, -0.2, n_pairs - above)])
    b = rng.uniform(0.3, 1.5, n_pairs)
    t = np.zeros((dim, dim))
    t[np.arange(8), np.arange(8)] = reals
    for k in range(n_pairs):
        i = 8 + 2 * k
        t[i:i + 2, i:i + 2] = [[a[k], b[k]], [-b[k], a[k]]]
    upper = np.triu(rng.standard_normal((dim, dim)), 1) * (non_normal / np.sqrt(dim))
    for k in range(n_pairs):  # keep each 2×2 block a standard rotation block
        upper[8 + 2 * k, 9 + 2 * k] = 0.0
    if quartic:
        upper[:8, :8] = 0.0  # the real eigenvectors are then the first 8 axes
    t = t + upper
    z, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
    mat = z @ t @ z.T
    vals, vecs = np.linalg.eig(mat)
    real = np.abs(vals.imag) < 1e-9
    mus = vals.real[real]
    v = vecs[:, real].real
    v = v / np.linalg.norm(v, axis=0)
    index_of = [int((mus > m).sum() + 2 * (a > m).sum()) for m in mus]
    points = np.concatenate([v.T, -v.T])
    lambdas = np.concatenate([mus, mus])
    index = index_of + index_of
    labels = ["attractor" if k == 0 else "repeller" if k == dim - 1 else "saddle" for k in index]
    axes = coupling = None
    if quartic:
        w = rng.standard_normal((dim, 28)) * (float(quartic) / np.sqrt(dim))  # columns of norm ~γ
        axes, coupling = torch.as_tensor(z[:, :8].copy()), torch.as_tensor(z @ w)
    return PlantedField(matrix=torch.as_tensor(mat), points=torch.as_tensor(points), lambdas=torch.as_tensor(lambdas),
                        index=index, labels=labels, axes=axes, coupling=coupling)


def symmetric_field(dim: int, seed: int = 0, spread: float = 3.0) -> PlantedField:
    """A symmetric linear field F(u) = A u, A = Q diag(μ) Qᵀ (Q from the QR of a seeded Gaussian matrix, μ sorted
    uniform in [-``spread``, ``spread``]): its 2d equilibria are ±q_i with λ = μ_i and Morse index d - 1 - i (the
    number of μ above μ_i), every index 0..d-1 once per sign. The tangent eigenvector at q_j toward q_i is exactly
    P q_i, so each landscape start heads to a known neighbour once that neighbour is found (docs/critical_points.md,
    section 9)."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
        raise InputError(f"dim must be an int >= 2; got {dim!r}")
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
    mu = np.sort(rng.uniform(-spread, spread, dim))
    index = [dim - 1 - i for i in range(dim)] * 2
    labels = ["attractor" if k == 0 else "repeller" if k == dim - 1 else "saddle" for k in index]
    return PlantedField(matrix=torch.as_tensor(q @ np.diag(mu) @ q.T), points=torch.as_tensor(np.concatenate([q.T, -q.T])),
                        lambdas=torch.as_tensor(np.concatenate([mu, mu])), index=index, labels=labels)


__all__ = ["PlantedField", "planted_field", "symmetric_field"]
