"""The field's layer-choice scores (computed by tl_steering.parallel.defect, named in ``strategies.PEER_SCORES``;
docs/defect.md "Peer scores") against a hand-written float64 reference, on float64 copies of every tiny
architecture and backend, and as planner strategies."""

import math

import torch

import tl_steering as ts
from tests.helpers import assert_no_hooks
from tl_steering.backends import adapt
from tl_steering.parallel.strategies import PEER_SCORES


def _cos(u: list[float], v: list[float]) -> float:
    dot = sum(a * b for a, b in zip(u, v))
    nu, nv = math.sqrt(sum(a * a for a in u)), math.sqrt(sum(b * b for b in v))
    return dot / (max(nu, 1e-12) * max(nv, 1e-12))


def _reference(model, tokens) -> dict[str, list[float]]:
    """Token means over positions >= 1 of 1 - cos(x_l, x_{l+1}), arccos(cos(x_l, x_{l+1})) / pi and
    1 - cos(Phi(x + a), Phi(x)), written with Python floats from the cached activations."""
    ad = adapt(model)
    names = [ad.hook_name(lay, s) for lay in ad.layers() for s in ("resid_pre", "resid_post", "attn_out", "mlp_out")]
    _, cache = ad.run_with_cache(tokens, names)
    out: dict[str, list[float]] = {name: [] for name in PEER_SCORES}
    with torch.no_grad():
        for lay in ad.layers():
            x = cache[ad.hook_name(lay, "resid_pre")]
            post = cache[ad.hook_name(lay, "resid_post")]
            phi = ad.ffn(lay)
            # the FFN write with its attention input: the model's own for a sequential block, Phi(x + a) for a
            # parallel one (the counterfactual sequential write)
            with_a = phi(x + cache[ad.hook_name(lay, "attn_out")]) if ad.is_parallel(lay) else \
                cache[ad.hook_name(lay, "mlp_out")]
            without_a = phi(x)
            sums = dict.fromkeys(PEER_SCORES, 0.0)
            n = 0
            for b in range(tokens.shape[0]):
                for p in range(1, tokens.shape[1]):
                    c = _cos(x[b, p].tolist(), post[b, p].tolist())
                    sums["block_influence"] += 1 - c
                    sums["angular_distance"] += math.acos(max(-1.0, min(1.0, c))) / math.pi
                    sums["ffn_fusion"] += 1 - _cos(with_a[b, p].tolist(), without_a[b, p].tolist())
                    n += 1
            for name in PEER_SCORES:
                out[name].append(sums[name] / n)
    return out


def test_peer_scores_match_the_reference(tiny64, tiny_tokens):
    toks = tiny_tokens[:2, :10]
    res = ts.parallel_scores(tiny64, toks, batch_size=1, fisher_samples=0)
    ref = _reference(tiny64, toks)
    for name in PEER_SCORES:
        torch.testing.assert_close(res.scores[name], torch.tensor(ref[name], dtype=torch.float64),
                                   rtol=1e-9, atol=1e-12, msg=name)
        assert bool((res.scores[name] >= -1e-12).all())
    # the same numbers in the defect protocol's result (one forward: batched in 2 here, 1 above)
    d = ts.parallel_defect(tiny64, toks, batch_size=2)
    for name in PEER_SCORES:
        torch.testing.assert_close(d.peer_scores[name], res.scores[name], rtol=1e-9, atol=1e-12)
    assert_no_hooks(tiny64)


def test_peer_strategies_plan_by_their_score(planner_model, planner_tokens):
    """A peer score as a strategy: the k lowest-scored layers (SLEB: test_plan.py)."""
    cal, held = planner_tokens[:2], planner_tokens[2:]
    p = ts.plan_parallel(planner_model, cal, 2, held_out=held, strategy=list(PEER_SCORES), refit="none",
                         k_values=[1, 2], batch_size=2, fisher_samples=0)
    scores = ts.parallel_scores(planner_model, cal, batch_size=2, fisher_samples=0)
    for name in PEER_SCORES:
        so = scores.score_of(name)
        assert p.plan_of(name) == sorted(sorted(so, key=lambda lay: (so[lay], lay))[:2]), name
        assert p.strategy_costs[name]["forward"] == 1 and p.strategy_costs[name]["backward"] == 0
    assert p.strategy in PEER_SCORES and set(p.held_out_curves) == set(PEER_SCORES)
