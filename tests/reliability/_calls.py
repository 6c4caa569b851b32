"""Every public entry point of tl_steering, called with small settings (shared by the reliability tests).

One table, two sizes: ``public_calls("small")`` (the hygiene / bad-input / strict-argument tests: settings that
exercise every code path) and ``public_calls("tiny")`` (the interrupt stress test, which runs each call dozens of
times: the fewest bootstrap draws, random controls, starts, iterations and steps that still run the same code).
"""

import signal
from collections.abc import Callable

import torch
from transformer_lens.hook_points import HookPoint

import tl_steering as ts
from tl_steering import hooks as H
from tl_steering.backends import adapt, interrupts
from tl_steering.backends.hookbase import _HOOK_DICTS, is_owned


def hook_state(model: torch.nn.Module) -> dict[str, tuple]:
    """A comparable description of every hook on ``model`` (per module name: hook functions of each torch hook
    dict and of TL's handle lists). Tests compare it before/after a call."""
    out: dict[str, tuple] = {}
    for name, m in model.named_modules(remove_duplicate=True):
        parts = []
        for attr in _HOOK_DICTS:
            d = getattr(m, attr, None)
            parts.append(tuple(id(f) for f in (d or {}).values()))
        if isinstance(m, HookPoint):
            parts += [tuple(id(h) for h in m.fwd_hooks), tuple(id(h) for h in m.bwd_hooks)]
        if any(parts):
            out[name] = tuple(parts)
    return out


def owned_hooks(model: torch.nn.Module) -> list[str]:
    """Names of the modules that carry a hook tagged as tl_steering's (should be empty outside a call)."""
    return [name for name, m in model.named_modules()
            if any(is_owned(f) for attr in _HOOK_DICTS for f in (getattr(m, attr, None) or {}).values())]


def handler_installed() -> bool:
    """Whether tl_steering's signal handler is installed for any signal (False outside every tl_steering call)."""
    return any(signal.getsignal(s) is interrupts._on_signal for s in interrupts._SIGNALS)


# the settings that differ between sizes
_SIZES = {
    "small": {"n_bootstrap": 20, "n_random": 2, "n_starts": 4, "cp_tokens": None, "cp_kwargs": {}, "steps": 3},
    "tiny": {"n_bootstrap": 4, "n_random": 1, "n_starts": 1, "cp_tokens": (1, 6), "cp_kwargs": {"options": {"max_iter": 2}},
             "steps": 1},
}


def _probe(m, t):
    with ts.probe(m) as trace:
        m(t)
    return trace.result()


def _run_hooks(factory):
    def call(m, t):
        return adapt(m).run_with_hooks(t, factory(m))
    return call


def public_calls(size: str = "small") -> dict[str, Callable]:
    """``{name: call(model, tokens)}`` for every public entry point, with the settings of ``size``."""
    s = _SIZES[size]
    nb, nr, steps = s["n_bootstrap"], s["n_random"], s["steps"]

    def cp_tokens(t):
        return t if s["cp_tokens"] is None else t[: s["cp_tokens"][0], : s["cp_tokens"][1]]

    return {
        "angular_deficit": lambda m, t: ts.angular_deficit(m, t, n_bootstrap=nb),
        "ffn_ablation": lambda m, t: ts.ffn_ablation(m, t, n_bootstrap=nb),
        "diversity": lambda m, t: ts.diversity(m, t, gains=(0.5, 1.0)),
        "parallel_defect": lambda m, t: ts.parallel_defect(m, t, evaluate=True, timing=False, brackets=True,
                                                          n_random=nr),
        "critical_points": lambda m, t: ts.critical_points(m, 0, n_starts=s["n_starts"], tokens=cp_tokens(t),
                                                          **s["cp_kwargs"]),
        "prefix_sensitivity": lambda m, t: ts.prefix_sensitivity(m, t, layer=0, position=4),
        "prefix_statistics": lambda m, t: ts.prefix_statistics(m, t),
        "calibrate_gates": lambda m, t: ts.calibrate_gates(m, t, steps=steps, base_hooks=H.parallel_blocks(m, [0])),
        "probe": _probe,
        "parallelize": lambda m, t: ts.parallelize(m, [0])(t),
        "hooks.ffn_component": _run_hooks(lambda m: H.ffn_component(m, "random_tangent")),
        "hooks.parallel_blocks": _run_hooks(lambda m: H.parallel_blocks(m, [1])),
        "hooks.ffn_gate": _run_hooks(lambda m: H.ffn_gate(m, {0: 0.5})),
        "hooks.attention_gain": _run_hooks(lambda m: H.attention_gain(m, 1.5)),
        "text_tokens": lambda m, t: ts.text_tokens(m, n_windows=2, length=16),
    }


PUBLIC_CALLS = public_calls("small")

# the calls that run at least one forward pass of the model (so a fault can be injected inside one)
FORWARD_CALLS = [k for k in PUBLIC_CALLS if k != "text_tokens"]


def tokens_for(model, n=3, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, int(model.cfg.d_vocab), (n, length), generator=g)
