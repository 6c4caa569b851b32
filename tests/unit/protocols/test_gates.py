"""Unit tests of tl_steering.protocols.gates (docs/gates.md) on the tiny models."""

import plotly.graph_objects as go
import pytest
import torch

from tl_steering.backends import adapt, weights_fingerprint
from tl_steering.errors import InputError
from tl_steering.protocols.gates import GateResult, calibrate_gates
from tl_steering.hooks import ffn_component, parallel_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def gate_tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 257, (8, 16), generator=g)


def _mean_loss(ad, tokens, hooks=()):
    return float(ad.loss_per_token(tokens, list(hooks)).mean())


def test_gates_one_reproduce_base_loss(tiny, gate_tokens):
    """steps=0: the gates stay 1, and gated loss = base loss exactly (gate 1 multiplies by 1.0)."""
    ad = adapt(tiny)
    held = gate_tokens[6:]
    r = calibrate_gates(tiny, gate_tokens[:6], plan=[0, 1], steps=0, held_out_tokens=held)
    assert torch.equal(r.gates, torch.ones(ad.n_layers, dtype=torch.float64))
    assert r.loss_gated_calib == r.loss_base_calib and r.loss_gated_heldout == r.loss_base_heldout
    assert r.loss_base_heldout == pytest.approx(_mean_loss(ad, held, parallel_blocks(tiny, [0, 1])), abs=1e-9)
    assert r.loss_clean_heldout == pytest.approx(_mean_loss(ad, held), abs=1e-9)
    if all(ad.is_parallel(layer) for layer in range(ad.n_layers)):
        assert r.loss_base_heldout == r.loss_clean_heldout  # parallel_blocks leaves native parallel blocks alone
    assert r.n_calib == 6 and r.n_heldout == 2


def test_closed_form_gate_is_the_formula(tiny, gate_tokens):
    ad = adapt(tiny)
    plan = [1]
    r = calibrate_gates(tiny, gate_tokens, method="closed_form", plan=plan, held_out=0.25, seed=0)
    assert r.gates[0] == 1.0 and r.layers == plan
    # the calibration split, recomputed: seeded permutation, first n_hold rows held out
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    calib = gate_tokens[perm[2:]]
    names = [ad.hook_name(1, "resid_pre"), ad.hook_name(1, "attn_out")]
    _, cache = ad.run_with_cache(calib, names, fwd_hooks=parallel_blocks(tiny, plan))
    x, a = cache[names[0]], cache[names[1]]
    phi = ad.ffn(1)
    with torch.no_grad():
        px, py = phi(x)[:, 1:].double(), phi(x + a)[:, 1:].double()
    g = float((px * py).sum() / (px * px).sum())
    assert float(r.gates[1]) == pytest.approx(g, rel=1e-10)
    assert 0.0 < g < 2.0
    # the base loss on the calibration windows comes from the fitting forwards (in batches of 4 here): the same
    # number as its own pass
    r4 = calibrate_gates(tiny, gate_tokens, method="closed_form", plan=plan, held_out=0.25, seed=0, batch_size=4)
    base = parallel_blocks(tiny, plan)
    assert r4.loss_base_calib == pytest.approx(_mean_loss(ad, calib, base), abs=1e-9)
    assert r.loss_base_calib == pytest.approx(r4.loss_base_calib, abs=1e-9) and float(r4.gates[1]) == pytest.approx(g)
    assert r4.loss_base_heldout == pytest.approx(_mean_loss(ad, gate_tokens[perm[:2]], base), abs=1e-9)


def test_loss_fit_lowers_calibration_loss(tiny, gate_tokens):
    ad = adapt(tiny)
    fp = weights_fingerprint(tiny)
    r = calibrate_gates(tiny, gate_tokens, plan=[0, 1], steps=15, lr=0.05, seed=0)
    assert r.loss_gated_calib < r.loss_base_calib - 1e-4
    assert r.history.shape == (15,) and float(r.history[0]) == pytest.approx(r.loss_base_calib, abs=1e-5)
    # weights untouched, no gradient accumulated on them, no hook left
    assert weights_fingerprint(tiny) == fp
    assert all(p.grad is None for p in tiny.parameters())
    assert sum(len(hp._forward_hooks) for hp in tiny.hook_dict.values()) == 0
    assert r.summary()["generalization_gap"] == pytest.approx(r.improvement_calib - r.improvement_heldout)
    assert r.gates.shape == (ad.n_layers,)


def test_gates_compose_with_ablation_and_scan(tmp_path, gate_tokens):
    import tl_steering as ts

    model = ts.tiny_model("llama", backend="bridge", seed=0)
    ad = adapt(model)
    base = lambda m: ffn_component(m, keep="tangential")  # noqa: E731
    r = calibrate_gates(model, gate_tokens, base_hooks=base, layers=[1], steps=5, scan=True,
                        scan_grid=[0.0, 0.5, 1.0, 1.5, 2.0])
    assert r.layers == [1] and float(r.gates[0]) == 1.0
    assert r.loss_base_calib == pytest.approx(
        _mean_loss(ad, gate_tokens[torch.randperm(8, generator=torch.Generator().manual_seed(0))[2:]],
                   ffn_component(model, keep="tangential")), abs=1e-9)
    assert tuple(r.scan_losses.shape) == (1, 5)
    assert float(r.scan_losses[0, 2]) == pytest.approx(r.loss_base_calib, abs=1e-9)  # g = 1 is the base
    assert float(r.scan_best[0]) in (0.0, 0.5, 1.0, 1.5, 2.0)
    assert isinstance(r.plot(), go.Figure)
    back = GateResult.load(r.save(tmp_path / "g.json"))
    assert torch.equal(back.gates, r.gates) and back.loss_gated_heldout == r.loss_gated_heldout


def test_bad_inputs(gate_tokens):
    import tl_steering as ts

    model = ts.tiny_model("gpt2", backend="bridge", seed=0)
    with pytest.raises(InputError, match="plan"):
        calibrate_gates(model, gate_tokens, method="closed_form")
    with pytest.raises(InputError, match="method"):
        calibrate_gates(model, gate_tokens, method="adam")
    with pytest.raises(InputError, match="held_out"):
        calibrate_gates(model, gate_tokens, held_out=1.5, steps=0)
    with pytest.raises(InputError, match="base_hooks"):
        calibrate_gates(model, gate_tokens, base_hooks=[("blocks.0.hook_mlp_out",)], steps=0)
