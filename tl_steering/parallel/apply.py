"""The public API of the parallel executor, :func:`parallelize` (the fused block, its hooks and masks:
docs/parallel.md; the block surgery: :mod:`tl_steering.backends.executor`)."""

import contextlib
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import validation
from ..backends import adapt
from ..backends.copying import deepcopy_module
from ..backends.decoding import route_cache_keyword
from ..backends.executor import parallel_states, parallelize_blocks
from ..errors import InputError, ParallelBlockError
from ..hooks import checked_corrections
from ..backends.ownership import exclusive

if TYPE_CHECKING:
    from .plan_result import ParallelPlan

@exclusive
def parallelize(model: Any, layers: "ParallelPlan | Sequence[int] | int", fuse: bool = True, streams: bool = False,
                verify: bool = True, gates: Mapping[int, float] | None = None,
                biases: Mapping[int, Tensor] | None = None, linears: Mapping[int, Tensor] | None = None) -> Any:
    """A new model (a copy on ``model``'s weights, which stay unmodified) in which exactly the chosen blocks compute
    x + A(x) + Phi(x) (parallel attention/MLP): ``layers`` a ``ParallelPlan`` (run as fitted) or block indices;
    every argument in docs/parallel.md "API" ("Design: the fused block", "Hooks")."""
    layers, gates, biases, linears = _plan_arguments(layers, gates, biases, linears)
    ad = adapt(model)
    # strict: an int or a sequence of ints (a str, bool, float or None is an error naming `layers`)
    empty = isinstance(layers, (list, tuple, range)) and len(layers) == 0
    chosen = [] if empty else ad.layers(layers, allow_none=False)
    ad.require_resident(range(ad.n_layers), "parallelize (a copy of the model)")
    already = [lay for lay in chosen if ad.is_parallel(lay)]
    if already:
        warnings.warn(f"blocks {already} are parallel attention/MLP blocks already; parallelize leaves them as "
                      "they are", stacklevel=2)
    todo = [lay for lay in chosen if not ad.is_parallel(lay)]
    validation.check_weights_finite(model, todo, "parallelize")  # NaN weights: name the layer, not the layout
    g_of, b_of, w_of = checked_corrections(ad, todo, gates, biases, "parallelize", linears)
    corrections = {lay: (g_of.get(lay, 1.0), b_of.get(lay), w_of.get(lay))
                   for lay in sorted(set(g_of) | set(b_of) | set(w_of))}
    # the copy is ours (generate()'s KV cache works on it); its weights are model's, the fused blocks' are new
    new = route_cache_keyword(deepcopy_module(model, share_parameters=True))
    if not todo:
        return new
    with torch.no_grad():
        notes = parallelize_blocks(new, ad.backend, todo, fuse, streams, corrections)
    for n in notes:
        warnings.warn(n, stacklevel=2)
    # parallelize(parallelize(m, [1, 2]), [0]) reports [0, 1, 2]: the copy keeps the earlier surgery
    done = sorted(set(parallel_layers(model)) | set(todo))
    new._tl_steering_parallel = {"layers": done, "fuse": fuse, "streams": streams, "notes": notes,
                                 "corrected": sorted(corrections)}
    if verify and fuse and len(notes) < len(todo):
        _verify(new)
    return new


def _plan_arguments(layers: Any, gates: Any, biases: Any, linears: Any) -> tuple[Any, Any, Any, Any]:
    """``(layers, gates, biases, linears)`` of a ``ParallelPlan`` given as ``layers`` (every fitted part), else the
    arguments as given."""
    from .plan_result import ParallelPlan

    if not isinstance(layers, ParallelPlan):
        return layers, gates, biases, linears
    extra = [n for n, v in (("gates", gates), ("biases", biases), ("linears", linears)) if v is not None]
    if extra:
        raise InputError(f"parallelize(model, plan) applies the plan's own fitted correction; got {', '.join(extra)}= "
                         "as well. Pass the plan alone, or its layers with explicit corrections: parallelize(model, "
                         "plan.layers, gates=..., biases=..., linears=...)")
    g, b = layers.corrections()
    return list(layers.layers), g or None, b or None, layers.linear_maps() or None


def parallel_layers(model: Any) -> list[int]:
    """The blocks :func:`parallelize` turned parallel in ``model`` (empty for any other model)."""
    info = getattr(model, "_tl_steering_parallel", None)
    return list(info["layers"]) if info else []


@contextlib.contextmanager
def unfused(model: Any):
    """Inside the block, every parallelized block of ``model`` runs the unfused parallel path."""
    states = parallel_states(model)
    before = [s.force_unfused for s in states]
    for s in states:
        s.force_unfused = True
    try:
        yield model
    finally:
        for s, b in zip(states, before):
            s.force_unfused = b


def _verify(model: Any) -> None:
    ad = adapt(model)
    vocab = int(model.cfg.d_vocab)
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(1, vocab, (1, 8), generator=g).to(ad.device)
    with torch.no_grad():
        fused = model(tokens, return_type="logits")
        with unfused(model):
            ref = model(tokens, return_type="logits")
    err = float((fused.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))
    tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(ad.dtype, 3e-2)
    if not err <= tol:
        raise ParallelBlockError(
            f"the fused parallel blocks disagree with the unfused parallel reference (relative error {err:.3g} > "
            f"{tol:g}); this model's weight layout is not what the fold expects. Use parallelize(..., fuse=False).")


__all__ = ["parallel_layers", "parallelize", "unfused"]
