"""Shared by the protocol tests: independent recomputations (TransformerLens's own ``run_with_cache``, direct calls
of ``blocks[l].ln2`` / ``blocks[l].mlp``, plain torch) and each protocol run once per tiny model.

Agreement: <= 1e-6 absolute (float64 geometry on float32 activations of the same forward). Parallel blocks (tiny
NeoX) are covered by the ``tiny`` fixture.
"""

import plotly.graph_objects as go
import pytest
import torch

from tests.helpers import first_output, hook_count
from tl_steering.backends import adapt, weights_fingerprint
from tl_steering.protocols import angular_deficit, diversity, ffn_ablation
from tl_steering.results import Result

TOL = 1e-6


def _tl_cache(model, tokens, hooks=()):
    with torch.no_grad(), model.hooks(fwd_hooks=list(hooks)):
        logits, cache = model.run_with_cache(tokens)
    return logits, {k: v.detach() for k, v in cache.items()}


def _phi(model, layer, x):
    blk = model.blocks[layer]
    ln2 = getattr(blk, "ln2", None) or blk.ln1
    with torch.no_grad():
        return first_output(blk.mlp(first_output(ln2(x))))


def _is_parallel(model, layer):
    return adapt(model).is_parallel(layer)


def _cos(a, b):
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


def _tan(v, u):
    return v - (v * u).sum(-1, keepdim=True) * u


def _angle(a, b):
    return torch.arccos(_cos(a, b).clamp(-1, 1))


def _component_hooks(model, keep, layers, skip0=False):
    """Independent implementation of the radial/tangential/zero FFN patch (docs/ablation.md)."""
    hooks = []
    for lay in layers:
        ref = f"blocks.{lay}.hook_resid_pre" if _is_parallel(model, lay) else f"blocks.{lay}.hook_resid_mid"
        st = {}

        def stash(act, hook, st=st):
            st["u"] = act.double() / act.double().norm(dim=-1, keepdim=True)

        def patch(act, hook, st=st):
            u, phi = st["u"], act.double()
            rad = (phi * u).sum(-1, keepdim=True) * u
            new = {"radial": rad, "tangential": phi - rad, "zero": torch.zeros_like(phi)}[keep]
            if skip0:
                new[:, 0] = phi[:, 0]
            return new.to(act.dtype)

        hooks += [(ref, stash), (f"blocks.{lay}.hook_mlp_out", patch)]
    return hooks


@pytest.fixture(scope="session")
def results(tiny, tiny_tokens):
    """Each protocol once per tiny model, with hooks and weights checked before and after."""
    before_hooks, before_w = hook_count(tiny), weights_fingerprint(tiny)
    out = {
        "deficit": angular_deficit(tiny, tiny_tokens, n_bootstrap=200, batch_size=2),
        "ablation": ffn_ablation(tiny, tiny_tokens, scope="per_layer", batch_size=2, n_bootstrap=100),
        "ablation_keep0": ffn_ablation(tiny, tiny_tokens, keep=("tangential", "radial"), ablate_position_0=False,
                                       include_random_tangent=False, n_bootstrap=0),
        "diversity": diversity(tiny, tiny_tokens, gains=(0.5, 1.0, 2.0), batch_size=2),
    }
    assert hook_count(tiny) == before_hooks == 0
    assert weights_fingerprint(tiny) == before_w
    return out


# ----------------------------------------------------------------------------------------------------------
# shared statistics (tl_steering.stats, tl_steering.geometry)


def check_round_trip(res, tmp_path, name):
    """Saved as JSON and as safetensors, loaded by its class and by ``Result.load``: the same dict."""
    for suffix in ("json", "safetensors"):
        path = res.save(tmp_path / f"{name}.{suffix}")
        back = type(res).load(path)
        assert type(back) is type(res)
        assert back.to_dict() == res.to_dict()
        assert Result.load(path).to_dict() == res.to_dict()


def check_summary_and_plots(res, n_sequences, protocol, extra_plots=()):
    s = res.summary()
    assert s and all(isinstance(k, str) for k in s)
    assert res.provenance.n_sequences == n_sequences and res.provenance.seed == 0
    assert res.provenance.extra["protocol"] == protocol
    figs = [res.plot(), *extra_plots]
    assert all(isinstance(f, go.Figure) and len(f.data) > 0 for f in figs)
