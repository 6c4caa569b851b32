"""tl_steering.protocols.ablation on the tiny models, ablations from hooks written here (conftest.py)."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import hook_count
from tl_steering import errors
from tl_steering.protocols import (
    AblationResult,
    ffn_ablation,
)
from tests.unit.protocols.conftest import TOL, check_round_trip, check_summary_and_plots, _component_hooks

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _metrics(model, tokens, hooks, clean_logits):
    with torch.no_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
    lp, lq = F.log_softmax(clean_logits[:, :-1].double(), -1), F.log_softmax(logits[:, :-1].double(), -1)
    ce = -lq.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (lp.argmax(-1) == lq.argmax(-1)).double()
    return float(ce.mean()), float(kl.mean()), float(top1.mean())


def test_ablation_matches_independent_hooks(tiny, tiny_tokens, results):
    res: AblationResult = results["ablation"]
    n_layers = tiny.cfg.n_layers
    with torch.no_grad():
        clean_logits = tiny(tiny_tokens)
    clean = -F.log_softmax(clean_logits[:, :-1].double(), -1).gather(-1, tiny_tokens[:, 1:, None]).mean()
    assert res.clean_loss == pytest.approx(float(clean), abs=TOL)
    assert res.variants == ["tangential", "radial", "zero", "random_tangent"]
    for keep in ("tangential", "radial", "zero"):
        ce, kl, top1 = _metrics(tiny, tiny_tokens, _component_hooks(tiny, keep, range(n_layers)), clean_logits)
        assert res.delta_loss[keep] == pytest.approx(ce - float(clean), abs=TOL)
        assert res.kl[keep] == pytest.approx(kl, abs=TOL)
        assert res.top1_agreement[keep] == pytest.approx(top1, abs=TOL)
        assert res.ratio_to_zero[keep] == pytest.approx(res.delta_loss[keep] / res.delta_loss["zero"], rel=1e-12)
        for lay in range(n_layers):
            ce, kl, _ = _metrics(tiny, tiny_tokens, _component_hooks(tiny, keep, [lay]), clean_logits)
            assert res.per_layer_delta_loss[keep][lay] == pytest.approx(ce - float(clean), abs=TOL)
            assert res.per_layer_kl[keep][lay] == pytest.approx(kl, abs=TOL)
        lo, hi = res.delta_loss_ci[keep]
        assert lo <= res.delta_loss[keep] <= hi
    assert res.kl["random_tangent"] > 0 and 0 <= res.top1_agreement["random_tangent"] <= 1
    assert res.ablate_position_0 is True and res.scope == "per_layer"
    assert res.per_sequence_delta_loss["zero"].mean() == pytest.approx(res.delta_loss["zero"], abs=1e-12)
    # position 0 kept intact
    keep0 = results["ablation_keep0"]
    assert keep0.ablate_position_0 is False and keep0.variants == ["tangential", "radial", "zero"]
    for keep in ("tangential", "radial", "zero"):
        ce, kl, top1 = _metrics(tiny, tiny_tokens, _component_hooks(tiny, keep, range(n_layers), skip0=True),
                                clean_logits)
        assert keep0.delta_loss[keep] == pytest.approx(ce - float(clean), abs=TOL)
        assert keep0.kl[keep] == pytest.approx(kl, abs=TOL)
    assert keep0.per_layer_delta_loss == {}


def test_ablation_random_tangent_is_seeded(tiny, tiny_tokens, results):
    again = ffn_ablation(tiny, tiny_tokens, keep="zero", layers=None, batch_size=2, n_bootstrap=0)
    assert again.delta_loss["random_tangent"] == pytest.approx(results["ablation"].delta_loss["random_tangent"],
                                                               abs=1e-12)
    other = ffn_ablation(tiny, tiny_tokens, keep="zero", batch_size=2, n_bootstrap=0, seed=5)
    assert other.delta_loss["random_tangent"] != again.delta_loss["random_tangent"]


def test_ablation_single_layer_scan_reuses_the_joint_run(tiny, tiny_tokens, results):
    one = ffn_ablation(tiny, tiny_tokens, keep="radial", scope="per_layer", layers=[1],
                       include_random_tangent=False, n_bootstrap=0)
    assert one.layers == [1] and one.variants == ["radial", "zero"]
    for v in ("radial", "zero"):
        assert float(one.per_layer_delta_loss[v][0]) == pytest.approx(one.delta_loss[v], abs=1e-12)
        assert float(one.per_layer_delta_loss[v][0]) == pytest.approx(
            float(results["ablation"].per_layer_delta_loss[v][1]), abs=TOL)


# ----------------------------------------------------------------------------------------------------------
# diversity


def test_bad_inputs_raise_package_errors(tiny, tiny_tokens):
    with pytest.raises(errors.InputError, match="sideways"):  # the message names the bad value
        ffn_ablation(tiny, tiny_tokens, keep=("sideways",))
    with pytest.raises(errors.InputError, match="n_bootstrap"):
        ffn_ablation(tiny, tiny_tokens, n_bootstrap=-2)
    with pytest.raises(errors.InputError, match="scope"):
        ffn_ablation(tiny, tiny_tokens, scope="some")
    assert hook_count(tiny) == 0


def test_result_round_trip_summary_and_plots(results, tmp_path, tiny_tokens):
    for name in ("ablation", "ablation_keep0"):
        check_round_trip(results[name], tmp_path, name)
        check_summary_and_plots(results[name], tiny_tokens.shape[0], "ffn_ablation")
