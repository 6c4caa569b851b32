"""Sub-module timing and the speedup estimate of a parallel plan (opt-in; docs/defect.md "Speedup estimate"):
an estimate of the critical path if attention and FFN ran concurrently, not a kernel measurement."""

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import InputError
from .._util.timing import median_seconds

SPEEDUP_LABEL = "estimate (sub-module times, critical path max(t_attn, t_ffn))"
"""Label of every speedup estimate: an estimate, not a measured kernel speedup."""


def submodule_times(ad: Any, tokens: Tensor, layers: Sequence[int], repeats: int) -> dict[str, Any]:
    """Median seconds of ``ad.attention(l)`` on resid_pre and ``ad.ffn(l)`` on the FFN input per layer of
    ``layers`` on ``tokens`` (one batch, 1 warm-up call), of a hook-free forward, and ``t_other`` (the forward
    minus the sub-modules, clamped at 0; NaN unless every layer is timed)."""
    names = []
    for lay in layers:
        names += [ad.hook_name(lay, "resid_pre"), ad.hook_name(lay, ad.ffn_input_site(lay))]
    _, cache = ad.run_with_cache(tokens, list(dict.fromkeys(names)))
    t_attn, t_ffn = [], []
    for lay in layers:
        x, y = cache[ad.hook_name(lay, "resid_pre")], cache[ad.hook_name(lay, ad.ffn_input_site(lay))]
        attn, phi = ad.attention(lay), ad.ffn(lay)
        t_attn.append(median_seconds(lambda: attn(x), x.device, 1, repeats))
        t_ffn.append(median_seconds(lambda: phi(y), x.device, 1, repeats))
    t_forward = median_seconds(lambda: ad.run_with_hooks(tokens, [], return_type="logits"), ad.device, 1,
                               max(3, repeats // 2))
    t_other = max(t_forward - float(sum(t_attn) + sum(t_ffn)), 0.0) if len(layers) == ad.n_layers else math.nan
    return {"t_attn": torch.tensor(t_attn, dtype=torch.float64), "t_ffn": torch.tensor(t_ffn, dtype=torch.float64),
            "t_forward": t_forward, "t_other": t_other, "timing_shape": [int(s) for s in tokens.shape],
            "timing_device": str(ad.device)}


def estimate_speedup(layers: Sequence[int], already_parallel: Sequence[bool], t_attn: Tensor, t_ffn: Tensor,
                     chosen: Sequence[int], t_other: float = math.nan, timing_shape: Sequence[int] = (),
                     device: str = "") -> dict[str, Any]:
    """Estimated speedup of making ``chosen`` parallel from per-layer sub-module times: ``T_seq / T_par`` of
    docs/defect.md "Speedup estimate" (already-parallel blocks count with ``max`` in both; ``*_with_other`` adds
    ``t_other`` to both)."""
    if not layers or not torch.isfinite(t_attn).all() or not torch.isfinite(t_ffn).all():
        raise InputError("no sub-module times: run parallel_defect(..., timing=True)")
    picked = sorted({int(x) for x in chosen})
    unknown = [x for x in picked if x not in layers]
    if unknown:
        raise InputError(f"layers {unknown} were not analysed (analysed: {list(layers)})")
    ta, tf = t_attn.tolist(), t_ffn.tolist()
    t_seq = t_par = 0.0
    for i, lay in enumerate(layers):
        seq_cost = max(ta[i], tf[i]) if already_parallel[i] else ta[i] + tf[i]
        t_seq += seq_cost
        t_par += max(ta[i], tf[i]) if lay in picked else seq_cost
    return {"label": SPEEDUP_LABEL, "layers": picked, "k": len(picked), "T_seq_s": t_seq, "T_par_s": t_par,
            "speedup": t_seq / t_par if t_par > 0 else math.nan, "T_other_s": t_other,
            "speedup_with_other": (t_seq + t_other) / (t_par + t_other) if math.isfinite(t_other) else math.nan,
            "timing_shape": list(timing_shape), "device": device}


__all__ = ["SPEEDUP_LABEL", "estimate_speedup", "submodule_times"]
