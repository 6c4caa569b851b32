"""tl_steering.protocols.deficit on the tiny models, every quantity recomputed independently (conftest.py)."""
import math

import pytest
import torch

from tests.helpers import hook_count
from tl_steering import errors
from tl_steering.protocols import (
    DeficitResult,
    angular_deficit,
)
from tl_steering.stats import position_bins
from tests.unit.protocols.conftest import TOL, _angle, _cos, _is_parallel, _phi, _tan, _tl_cache, check_round_trip, check_summary_and_plots

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_deficit_matches_independent_recomputation(tiny, tiny_tokens, results):
    res: DeficitResult = results["deficit"]
    _, cache = _tl_cache(tiny, tiny_tokens)
    n_layers = tiny.cfg.n_layers
    assert res.layers == list(range(n_layers))
    edges, index = position_bins(tiny_tokens.shape[1])
    for lay in range(n_layers):
        x32 = cache[f"blocks.{lay}.hook_resid_pre"]
        x = x32.double()
        a = cache[f"blocks.{lay}.hook_attn_out"].double()
        post = cache[f"blocks.{lay}.hook_resid_post"].double()
        phi = _phi(tiny, lay, x32).double()
        dx = post - x
        u = x / x.norm(dim=-1, keepdim=True)
        align = _cos(_tan(a, u), _tan(dx, u))[:, 1:]  # position 0 excluded
        assert res.deficit[lay] == pytest.approx(1 - float(align.mean(1).mean()), abs=TOL)
        assert res.per_sequence_alignment[:, lay] == pytest.approx(align.mean(1), abs=TOL)
        assert res.deficit_median[lay] == pytest.approx(1 - float(align.mean(1).median()), abs=TOL)
        assert res.untangented_deficit[lay] == pytest.approx(1 - float(_cos(a, dx)[:, 1:].mean()), abs=TOL)
        assert res.angle_deficit[lay] == pytest.approx(float((torch.arccos(align) / math.pi).mean()), abs=TOL)
        e_a = float(_angle(x + a, post)[:, 1:].mean())
        e_af = float(_angle(x + a + phi, post)[:, 1:].mean())
        assert res.error_attention[lay] == pytest.approx(e_a, abs=TOL)
        assert res.error_parallel[lay] == pytest.approx(e_af, abs=TOL)
        assert res.ffn_contribution[lay] == pytest.approx((e_a - e_af) / e_a, abs=TOL)
        r2 = x.norm(dim=-1)[:, 1:] ** 2
        vdx, va, vaf = (_tan(v, u)[:, 1:] for v in (dx, a, a + phi))
        tot = float(((vdx**2).sum(-1) / r2).sum())
        assert res.r2_attention[lay] == pytest.approx(1 - float(((vdx - va) ** 2).sum(-1).div(r2).sum()) / tot,
                                                      abs=TOL)
        assert res.r2_parallel[lay] == pytest.approx(1 - float(((vdx - vaf) ** 2).sum(-1).div(r2).sum()) / tot,
                                                     abs=TOL)
        full_align = _cos(_tan(a, u), _tan(dx, u))
        for k in range(len(edges) - 1):
            sel = index == k
            assert res.deficit_by_position[lay, k] == pytest.approx(1 - float(full_align[:, sel].mean()), abs=TOL)
            assert int(res.position_bin_counts[lay, k]) == int(sel.sum()) * tiny_tokens.shape[0]
        if _is_parallel(tiny, lay):
            # x + a + Phi(x) IS the parallel block's output: e_AF is 0 up to float32 rounding
            assert res.error_parallel[lay] < 1e-5
            assert res.ffn_contribution[lay] == pytest.approx(1.0, abs=1e-4)
            assert res.r2_parallel[lay] == pytest.approx(1.0, abs=1e-8)
    assert res.parallel == [_is_parallel(tiny, lay) for lay in range(n_layers)]
    assert res.mean == pytest.approx(float(res.deficit.mean()), abs=1e-12)
    assert res.mean_excluding_first == pytest.approx(float(res.deficit[1:].mean()), abs=1e-12)
    assert res.mean_ci[0] <= res.mean <= res.mean_ci[1]
    assert bool((res.deficit_ci[:, 0] <= res.deficit).all() and (res.deficit <= res.deficit_ci[:, 1]).all())
    assert int(res.n_masked.sum()) == 0
    assert res.n_tokens_used.tolist() == [tiny_tokens.shape[0] * (tiny_tokens.shape[1] - 1)] * n_layers
    assert max(res.residual_identity_error) < 1e-5


def test_deficit_layer_selection_and_batching_agree(tiny, tiny_tokens, results):
    sub = angular_deficit(tiny, tiny_tokens, layers=[1], n_bootstrap=0, batch_size=3)
    full = results["deficit"]
    assert sub.layers == [1]
    # batches of 3 against one batch: the float32 forward may round differently per batch shape (a matmul kernel's
    # row blocking; AVX2 MKL does, AVX-512 happened not to), so the float64 statistics of those activations agree
    # to a few float32 roundings of O(1) quantities, not to float64's
    tol = 128 * torch.finfo(torch.float32).eps
    assert sub.deficit[0] == pytest.approx(float(full.deficit[1]), abs=tol)
    assert sub.error_parallel[0] == pytest.approx(float(full.error_parallel[1]), abs=tol)
    assert math.isnan(sub.mean_ci[0])
    assert sub.mean_excluding_first == pytest.approx(sub.mean, abs=1e-12)
    only0 = angular_deficit(tiny, tiny_tokens, layers=0, n_bootstrap=0)
    assert math.isnan(only0.mean_excluding_first)


def test_deficit_masks_and_counts_zero_norm_tokens(tiny, tiny_tokens):
    """A user hook zeroes resid_pre of position 3 at layer 1: those tokens are dropped and counted."""
    hp = tiny.hook_dict["blocks.1.hook_resid_pre"]

    def zero_pos3(act, hook):
        act = act.clone()
        act[:, 3] = 0.0
        return act

    hp.add_hook(zero_pos3)
    try:
        res = angular_deficit(tiny, tiny_tokens, n_bootstrap=0)
        assert hook_count(tiny) == 1  # the user's hook stays, ours are gone
    finally:
        hp.remove_hooks()
    n_seq, n_pos = tiny_tokens.shape
    assert res.n_masked.tolist() == [0, n_seq]
    assert res.n_tokens_used.tolist() == [n_seq * (n_pos - 1), n_seq * (n_pos - 2)]
    assert torch.isfinite(res.deficit).all()


# ----------------------------------------------------------------------------------------------------------
# FFN ablation


def test_bad_inputs_raise_package_errors(tiny, tiny_tokens):
    with pytest.raises(errors.InputError, match="integer ids"):
        angular_deficit(tiny, tiny_tokens.float())
    with pytest.raises(errors.LayerIndexError, match="out of range"):
        angular_deficit(tiny, tiny_tokens, layers=[7])
    with pytest.raises(errors.InputError, match="batch_size"):
        angular_deficit(tiny, tiny_tokens, batch_size=0)
    with pytest.raises(errors.InputError, match="n_bootstrap"):
        angular_deficit(tiny, tiny_tokens, n_bootstrap=-1)
    with pytest.raises(errors.InputError, match="exclude_positions"):
        angular_deficit(tiny, tiny_tokens, exclude_positions=("first",))
    assert hook_count(tiny) == 0


def test_result_round_trip_summary_and_plots(results, tmp_path, tiny_tokens):
    res = results["deficit"]
    check_round_trip(res, tmp_path, "deficit")
    check_summary_and_plots(res, tiny_tokens.shape[0], "angular_deficit", [res.plot_positions()])
