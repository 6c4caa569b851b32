"""Weight processing read from the model itself and recorded in provenance (docs/loading.md, "Weight processing").

Tiny models, raw and processed, on every backend of this TransformerLens line; also a model the user processes
after loading (a bridge's ``enable_compatibility_mode()``) and one wrapped by ``wrap_hf`` without our loader's tag."""

import warnings

import pytest
import torch

import tl_steering as ts
from tl_steering.backends import adapt, hooked_available, tiny_hf_model, wrap_hf
from tl_steering.backends.processing import weight_processing

BACKENDS = ["bridge", "hooked"] if hooked_available() else ["bridge"]
SIZES = dict(n_layers=2, d_model=32, n_heads=2, n_ctx=32)
PROCESSED_LN = ["fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases"]


def _tokens():
    return torch.randint(1, 257, (3, 16), generator=torch.Generator().manual_seed(0))


def _deficit(model, n=4):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res = ts.angular_deficit(model, _tokens(), n_bootstrap=n)
    return res, [str(x.message) for x in w if "processed by TransformerLens" in str(x.message)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_raw_and_processed_are_told_apart_and_recorded(backend):
    raw = ts.tiny_model("gpt2", backend=backend, seed=0, **SIZES)
    tl = ts.tiny_model("gpt2", backend=backend, seed=0, processing="tl", **SIZES)
    r_raw, warned_raw = _deficit(raw)
    r_tl, warned_tl = _deficit(tl)
    assert (r_raw.provenance.processing, r_raw.provenance.processing_steps) == ("raw", [])
    compat = ["compatibility_mode"] if backend == "bridge" else []
    assert (r_tl.provenance.processing, r_tl.provenance.processing_steps) == ("tl", compat + PROCESSED_LN)
    assert warned_raw == [] and len(warned_tl) == 1 and "differ from the raw model's" in warned_tl[0]
    # centred writes move the geometry (the issue: a GPT-2 bridge's layer-1 deficit 0.3465 -> 0.2936), not the loss
    d_raw, d_tl = r_raw.deficit.double(), r_tl.deficit.double()
    print(f"\n{backend}: layer deficits raw {d_raw.tolist()} processed {d_tl.tolist()}")
    assert (d_raw - d_tl).abs().max() > 1e-2
    l_raw = adapt(raw).loss_per_token(_tokens()).mean()
    l_tl = adapt(tl).loss_per_token(_tokens()).mean()
    assert float(l_raw) == pytest.approx(float(l_tl), rel=1e-4)
    _, again = _deficit(tl)
    assert again == []  # once per model


@pytest.mark.parametrize("backend", BACKENDS)
def test_rmsnorm_model_is_processed_but_not_centred(backend):
    m = ts.tiny_model("llama", backend=backend, seed=0, processing="tl", **SIZES)
    wp = weight_processing(m)
    assert wp.label == "tl" and "fold_ln" in wp.steps and "center_unembed" in wp.steps
    assert "center_writing_weights" not in wp.steps and not wp.changes_residual
    res, warned = _deficit(m)
    assert warned == [] and res.provenance.processing == "tl"


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrap_hf_without_our_tag_is_not_unknown(backend):
    for processing in ("raw", "tl"):
        hf, tok = tiny_hf_model("gpt2", 0, **SIZES)
        m = wrap_hf(hf, tok, backend, processing, "cpu", label="wrapped")
        assert not hasattr(m, "_tl_steering_info")
        prov = adapt(m).provenance(_tokens())
        assert prov.processing == processing
        assert adapt(m).info.processing == processing


def test_processing_done_by_the_user_after_loading_is_seen():
    m = ts.tiny_model("gpt2", backend="bridge", seed=0, **SIZES)
    assert weight_processing(m).label == "raw"
    m.enable_compatibility_mode(disable_warnings=True)
    wp = weight_processing(m)  # the cache follows the weights
    assert (wp.label, list(wp.steps)) == ("tl", ["compatibility_mode"] + PROCESSED_LN)
    assert adapt(m).info.processing == "tl"
    n = ts.tiny_model("gpt2", backend="bridge", seed=0, **SIZES)
    n.enable_compatibility_mode(disable_warnings=True, no_processing=True)
    wp = weight_processing(n)
    assert (wp.label, wp.steps) == ("raw", ("compatibility_mode",))


def test_loader_tag_cannot_hide_processing():
    m = ts.tiny_model("gpt2", backend="bridge", seed=0, **SIZES)  # tagged processing="raw" by the loader
    m.enable_compatibility_mode(disable_warnings=True)
    res, warned = _deficit(m)
    assert res.provenance.processing == "tl" and "center_writing_weights" in res.provenance.processing_steps
    assert len(warned) == 1


def test_result_files_written_before_these_fields_load(tmp_path):
    """A result file whose provenance predates ``processing_steps`` / ``user_hooks`` (``added_fields``) loads."""
    import json

    res, _ = _deficit(ts.tiny_model("gpt2", backend="bridge", seed=0, **SIZES))
    d = res.to_dict()
    for key in ("processing_steps", "user_hooks"):
        d["provenance"].pop(key)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    old = type(res).load(path)
    assert old.provenance.processing_steps == [] and old.provenance.user_hooks == []
    assert old.provenance.processing == "raw"


def test_cache_key_follows_every_weight_and_not_the_forwards():
    """The processing cache is keyed on each parameter's identity and in-place version, read from every module's
    ``_parameters`` (a bridge's own and the wrapped model's): a forward leaves the key as it was, an in-place
    write or a replaced parameter changes it, and the result follows (a centred embedding read anew)."""
    from tl_steering.backends.processing import _state_key

    m = ts.tiny_model("gpt2", backend="bridge", seed=0, **SIZES)
    key = _state_key(m)
    with torch.no_grad():
        m(_tokens())
    assert _state_key(m) == key
    p = next(m.parameters())
    with torch.no_grad():
        p.add_(0.0)
    assert _state_key(m) != key
    key = _state_key(m)
    blk = m.original_model.transformer.h[0].mlp.c_fc
    blk.weight = torch.nn.Parameter(blk.weight.detach().clone())
    assert _state_key(m) != key
    assert len({id(q) for q in m.parameters()} - {k[0] for k in _state_key(m)[3:]}) == 0
