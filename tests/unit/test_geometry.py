"""Unit tests of tl_steering.geometry: projector identities, cosines, set diversity and prefix statistics.

Tolerances are absolute unless stated, in float64: 1e-12 for identities of a single projection (scaled by the
vector norm), 1e-12 against brute-force pairwise averages, 1e-10 for prefix statistics against batch ones
(they come from a different factorization).
"""

import inspect
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError

from tl_steering import geometry as g
from tl_steering.errors import InputError

FAST = settings(max_examples=50, deadline=None)

seeds = st.integers(0, 2**31 - 1)
dims = st.integers(2, 12)
batch_shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
log_scales = st.floats(-6.0, 6.0)


def randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def rand_mask(seed: int, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed + 1)) < 0.7


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1)


def radial_coefficient(v: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """<u, v> with u = normalize(reference): the signed length of the radial part."""
    return dot(g.normalize(reference), v)


def rank_collapse(U: torch.Tensor) -> torch.Tensor:
    return g.diversity_stats(U)["rank_collapse"]


def orthonormal_rows(seed: int, k: int, d: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(randn(seed, d, k))
    return q.T.contiguous()


def simplex(n: int, d: int, seed: int) -> torch.Tensor:
    """Regular simplex of n unit vectors in R^d (d >= n): centered standard basis of R^n, rotated into R^d."""
    centered = torch.eye(n, dtype=torch.float64) - 1.0 / n
    rows = centered / torch.linalg.vector_norm(centered, dim=-1, keepdim=True)
    return rows @ orthonormal_rows(seed, n, d)


def brute_force_pairwise_cosine(U: torch.Tensor) -> float:
    units = U / torch.linalg.vector_norm(U, dim=-1, keepdim=True)
    cos = units @ units.T
    n = U.shape[0]
    return float((cos.sum() - cos.diagonal().sum()) / (n * (n - 1)))


def set_data(kind: str, seed: int, n: int, d: int) -> torch.Tensor:
    """Random rows of different geometry: isotropic, a tight cluster, or rank-deficient."""
    if kind == "isotropic":
        return randn(seed, n, d)
    if kind == "cluster":
        return randn(seed, 1, d) + 1e-4 * randn(seed + 1, n, d)
    coords = randn(seed, n, 2)
    return coords @ orthonormal_rows(seed + 2, 2, d) if d >= 2 else coords[:, :d]


set_kinds = st.sampled_from(["isotropic", "cluster", "rank2"])


# ------------------------------------------------------------------------------------------------------------
# tangent projector


@FAST
@given(seed=seeds, d=dims, batch=batch_shapes, log_scale=log_scales)
def test_projector_identities(seed: int, d: int, batch: tuple[int, ...], log_scale: float) -> None:
    v = randn(seed, *batch, d) * 10.0**log_scale
    x = randn(seed + 7, *batch, d)
    u = g.normalize(x)
    tangential, radial = g.tangential_part(v, x), g.radial_part(v, x)
    coef = radial_coefficient(v, x)
    scale = torch.linalg.vector_norm(v, dim=-1)
    tol = 1e-12 * scale.unsqueeze(-1)

    assert coef.shape == batch
    assert torch.all((tangential + radial - v).abs() <= tol)  # P_u v + <u,v>u = v
    assert torch.all(dot(tangential, u).abs() <= 1e-12 * scale)  # P_u v is orthogonal to u
    assert torch.all((radial - coef.unsqueeze(-1) * u).abs() <= tol)
    assert torch.all((g.tangential_part(tangential, x) - tangential).abs() <= tol)  # idempotent
    pythagoras = dot(tangential, tangential) + coef**2 - dot(v, v)
    assert torch.all(pythagoras.abs() <= 1e-12 * scale**2)
    assert torch.all(g.tangential_part(x, x).abs() <= 1e-12 * g.norm(x).unsqueeze(-1))  # P_u u = 0


@FAST
@given(seed=seeds, d=dims, log_c=log_scales)
def test_projector_invariant_to_positive_rescaling_of_the_reference(seed: int, d: int, log_c: float) -> None:
    v, x = randn(seed, 4, d), randn(seed + 1, 4, d)
    c = 10.0**log_c
    tol = 1e-12 * g.norm(v).unsqueeze(-1)
    assert torch.all((g.tangential_part(v, c * x) - g.tangential_part(v, x)).abs() <= tol)
    assert torch.allclose(radial_coefficient(v, c * x), radial_coefficient(v, x), rtol=0, atol=1e-12 * 10)
    assert torch.allclose(g.tangential_speed(v, c * x) * c, g.tangential_speed(v, x), rtol=1e-12, atol=0)
    assert torch.allclose(g.cosine_radial(v, c * x), g.cosine_radial(v, x), rtol=0, atol=1e-13)


def test_reference_broadcasts_against_a_batch_of_vectors() -> None:
    v, x = randn(0, 2, 5, 6), randn(1, 6)
    expected = torch.stack([torch.stack([g.tangential_part(v[i, j], x) for j in range(5)]) for i in range(2)])
    assert torch.allclose(g.tangential_part(v, x), expected, rtol=0, atol=1e-15)
    assert radial_coefficient(v, x).shape == (2, 5)
    assert g.tangent_alignment(v, randn(2, 5, 6), x).shape == (2, 5)


def test_zero_vectors_give_zero_direction_and_zero_cosine_not_nan() -> None:
    zero, v = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(g.normalize(zero), torch.zeros(3, dtype=torch.float64))
    assert g.safe_cosine(zero, v).item() == 0.0
    assert g.angle(zero, v).item() == pytest.approx(math.pi / 2, abs=1e-15)
    assert torch.equal(g.tangential_part(v, zero), v.double())  # u = 0 leaves v untouched
    assert g.tangential_speed(v, zero).item() == pytest.approx(math.sqrt(14) / g.EPS_NORM, rel=1e-12)


# ------------------------------------------------------------------------------------------------------------
# cosines and angles on hand-built vectors


def test_cosine_radial_is_cos_of_the_angle_to_the_reference() -> None:
    theta = torch.linspace(0, math.pi, 7, dtype=torch.float64)
    e1, e2 = torch.eye(3, dtype=torch.float64)[:2]
    reference = 3.0 * e1
    v = 5.0 * (torch.cos(theta)[:, None] * e1 + torch.sin(theta)[:, None] * e2)
    c_rad = g.cosine_radial(v, reference)
    assert torch.allclose(c_rad, torch.cos(theta), rtol=0, atol=1e-15)
    assert torch.allclose(radial_coefficient(v, reference), 5.0 * torch.cos(theta), rtol=0, atol=1e-14)
    tangential_share = g.norm(g.tangential_part(v, reference)) / g.norm(v)
    assert torch.allclose(tangential_share, torch.sqrt(1 - c_rad**2), rtol=0, atol=1e-7)  # sqrt near 0
    assert torch.allclose(g.angle(reference, v), theta, rtol=0, atol=1e-7)


def test_tangent_alignment_ignores_radial_components() -> None:
    e1, e2, e3 = torch.eye(3, dtype=torch.float64)
    reference = 2.0 * e1
    a = e1 + e2
    assert g.tangent_alignment(a, 5.0 * e1 + 3.0 * e2, reference).item() == pytest.approx(1.0, abs=1e-15)
    assert g.tangent_alignment(a, -7.0 * e1 - e2, reference).item() == pytest.approx(-1.0, abs=1e-15)
    assert g.tangent_alignment(a, e1 + e3, reference).item() == pytest.approx(0.0, abs=1e-15)
    assert g.tangent_alignment(a, 4.0 * e1, reference).item() == pytest.approx(0.0, abs=1e-15)  # radial b


def test_tangential_speed_exact_value() -> None:
    e1, e2 = torch.eye(2, dtype=torch.float64)
    assert g.tangential_speed(3.0 * e1 + 4.0 * e2, 2.0 * e1).item() == pytest.approx(2.0, abs=1e-15)


@FAST
@given(seed=seeds, d=dims, log_scale=log_scales)
def test_angle_is_in_range_and_exact_at_the_ends(seed: int, d: int, log_scale: float) -> None:
    x = randn(seed, 5, d) * 10.0**log_scale
    y = randn(seed + 1, 5, d)
    theta = g.angle(x, y)
    assert torch.all((theta >= 0) & (theta <= math.pi))
    assert torch.allclose(g.angle(x, 3.0 * x), torch.zeros(5, dtype=torch.float64), rtol=0, atol=3e-8)
    assert torch.allclose(g.angle(x, -x), torch.full((5,), math.pi, dtype=torch.float64), rtol=0, atol=3e-8)
    assert torch.allclose(torch.cos(theta), g.safe_cosine(x, y), rtol=0, atol=1e-14)


def test_degenerate_mask_flags_tiny_and_zero_vectors() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 1e-9, 0.0, 1e-7])[:, None] * torch.tensor([[0.6, 0.8]])
    # lower median of the norms is 1.0, so the threshold is rel * 1.0
    assert g.degenerate_mask(x).tolist() == [False] * 5 + [True, True, False]
    assert g.degenerate_mask(x, rel=1e-6).tolist() == [False] * 5 + [True, True, True]
    assert g.degenerate_mask(torch.zeros(2, 3)).tolist() == [True, True]


def test_degenerate_mask_uses_the_median_of_each_sequence_over_its_valid_rows() -> None:
    # sequence 0 has norms ~1, sequence 1 norms ~1e-9: a global median (1e-9 or 1) would flag all of one of
    # them; the per-sequence median flags none, so the mask does not depend on how sequences are batched
    base = torch.tensor([1.0, 2.0, 3.0, 4.0])[:, None] * torch.tensor([[0.6, 0.8]])
    x = torch.stack([base, 1e-9 * base])
    assert not g.degenerate_mask(x).any()
    assert torch.equal(g.degenerate_mask(x)[1], g.degenerate_mask(x[1:])[0])
    # rows outside the mask neither count for the median nor come back flagged
    z = torch.tensor([4.0, 3.0, 1.0, 1e-9])[:, None] * torch.tensor([[0.6, 0.8]])
    keep = torch.tensor([False, False, True, True])
    assert g.degenerate_mask(z).tolist() == [False, False, False, True]  # lower median of all four: 1
    assert g.degenerate_mask(z, keep).tolist() == [False] * 4  # lower median of the kept 1, 1e-9: 1e-9
    y = torch.tensor([0.0, 2.0, 1.0, 1e-9])[:, None] * torch.tensor([[0.6, 0.8]])
    assert g.degenerate_mask(y).tolist() == [True, False, False, False]  # 0 always; lower median 1e-9
    assert g.degenerate_mask(y, ~keep).tolist() == [True, False, False, False]
    assert g.degenerate_mask(y, keep).tolist() == [False] * 4  # the zero row is already out
    assert not g.degenerate_mask(y, torch.zeros(4, dtype=torch.bool)).any()
    with pytest.raises(InputError, match="mask must be a bool tensor"):
        inspect.unwrap(g.degenerate_mask)(y, keep.to(torch.float32))


# ------------------------------------------------------------------------------------------------------------
# diversity of a set of directions


@FAST
@given(seed=seeds, n=st.integers(1, 10), d=dims, log_scale=log_scales)
def test_identical_directions_are_a_full_cluster(seed: int, n: int, d: int, log_scale: float) -> None:
    scales = 10.0 ** (
        log_scale + torch.rand(n, 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    )
    U = scales * randn(seed, 1, d)  # one direction, different positive lengths
    stats = g.diversity_stats(U)
    if n >= 2:
        assert stats["pairwise_cosine"].item() == pytest.approx(1.0, abs=1e-12)
    else:
        assert math.isnan(stats["pairwise_cosine"].item())
    assert stats["resultant_length"].item() == pytest.approx(1.0, abs=1e-12)
    assert stats["spherical_variance"].item() == pytest.approx(0.0, abs=1e-12)
    assert stats["effective_rank"].item() == pytest.approx(1.0, abs=1e-12)
    assert stats["participation_ratio"].item() == pytest.approx(1.0, abs=1e-12)
    assert stats["rank_collapse"].item() == pytest.approx(0.0, abs=1e-12)
    assert rank_collapse(U).item() == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_regular_simplex_has_pairwise_cosine_minus_one_over_n_minus_one(n: int) -> None:
    U = 7.0 * simplex(n, d=n + 3, seed=n)
    assert g.mean_pairwise_cosine(U).item() == pytest.approx(-1.0 / (n - 1), abs=1e-12)
    assert g.mean_resultant_length(U).item() == pytest.approx(0.0, abs=1e-12)
    assert rank_collapse(U).item() == pytest.approx(1.0, abs=1e-12)
    assert g.effective_rank(U).item() == pytest.approx(n - 1, abs=1e-10)  # n-1 equal singular values


@FAST
@given(seed=seeds, n=st.integers(2, 12), d=dims, kind=set_kinds)
def test_pairwise_cosine_matches_brute_force(seed: int, n: int, d: int, kind: str) -> None:
    U = set_data(kind, seed, n, d)
    assert g.mean_pairwise_cosine(U).item() == pytest.approx(brute_force_pairwise_cosine(U), abs=1e-12)


@FAST
@given(seed=seeds, n=st.integers(1, 10), d=dims, kind=set_kinds)
def test_resultant_length_and_rank_collapse_identities(seed: int, n: int, d: int, kind: str) -> None:
    U = set_data(kind, seed, n, d)
    units = U / torch.linalg.vector_norm(U, dim=-1, keepdim=True)
    R = g.mean_resultant_length(U).item()
    assert R == pytest.approx(torch.linalg.vector_norm(units.mean(0)).item(), abs=1e-14)
    assert g.diversity_stats(U)["spherical_variance"].item() == pytest.approx(1.0 - R, abs=1e-15)
    assert rank_collapse(U).item() == pytest.approx(math.sqrt(max(1.0 - R * R, 0.0)), abs=1e-7)
    if n >= 2:  # m = (n R^2 - 1) / (n - 1)
        assert g.mean_pairwise_cosine(U).item() == pytest.approx((n * R * R - 1) / (n - 1), abs=1e-12)


@FAST
@given(seed=seeds, k=st.integers(1, 6), extra=st.integers(0, 5), log_scale=log_scales)
def test_orthonormal_rows_have_effective_rank_and_participation_ratio_k(
    seed: int, k: int, extra: int, log_scale: float
) -> None:
    U = 10.0**log_scale * orthonormal_rows(seed, k, k + extra)
    assert g.effective_rank(U).item() == pytest.approx(k, abs=1e-12)
    assert g.participation_ratio(U).item() == pytest.approx(k, abs=1e-12)
    ts = torch.arange(1, k + 1, dtype=torch.float64)
    assert torch.allclose(g.prefix_effective_rank(U), ts, rtol=0, atol=1e-12)
    assert torch.allclose(g.prefix_participation_ratio(U), ts, rtol=0, atol=1e-12)


def test_effective_rank_drops_singular_values_below_the_relative_floor() -> None:
    e1, e2 = torch.eye(2, dtype=torch.float64)
    below = torch.stack([e1, e1 + 1e-14 * e2])  # sigma_2 / sigma_1 ~ 5e-15 < 1e-12: dropped
    above = torch.stack([e1, e1 + 1e-6 * e2])
    assert g.effective_rank(below).item() == 1.0
    assert 1.0 < g.effective_rank(above).item() < 1.0 + 1e-4


def test_centered_statistics_see_the_spread_around_the_mean() -> None:
    U = 3.0 * simplex(4, d=6, seed=0)
    # centering a regular simplex changes nothing (its mean is 0): 3 equal singular values either way
    assert g.effective_rank(U, center=True).item() == pytest.approx(3.0, abs=1e-10)
    assert g.participation_ratio(U, center=True).item() == pytest.approx(3.0, abs=1e-10)
    cluster = randn(0, 1, 5).expand(4, 5)
    assert math.isnan(g.effective_rank(cluster, center=True).item())  # all singular values 0


@FAST
@given(seed=seeds, batch=batch_shapes, n=st.integers(1, 9), d=dims, kind=set_kinds)
def test_prefix_statistics_equal_batch_statistics_on_every_prefix(
    seed: int, batch: tuple[int, ...], n: int, d: int, kind: str
) -> None:
    U = set_data(kind, seed, math.prod(batch) * n, d).reshape(*batch, n, d)
    pairs = [
        (g.prefix_mean_pairwise_cosine, g.mean_pairwise_cosine),
        (g.prefix_mean_resultant_length, g.mean_resultant_length),
        (g.prefix_effective_rank, g.effective_rank),
        (g.prefix_participation_ratio, g.participation_ratio),
    ]
    for prefix_fn, batch_fn in pairs:
        running = prefix_fn(U)
        assert running.shape == (*batch, n) and running.dtype == torch.float64
        expected = torch.stack([batch_fn(U[..., :t, :]) for t in range(1, n + 1)], dim=-1)
        assert torch.allclose(running, expected, rtol=0, atol=1e-10, equal_nan=True), prefix_fn.__name__
    assert torch.all(torch.isnan(g.prefix_mean_pairwise_cosine(U)[..., 0]))


def test_prefix_effective_rank_is_stable_on_a_tight_cluster() -> None:
    # the Gram-eigenvalue route is off by ~1e-6 here; the QR route must match the batch SVD to 1e-10
    U = set_data("cluster", 3, 40, 16)
    U[:15] = U[0]
    expected = torch.stack([g.effective_rank(U[:t]) for t in range(1, 41)])
    assert torch.allclose(g.prefix_effective_rank(U), expected, rtol=0, atol=1e-10)


# ------------------------------------------------------------------------------------------------------------
# masks


@FAST
@given(seed=seeds, n=st.integers(1, 9), d=dims, kind=set_kinds)
@example(seed=4, n=9, d=4, kind="cluster")  # the centered rank differed by 1.1e-10 (relative 4e-11): see below
def test_masked_rows_are_excluded_exactly_as_if_dropped(seed: int, n: int, d: int, kind: str) -> None:
    batch = 3
    U = set_data(kind, seed, batch * n, d).reshape(batch, n, d)
    U[..., 0, :] *= 1e6  # a BOS-like outlier row, masked or not
    mask = rand_mask(seed, batch, n)
    masked = g.diversity_stats(U, mask)
    centered = g.effective_rank(U, mask, center=True), g.participation_ratio(U, mask, center=True)
    for b in range(batch):
        kept = U[b][mask[b]]
        if kept.shape[0] == 0:
            assert all(torch.isnan(value[b]) for value in masked.values())
            continue
        dropped = g.diversity_stats(kept)
        for key, value in masked.items():
            assert value[b].item() == pytest.approx(dropped[key].item(), abs=1e-12, nan_ok=True), key
        # centered: the BOS-like row (x 1e6) puts rounding of order eps * 1e6 into the small singular values of a
        # tight cluster, and the rank built from them (2.69 off by 1.1e-10 in the example): a relative tolerance
        assert centered[0][b].item() == pytest.approx(
            g.effective_rank(kept, center=True).item(), rel=1e-9, abs=1e-10, nan_ok=True
        )
        assert centered[1][b].item() == pytest.approx(
            g.participation_ratio(kept, center=True).item(), rel=1e-9, abs=1e-10, nan_ok=True
        )


@FAST
@given(seed=seeds, n=st.integers(1, 9), d=dims, kind=set_kinds)
def test_masked_prefix_statistics_equal_the_statistic_of_the_valid_prefix(
    seed: int, n: int, d: int, kind: str
) -> None:
    U = set_data(kind, seed, n, d)
    mask = rand_mask(seed, n)
    for prefix_fn, batch_fn in [
        (g.prefix_mean_pairwise_cosine, g.mean_pairwise_cosine),
        (g.prefix_mean_resultant_length, g.mean_resultant_length),
        (g.prefix_effective_rank, g.effective_rank),
        (g.prefix_participation_ratio, g.participation_ratio),
    ]:
        running = prefix_fn(U, mask)
        for t in range(1, n + 1):
            kept = U[:t][mask[:t]]
            expected = batch_fn(kept).item() if kept.shape[0] else math.nan
            assert running[t - 1].item() == pytest.approx(expected, abs=1e-10, nan_ok=True), (
                prefix_fn.__name__
            )


def test_all_rows_masked_gives_nan_everywhere() -> None:
    U, mask = randn(0, 2, 4, 3), torch.zeros(2, 4, dtype=torch.bool)
    for value in g.diversity_stats(U, mask).values():
        assert torch.all(torch.isnan(value))
    for fn in (g.prefix_mean_pairwise_cosine, g.prefix_effective_rank, g.prefix_participation_ratio):
        assert torch.all(torch.isnan(fn(U, mask)))


# ------------------------------------------------------------------------------------------------------------
# dtypes and errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_every_output_is_float64(dtype: torch.dtype) -> None:
    x, v, w = (randn(i, 2, 3, 4).to(dtype) for i in range(3))
    outputs = [
        g.to64(x),
        g.norm(x),
        g.normalize(x),
        g.radial_part(v, x),
        g.tangential_part(v, x),
        g.safe_cosine(v, w),
        g.cosine_radial(v, x),
        g.tangent_alignment(v, w, x),
        g.tangential_speed(v, x),
        g.angle(v, w),
        g.mean_pairwise_cosine(x),
        g.mean_resultant_length(x),
        g.effective_rank(x),
        g.participation_ratio(x),
        *g.diversity_stats(x).values(),
        g.prefix_mean_pairwise_cosine(x),
        g.prefix_mean_resultant_length(x),
        g.prefix_effective_rank(x),
        g.prefix_participation_ratio(x),
    ]
    assert all(out.dtype == torch.float64 for out in outputs)
    # the computation itself is float64: the float64 copy of the input gives the very same numbers
    assert torch.equal(g.tangential_part(v, x), g.tangential_part(v.double(), x.double()))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_inputs_name_the_argument(bad: float) -> None:
    clean = randn(0, 3, 4)
    dirty = clean.clone()
    dirty[1, 2] = bad
    with pytest.raises(InputError, match="v contains NaN or Inf"):
        g.tangential_part(dirty, clean)
    with pytest.raises(InputError, match="reference contains NaN or Inf"):
        g.cosine_radial(clean, dirty)
    with pytest.raises(InputError, match="U contains NaN or Inf"):
        g.mean_pairwise_cosine(dirty[None])
    with pytest.raises(ValueError):  # InputError is a ValueError
        g.norm(dirty)


def test_empty_inputs_raise() -> None:
    with pytest.raises(InputError, match="empty"):
        g.mean_pairwise_cosine(torch.zeros(2, 0, 4))
    with pytest.raises(InputError, match="empty"):
        g.prefix_effective_rank(torch.zeros(0, 4))
    with pytest.raises(InputError, match="empty"):
        g.norm(torch.zeros(3, 0))


def test_wrong_shapes_raise_input_error() -> None:
    # Under the test suite's runtime type checking, jaxtyping rejects mismatched shapes before the body runs;
    # the unwrapped functions show that the module's own checks raise InputError without it.
    shape_errors = (InputError, TypeCheckError)
    with pytest.raises(shape_errors):
        g.tangential_part(randn(0, 3, 4), randn(1, 3, 5))
    with pytest.raises(InputError, match="same last dimension"):
        inspect.unwrap(g.tangential_part)(randn(0, 3, 4), randn(1, 3, 5))
    with pytest.raises(InputError, match="do not broadcast"):
        inspect.unwrap(g.safe_cosine)(randn(0, 3, 4), randn(1, 2, 4))
    with pytest.raises(InputError, match="mask must have shape"):
        inspect.unwrap(g.mean_pairwise_cosine)(randn(0, 2, 3, 4), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(InputError, match="bool"):
        inspect.unwrap(g.effective_rank)(randn(0, 2, 3, 4), torch.ones(2, 3))
    with pytest.raises(InputError, match="at least 2"):
        inspect.unwrap(g.participation_ratio)(randn(0, 4))
    with pytest.raises(shape_errors):
        g.mean_pairwise_cosine(randn(0, 2, 3, 4), torch.ones(2, 4, dtype=torch.bool))


def test_degenerate_mask_drops_zero_and_tiny_norms_of_the_valid_positions():
    norms = torch.tensor([[5.0, 1.0, 0.0, 1e-12, 2.0, 3.0, 1.5]], dtype=torch.float64)
    base = torch.tensor([[False, True, True, True, True, True, True]])
    x = norms[..., None] * torch.tensor([0.6, 0.8], dtype=torch.float64)
    valid = base & ~g.degenerate_mask(x, base)  # the protocols' rule
    assert valid.tolist() == [[False, True, False, False, True, True, True]]


def test_all_finite_decides_by_the_sum_and_falls_back_when_the_sum_overflows():
    """validation.all_finite (geometry's input check, check_finite, check_weights_finite): a NaN or an Inf of either
    sign makes it False; finite entries whose float32 sum overflows are still finite (the entrywise fallback)."""
    from tl_steering.validation import all_finite

    big = torch.tensor([3e38, 3e38], dtype=torch.float32)
    assert torch.isinf(big.sum()) and all_finite(big)
    assert all_finite(torch.zeros(0)) and all_finite(torch.randn(4, 5, dtype=torch.float64))
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert not all_finite(torch.tensor([1.0, bad, 2.0]))
    assert not all_finite(torch.tensor([float("inf"), -float("inf")]))  # their sum is NaN
