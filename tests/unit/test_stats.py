"""Unit tests of tl_steering.stats (position masks and bins, masked means, bootstrap) and tl_steering._util.timing.

Exact expectations from docs/statistics.md; no model.
"""

import dataclasses
import math
import time

import pytest
import torch

from tl_steering import stats
from tl_steering._util import timing
from tl_steering.errors import InputError
from tl_steering.stats import bootstrap_ci, position_bins, position_mask

pytestmark = pytest.mark.one_line("tl4")  # pure torch, no TransformerLens: the same computation on both lines


def test_one_position_bin_convention_for_probe_and_protocols():
    assert stats.position_bin_edges(1) == [0, 1]
    assert stats.position_bin_edges(5) == [0, 1, 2, 4, 8]
    assert stats.position_bin_edges(128) == [0, 1, 2, 4, 8, 16, 32, 64, 128]
    index = stats.position_bin_index(torch.arange(130))
    assert index[:9].tolist() == [0, 1, 2, 2, 3, 3, 3, 3, 4]
    # the bin of p is its bit length, exactly, for every position
    assert index.tolist() == [p.bit_length() for p in range(130)]
    # every position lies inside its bin: edges[k] <= p < edges[k + 1]
    edges = stats.position_bin_edges(130)
    assert all(edges[k] <= p < edges[k + 1] for p, k in enumerate(index.tolist()))
    # the protocols' bins are the same bins without bin 0 (position 0 is in none)
    for n_pos in (1, 2, 3, 4, 5, 16, 17, 128):
        edges_p, index_p = stats.position_bins(n_pos)
        assert edges_p == stats.position_bin_edges(max(n_pos, 2))[1:]
        assert index_p.tolist() == [k - 1 for k in stats.position_bin_index(torch.arange(n_pos)).tolist()]
    assert stats.bin_labels([1, 2, 4, 8], 6) == ["[1,2)", "[2,4)", "[4,6)"]


def test_position_mask_and_exclude_positions():
    assert stats.position_mask(5, (0, -1)).tolist() == [False, True, True, True, False]
    assert stats.position_mask(3, (7,)).tolist() == [True, True, True]  # outside: ignored
    with pytest.raises(InputError, match="leaves no position"):
        stats.position_mask(2, (0, 1))
    assert stats.check_exclude_positions(None) == () and stats.check_exclude_positions(0) == (0,)
    for bad in ((True,), (1.5,), "0"):
        with pytest.raises(InputError):
            stats.check_exclude_positions(bad)


def test_masked_and_finite_means():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False, True], [False, False, False]])
    out = stats.masked_mean(values, mask)
    assert out[0].item() == 2.0 and math.isnan(out[1].item())
    assert stats.finite_mean(torch.tensor([1.0, math.nan, 3.0, math.inf])) == 2.0
    assert math.isnan(stats.finite_mean(torch.tensor([math.nan])))


def test_bootstrap_is_seeded_and_covers_the_mean():
    x = torch.randn(50, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    a = stats.bootstrap_ci(x, n_bootstrap=400, seed=7)
    assert torch.equal(a, stats.bootstrap_ci(x, n_bootstrap=400, seed=7)) and a.shape == (2, 2)
    assert not torch.equal(a, stats.bootstrap_ci(x, n_bootstrap=400, seed=8))
    assert bool(((a[:, 0] < x.mean(0)) & (x.mean(0) < a[:, 1])).all())
    # any statistic of the resampled rows: here the mean of both columns together
    both = stats.bootstrap_ci(x, lambda s: s.mean(), n_bootstrap=200, seed=0)
    assert both.shape == (2,) and both[0] < x.mean() < both[1]
    assert torch.isnan(stats.bootstrap_ci(x[:1], n_bootstrap=100)).all()


def test_block_sums_and_length():
    assert [stats.block_length(n) for n in (0, 1, 7, 8, 31, 127, 1023)] == [1, 1, 2, 2, 3, 5, 10]
    x = torch.arange(14, dtype=torch.float64).reshape(2, 7)
    assert stats.block_sums(x, 3).tolist() == [[3.0, 12.0, 6.0], [24.0, 33.0, 13.0]]  # the last block short
    assert torch.equal(stats.block_sums(x, 7), x.sum(1, keepdim=True))
    assert stats.block_sums(x.unsqueeze(-1).expand(2, 7, 2), 2).shape == (2, 4, 2)  # trailing statistics kept
    with pytest.raises(InputError):
        stats.block_sums(x, 0)


def test_cluster_bootstrap_is_seeded_and_ratio_of_sums():
    g = torch.Generator().manual_seed(0)
    sums = torch.randn(3, 5, 2, generator=g, dtype=torch.float64)
    counts = torch.full((3, 5), 2.0, dtype=torch.float64)
    a = stats.cluster_bootstrap_ci(sums, counts, 500, seed=3)
    assert a.shape == (2, 2) and torch.equal(a, stats.cluster_bootstrap_ci(sums, counts, 500, seed=3))
    assert not torch.equal(a, stats.cluster_bootstrap_ci(sums, counts, 500, seed=4))
    point = sums.sum((0, 1)) / counts.sum()
    assert bool(((a[:, 0] <= point) & (point <= a[:, 1])).all())
    # a constant statistic has a zero-width interval; one block in all, or no resample, gives NaN
    flat = stats.cluster_bootstrap_ci(2.0 * counts.unsqueeze(-1), counts, 200)
    assert flat.tolist() == [[2.0, 2.0]]
    assert torch.isnan(stats.cluster_bootstrap_ci(sums[:1, :1], counts[:1, :1], 100)).all()
    assert torch.isnan(stats.cluster_bootstrap_ci(sums, counts, 0)).all()
    # chunked resampling (many cells) draws the same statistic: only the chunk size changes
    big = stats.cluster_bootstrap_ci(torch.randn(64, 300, 1, generator=g, dtype=torch.float64),
                                     torch.ones(64, 300, dtype=torch.float64), 200)
    assert big.shape == (1, 2) and bool(big[0, 0] < big[0, 1])


def _coverage(windows: int, tokens: int, window_sd: float, pooled: bool, reps: int = 300) -> float:
    """How often the 95 % interval of the mean covers the true mean 0: tokens N(0, 1) plus a per-window offset
    N(0, window_sd), blocks of one token; ``pooled``: every token as one window's block (the window stage lost)."""
    g = torch.Generator().manual_seed(11)
    hit = 0
    for r in range(reps):
        x = window_sd * torch.randn(windows, 1, generator=g, dtype=torch.float64) \
            + torch.randn(windows, tokens, generator=g, dtype=torch.float64)
        if pooled:
            x = x.reshape(1, -1)
        ci = stats.cluster_bootstrap_ci(x.unsqueeze(-1), torch.ones_like(x), 400, seed=r)[0]
        hit += int(ci[0] <= 0.0 <= ci[1])
    return hit / reps


def test_cluster_bootstrap_coverage():
    """95 % intervals cover about 95 % of the time. 300 repetitions: the binomial sd of the rate at 0.94 is 0.014,
    so the bounds sit 3-4 sd from the percentile bootstrap's known slight undercoverage at these sizes. With
    windows that differ (offset sd 1, 12 windows of 30 tokens), resampling the windows keeps the coverage;
    resampling the tokens as if they were one window does not (its interval misses the window-to-window part of
    the variance, 1/12 against 1/360)."""
    assert 0.89 <= _coverage(1, 60, 0.0, pooled=False) <= 0.99
    assert 0.87 <= _coverage(12, 30, 1.0, pooled=False) <= 0.995
    assert _coverage(12, 30, 1.0, pooled=True) < 0.5


def test_timers():
    with timing.timed() as sw:
        time.sleep(0.02)
    assert 0.015 < sw.wall_s < 5 and sw.cpu_s >= 0 and {f.name for f in dataclasses.fields(sw)} == {"wall_s", "cpu_s"}
    with pytest.raises(RuntimeError), timing.timed() as failed:
        raise RuntimeError("boom")
    assert failed.wall_s > 0  # filled also when the block raises
    calls = []
    t = timing.median_seconds(lambda: calls.append(time.sleep(0.005)), "cpu", warmup=2, repeats=3)
    assert len(calls) == 5 and 0.004 < t < 5


def test_median_interval_order_statistics():
    """The distribution-free interval of the median: the largest symmetric order statistics with coverage >= 95%."""
    m, lo, hi, cov = stats.median_interval([9, 1, 8, 2, 7, 3, 6, 4, 5])
    assert (m, lo, hi) == (5, 2, 8) and cov == pytest.approx(1 - 2 * 10 / 512)  # 96.1%; [3, 7] would be 82%
    assert stats.median_interval([1, 2, 3, 4, 5, 6, 7]) == (4, 1, 7, pytest.approx(1 - 2 / 128))  # too few: range
    assert stats.median_interval([3.0, 1.0, math.nan, 2.0, 4.0])[:3] == (2.5, 1.0, 4.0)  # NaN dropped, even n
    assert stats.median_interval([2.0]) == (2.0, 2.0, 2.0, 0.0)
    assert all(math.isnan(v) for v in stats.median_interval([]))
    m, lo, hi, cov = stats.median_interval(list(range(100)), level=0.99)
    assert lo < m < hi and 0.99 <= cov < 0.995


def test_alternating_seconds_rotates_the_order():
    """Round r calls the functions in the order rotated by r, after one warm-up call each; times[i] has a time per
    round; the same function given twice (an A/A control) is timed twice per round."""
    calls = []
    fns = [lambda: calls.append("A"), lambda: calls.append("B"), lambda: calls.append("C")]
    times = timing.alternating_seconds(fns, "cpu", warmup=1, rounds=3)
    assert "".join(calls) == "ABC" + "ABC" + "BCA" + "CAB"
    assert [len(t) for t in times] == [3, 3, 3] and all(x >= 0 for t in times for x in t)
    slow = timing.alternating_seconds([lambda: time.sleep(0.004), lambda: None], "cpu", warmup=0, rounds=2)
    assert min(slow[0]) >= 0.004 and len(slow[1]) == 2  # the sleeping function's times are in its own slot


def test_position_bins_and_mask():
    edges, index = position_bins(128)
    assert edges == [1, 2, 4, 8, 16, 32, 64, 128]
    assert index[0] == -1 and index[1] == 0 and index[2] == index[3] == 1 and index[4] == 2 and index[127] == 6
    edges, index = position_bins(16)
    assert edges == [1, 2, 4, 8, 16] and index[15] == 3
    assert position_bins(2)[0] == [1, 2]
    m = position_mask(5, (0, -1))
    assert m.tolist() == [False, True, True, True, False]
    with pytest.raises(InputError, match="leaves no position"):
        position_mask(2, (0, 1))


def test_bootstrap_ci_is_seeded_and_brackets_the_mean():
    x = torch.randn(40, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a, b = bootstrap_ci(x, n_bootstrap=300, seed=3), bootstrap_ci(x, n_bootstrap=300, seed=3)
    assert torch.equal(a, b) and a.shape == (3, 2)
    mean = x.mean(0)
    assert bool((a[:, 0] < mean).all() and (mean < a[:, 1]).all())
    # width of a 95 % CI of a mean of 40 N(0,1) draws: about 2 * 1.96 / sqrt(40) = 0.62
    assert 0.4 < float((a[:, 1] - a[:, 0]).mean()) < 0.85
    assert torch.isnan(bootstrap_ci(x, n_bootstrap=0)).all()


# ----------------------------------------------------------------------------------------------------------
# angular deficit


def test_clopper_pearson_equals_scipys_exact_binomial_interval():
    """The Beta quantiles against scipy.stats.binomtest(...).proportion_ci(method="exact"), which solves for the
    bounds another way: equal to far below the verdict's resolution (the bounds are in [0, 1])."""
    from scipy.stats import binomtest

    for n in (1, 2, 5, 10, 37, 100, 848):
        for k in sorted({0, 1, n // 3, n // 2, n - 1, n}):
            for level in (0.9, 0.95, 0.99):
                ci = binomtest(k, n).proportion_ci(confidence_level=level, method="exact")
                low, high = stats.clopper_pearson(k, n, level)
                assert abs(low - ci.low) <= 1e-10 and abs(high - ci.high) <= 1e-10, (k, n, level)
