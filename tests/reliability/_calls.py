"""Every public entry point of tl_steering, called with small settings (shared by the reliability tests)."""

import torch

import tl_steering as ts
from tl_steering import hooks as H
from tl_steering.backends import adapt


def _probe(m, t):
    with ts.probe(m) as trace:
        m(t)
    return trace.result()


def _run_hooks(factory):
    def call(m, t):
        return adapt(m).run_with_hooks(t, factory(m))
    return call


PUBLIC_CALLS = {
    "angular_deficit": lambda m, t: ts.angular_deficit(m, t, n_bootstrap=20),
    "ffn_ablation": lambda m, t: ts.ffn_ablation(m, t, n_bootstrap=20),
    "diversity": lambda m, t: ts.diversity(m, t, gains=(0.5, 1.0)),
    "parallel_defect": lambda m, t: ts.parallel_defect(m, t, evaluate=True, timing=False, brackets=True, n_random=2),
    "critical_points": lambda m, t: ts.critical_points(m, 0, n_starts=4, tokens=t),
    "prefix_sensitivity": lambda m, t: ts.prefix_sensitivity(m, t, layer=0, position=4),
    "prefix_statistics": lambda m, t: ts.prefix_statistics(m, t),
    "calibrate_gates": lambda m, t: ts.calibrate_gates(m, t, steps=3, base_hooks=H.parallel_blocks(m, [0])),
    "probe": _probe,
    "parallelize": lambda m, t: ts.parallelize(m, [0])(t),
    "hooks.ffn_component": _run_hooks(lambda m: H.ffn_component(m, "random_tangent")),
    "hooks.parallel_blocks": _run_hooks(lambda m: H.parallel_blocks(m, [1])),
    "hooks.ffn_gate": _run_hooks(lambda m: H.ffn_gate(m, {0: 0.5})),
    "hooks.attention_gain": _run_hooks(lambda m: H.attention_gain(m, 1.5)),
    "text_tokens": lambda m, t: ts.text_tokens(m, n_windows=2, length=16),
}

# the calls that run at least one forward pass of the model (so a fault can be injected inside one)
FORWARD_CALLS = [k for k in PUBLIC_CALLS if k != "text_tokens"]


def tokens_for(model, n=3, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, int(model.cfg.d_vocab), (n, length), generator=g)
