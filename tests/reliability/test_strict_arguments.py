"""Strict arguments (one helper, tl_steering.validation, used by every entry point), errors that say where
(NaN weights name the layer and site), and the smaller points of a real session: nested parallelize, a probe
without a forward, the device honoured or refused, what processing="tl" keeps invariant."""

import warnings

import pytest
import torch

import tl_steering as ts
from tl_steering import errors as E
from tl_steering import hooks as H
from tl_steering import validation as V
from tl_steering.backends import adapt, tiny_hf_model, weights_fingerprint, wrap_hf

from ._calls import PUBLIC_CALLS, tokens_for


@pytest.fixture(scope="module")
def model():
    return ts.tiny_model("gpt2", backend="bridge", seed=0)


# ----------------------------------------------------------------------------------------------------------
# the helper itself


@pytest.mark.parametrize("bad,match", [
    ("12", "got the string '12'"),
    ([True], r"layers\[0\] must be an int, got True \(bool\)"),
    ([1.5], r"layers\[0\] must be an int, got 1.5 \(float\)"),
    (1.0, r"layers must be an int or a sequence of ints, got 1.0"),
    (True, "got True"),
    ([0, None], r"layers\[1\] must be an int, got None"),
    (torch.tensor([0.0]), r"layers\[0\] must be an int"),
])
def test_as_layers_refuses_wrong_types(bad, match):
    with pytest.raises(E.ArgumentTypeError, match=match):
        V.as_layers(bad, 4)
    assert issubclass(E.ArgumentTypeError, TypeError) and issubclass(E.ArgumentTypeError, E.InputError)


def test_as_layers_accepts_ints():
    import numpy as np

    assert V.as_layers(None, 3) == [0, 1, 2]
    assert V.as_layers(-1, 3) == [2]
    assert V.as_layers((2, 0, 2), 3) == [0, 2]
    assert V.as_layers(range(2), 3) == [0, 1]
    assert V.as_layers(torch.tensor([1, 2]), 3) == [1, 2]
    assert V.as_layers([np.int64(1)], 3) == [1]
    with pytest.raises(E.LayerIndexError, match="out of range"):
        V.as_layers([3], 3)
    with pytest.raises(E.ArgumentTypeError, match="got None"):
        V.as_layers(None, 3, allow_none=False)
    with pytest.raises(E.InputError, match="empty"):
        V.as_layers([], 3)


def test_scalar_helpers():
    assert V.as_int(3, "n") == 3 and V.as_float(2, "g") == 2.0
    for bad in (True, 2.0, "3", None):
        with pytest.raises(E.ArgumentTypeError, match="n must be an int"):
            V.as_int(bad, "n")
    for bad in (True, "1", None):
        with pytest.raises(E.ArgumentTypeError, match="g must be a number"):
            V.as_float(bad, "g")
    with pytest.raises(E.InputError, match="finite"):
        V.as_float(float("inf"), "g")
    with pytest.raises(E.ArgumentTypeError, match="True or False"):
        V.as_bool(1, "flag")
    with pytest.raises(E.InputError, match="keep"):
        V.as_choices(["tangential", "bogus"], "keep", ("tangential", "radial"))
    with pytest.raises(E.ArgumentTypeError, match="keep must be one of"):
        V.as_choices(None, "keep", ("tangential", "radial"))


# ----------------------------------------------------------------------------------------------------------
# applied at the public entry points


def _entry_points(m, t, layers):
    """Public calls taking a layer selection, with ``layers`` passed through."""
    return {
        "angular_deficit": lambda: ts.angular_deficit(m, t, layers=layers, n_bootstrap=2),
        "ffn_ablation": lambda: ts.ffn_ablation(m, t, layers=layers, n_bootstrap=2),
        "parallel_defect": lambda: ts.parallel_defect(m, t, layers=layers, timing=False),
        "probe": lambda: ts.probe(m, layers=layers),
        "parallelize": lambda: ts.parallelize(m, layers),
        "ffn_component": lambda: H.ffn_component(m, layers=layers),
        "parallel_blocks": lambda: H.parallel_blocks(m, layers),
        "attention_gain": lambda: H.attention_gain(m, 1.5, layers=layers),
    }


@pytest.mark.parametrize("bad,match", [("12", "string '12'"), ([True], "got True"), ([1.5], "got 1.5")])
def test_layers_type_checked_everywhere(model, bad, match):
    t = tokens_for(model)
    before = weights_fingerprint(model)
    for name, call in _entry_points(model, t, bad).items():
        with pytest.raises(E.ArgumentTypeError, match=match):
            call()
    assert weights_fingerprint(model) == before


def test_none_where_a_value_is_required(model):
    t = tokens_for(model)
    with pytest.raises(E.ArgumentTypeError, match="layers must be an int or a sequence of ints, got None"):
        H.parallel_blocks(model, None)
    with pytest.raises(E.ArgumentTypeError, match="layers must be an int or a sequence of ints, got None"):
        ts.parallelize(model, None)
    with pytest.raises(E.ArgumentTypeError, match="keep must be one of"):
        ts.ffn_ablation(model, t, keep=None)
    with pytest.raises(E.ArgumentTypeError, match="layer must be an int"):
        ts.prefix_sensitivity(model, t, layer="0", position=3)
    with pytest.raises(E.ArgumentTypeError, match="gates key"):
        H.ffn_gate(model, {True: 0.5})
    with pytest.raises(E.ArgumentTypeError, match="gates must be"):
        H.ffn_gate(model, None)
    with pytest.raises(E.ArgumentTypeError, match="exclude_positions"):
        ts.probe(model, exclude_positions="0")


# probe and parallelize are left out: there the user runs the forward (TransformerLens's own IndexError)
@pytest.mark.parametrize("name", [k for k in PUBLIC_CALLS if k not in ("parallelize", "text_tokens", "probe")])
def test_sequence_longer_than_context(model, name):
    n_ctx = int(model.cfg.n_ctx)
    t = torch.randint(1, 200, (1, n_ctx + 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(E.InputError, match=f"longer than the model's context n_ctx={n_ctx}"):
        PUBLIC_CALLS[name](model, t)


# ----------------------------------------------------------------------------------------------------------
# errors that say where


@pytest.fixture(scope="module")
def nan_model():
    m = ts.tiny_model("gpt2", backend="bridge", seed=0)
    with torch.no_grad():
        p = next(p for n, p in m.blocks[1].named_parameters() if "mlp" in n and p.dim() == 2)
        p[0, 0] = float("nan")
    return m


def test_nan_weights_name_layer_and_site(nan_model):
    t = tokens_for(nan_model)
    with pytest.raises(E.NonFiniteError, match=r"ffn_ablation: non-finite weights at layer 1, FFN \(blocks\.1\."):
        ts.ffn_ablation(nan_model, t, n_bootstrap=2)
    with pytest.raises(E.NonFiniteError, match=r"parallelize: non-finite weights at layer 1, FFN"):
        ts.parallelize(nan_model, [1])
    with pytest.raises(E.NonFiniteError, match=r"probe: non-finite activation at layer 1, "):
        with ts.probe(nan_model) as trace:
            nan_model(t)
    # the hook factories name the layer too, when NaNs reach the FFN write mid-forward
    with pytest.raises(E.NonFiniteError, match=r"layer 1, mlp_out seen by ffn_component"):
        adapt(nan_model).run_with_hooks(t, H.ffn_component(nan_model, "tangential", layers=[1]))
    assert trace is not None


def test_probe_without_forward_is_an_error(model):
    with ts.probe(model) as trace:
        pass
    with pytest.raises(E.InputError, match="saw no forward pass"):
        trace.result()


def test_nested_parallelize_reports_every_parallel_block():
    from tl_steering.parallel.apply import parallel_layers

    m = ts.tiny_model("gpt2", backend="bridge", seed=0, n_layers=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = ts.parallelize(ts.parallelize(m, [1, 2]), [0])
    assert parallel_layers(p) == [0, 1, 2]
    assert [lay for lay in range(3) if adapt(p).is_parallel(lay)] == [0, 1, 2]


# ----------------------------------------------------------------------------------------------------------
# device: honoured or refused, before any model is loaded


def test_unavailable_or_unknown_device_refused_before_loading(monkeypatch):
    from tl_steering.backends import loading

    def must_not_load(*a, **k):
        raise AssertionError("a model was loaded before the device was checked")

    monkeypatch.setattr(loading, "_offline_hf", must_not_load)
    monkeypatch.setattr(loading, "_load_hub", must_not_load)
    if not torch.cuda.is_available():
        with pytest.raises(E.DeviceUnavailableError, match="CUDA is not available"):
            ts.load_model("smollm2-135m", device="cuda")
    for bad in ("tpu", "bogus", "cuda:x"):
        with pytest.raises(E.InputError, match="is not a device|not supported"):
            ts.load_model("smollm2-135m", device=bad)
    with pytest.raises(E.ArgumentTypeError, match="device must be a string"):
        ts.load_model("smollm2-135m", device=0.5)


def test_wrap_hf_moves_weights_to_the_device():
    hf, tok = tiny_hf_model("gpt2")
    if not torch.cuda.is_available():
        with pytest.raises(E.DeviceUnavailableError):
            wrap_hf(hf, tok, "bridge", "raw", "cuda", label="x")
    target = "cuda" if torch.cuda.is_available() else "meta"  # meta: a real move on a CPU-only machine
    m = wrap_hf(hf, tok, "bridge", "raw", target, label="x")
    devices = {p.device.type for p in m.parameters()}
    assert devices == {target}
    assert torch.device(m.cfg.device).type == target
    assert adapt(m).provenance().device.startswith(target)  # provenance = where the weights really are


def test_processing_tl_keeps_log_probabilities_not_logits():
    """processing="tl" (folded LayerNorm, centred weights): log-probabilities equal to ~1e-6; the logits shift by
    a constant per position (the documented invariant, README and load_model docstring)."""
    t = tokens_for(ts.tiny_model("gpt2"), n=2, length=12)
    raw = ts.tiny_model("gpt2", seed=0, processing="raw")(t).double()
    tl = ts.tiny_model("gpt2", seed=0, processing="tl")(t).double()
    lp = (raw.log_softmax(-1) - tl.log_softmax(-1)).abs().max()
    shift = raw - tl
    assert lp < 1e-5
    assert (shift - shift.mean(-1, keepdim=True)).abs().max() < 1e-5
