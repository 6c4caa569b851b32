"""Hook factories: plain TransformerLens ``fwd_hooks`` lists (``ffn_component``, ``parallel_blocks``, ``ffn_gate``,
``attention_gain``) that compose with ``run_with_hooks``, ``hooks()`` and a user's own hooks. See docs/hooks.md."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from . import geometry as geo
from . import validation
from .backends import adapt, check_finite
from .backends.fused import corrected_ffn_write
from .backends.hookbase import mark_intervention
from .backends.lifecycle import capture_site, orphan_safe
from .errors import ArgumentTypeError, HookNotFoundError, InputError
from .data.batching import HookList

Keep = Literal["tangential", "radial", "zero", "random_tangent", "full"]
KEEPS: tuple[str, ...] = get_args(Keep)


def _skip_mask(act: Tensor, skip_positions: Sequence[int]) -> Tensor | None:
    if not skip_positions:
        return None
    mask = torch.zeros(act.shape[-2], dtype=torch.bool, device=act.device)
    for p in skip_positions:
        if -act.shape[-2] <= p < act.shape[-2]:
            mask[p] = True
    return mask[:, None]


def _tagged(hooks: HookList, desc: str) -> HookList:
    """Tag each hook with the factory call that made it: a result measured under these hooks records ``desc`` in
    its provenance (``interventions``) and does not warn about them as the user's own (docs/hooks.md)."""
    return [(name, mark_intervention(fn, desc)) for name, fn in hooks]


def _armed_capture(ad: Any, layer: int, site: str) -> tuple[Callable, Callable[[Tensor], Tensor | None]]:
    """``(arm, take)``: ``arm``, a hook for hook_resid_pre (which fires before ``site`` is final), arms a capture of
    the value the block really uses at ``site``, after every hook there, whatever their order; ``take(like)`` gives
    it (else resid_pre's own value when ``site`` is resid_pre; None when neither was seen) and forgets it."""
    state: dict[str, Tensor | None] = {}

    def arm(act: Tensor, hook: Any) -> None:
        state.clear()
        state["fallback"] = act if site == "resid_pre" else None
        capture_site(ad, layer, site, lambda x: state.__setitem__("ref", x))

    def take(like: Tensor) -> Tensor | None:
        ref = state.pop("ref", None)
        if ref is None or ref.shape != like.shape:
            ref = state.pop("fallback", None)
        state.clear()
        return ref

    return orphan_safe(arm), take


def _layers_text(ad: Any, layers: Sequence[int]) -> str:
    layers = list(layers)
    return "all" if layers == list(range(ad.n_layers)) else str(layers)


def ffn_component(model: Any, keep: Keep = "tangential", layers: Sequence[int] | int | None = None,
                  reference: Literal["ffn_input", "resid_pre"] = "ffn_input", skip_positions: Sequence[int] = (),
                  seed: int = 0) -> HookList:
    """Replace each chosen layer's FFN write phi = hook_mlp_out by its part ``keep`` (P_u phi, <u, phi> u, zero, a
    seeded random tangent or phi itself), u = normalize(FFN input); ``layers``: default all at once (docs/hooks.md)."""
    ad = adapt(model)
    validation.as_choice(keep, "keep", KEEPS)
    validation.as_choice(reference, "reference", ("ffn_input", "resid_pre"))
    skip = validation.as_positions(skip_positions, "skip_positions")
    seed = validation.as_int(seed, "seed")
    hooks: HookList = []
    for layer in ad.layers(layers):
        ref_site = ad.ffn_input_site(layer) if reference == "ffn_input" else "resid_pre"
        arm, take = _armed_capture(ad, layer, ref_site)

        def patch(act: Tensor, hook: Any, take: Callable = take, layer: int = layer,
                  ref_site: str = ref_site) -> Tensor:
            if (ref := take(act)) is None:
                raise HookNotFoundError(
                    f"ffn_component: the FFN input of layer {layer} was not seen before hook_mlp_out (this model's "
                    "hook order is not supported, or a run interrupted earlier left this hook attached: call "
                    "model.reset_hooks())")
            check_finite(ref, layer, f"FFN input ({ref_site}) seen by ffn_component")
            check_finite(act, layer, "mlp_out seen by ffn_component")
            u = geo.normalize(ref)
            phi = act.to(torch.float64)
            if keep == "full":
                new = phi
            elif keep == "zero":
                new = torch.zeros_like(phi)
            elif keep == "radial":
                new = geo.radial_part(phi, u)
            elif keep == "tangential":
                new = geo.tangential_part(phi, u)
            else:  # random_tangent: a fresh generator per call, seeded by (seed, layer): the same hooks give the
                # same noise in every forward (and different, independent noise per layer)
                gen = torch.Generator(device=act.device).manual_seed((seed * 1_000_003 + layer) % (2**63 - 1))
                noise = torch.randn(phi.shape, generator=gen, device=act.device, dtype=torch.float64)
                noise = geo.tangential_part(noise, u)
                new = geo.normalize(noise) * geo.tangential_part(phi, u).norm(dim=-1, keepdim=True)
            mask = _skip_mask(act, skip)
            if mask is not None:
                new = torch.where(mask, phi, new)
            return new.to(act.dtype)

        hooks += [(ad.hook_name(layer, "resid_pre"), arm), (ad.hook_name(layer, "mlp_out"), orphan_safe(patch))]
    extra = (f", reference={reference!r}" if reference != "ffn_input" else "") + (
        f", skip_positions={list(skip)}" if skip else "") + (f", seed={seed}" if keep == "random_tangent" else "")
    return _tagged(hooks, f"ffn_component(keep={keep!r}, layers={_layers_text(ad, ad.layers(layers))}{extra})")


def ffn_gate(model: Any, gates: Mapping[int, float] | Sequence[float] | Tensor) -> HookList:
    """Scale each layer's FFN write, x^{l+1} = y + g_l Phi_l(y), by ``gates``: ``{layer: g}`` or one per layer (a
    tensor that requires grad keeps its graph: gates fitted by gradient descent; docs/gates.md)."""
    ad = adapt(model)
    if isinstance(gates, Mapping):
        items = [(ad.check_layer(k, "gates key (layer)"), v) for k, v in gates.items()]
    else:
        if gates is None or isinstance(gates, (str, bytes)) or not hasattr(gates, "__len__"):
            raise ArgumentTypeError(f"gates must be a {{layer: gate}} dict or one gate per layer, got {gates!r}")
        if len(gates) != ad.n_layers:
            raise InputError(f"gates has {len(gates)} entries but the model has {ad.n_layers} layers; "
                             "pass one per layer or a {layer: gate} dict")
        items = list(enumerate(gates))
    hooks: HookList = []
    for layer, g in items:
        if not isinstance(g, Tensor) or g.dim() == 0 and not g.requires_grad:
            g = validation.as_float(g, f"gate of layer {layer}")

        def scale(act: Tensor, hook: Any, g: Any = g) -> Tensor:
            return act * (g.to(act.dtype) if isinstance(g, Tensor) else g)

        hooks.append((ad.hook_name(layer, "mlp_out"), orphan_safe(scale)))
    return _tagged(hooks, f"ffn_gate(layers={[layer for layer, _ in items]})")


def checked_corrections(ad: Any, layers: Sequence[int], gates: Mapping[int, float] | None,
                        biases: Mapping[int, Tensor] | None, caller: str, linears: Mapping[int, Tensor] | None = None
                        ) -> tuple[dict[int, float], dict[int, Tensor], dict[int, Tensor]]:
    """``(gates, biases, linears)`` of a corrected parallel plan, checked (float gates, float64 ``[d_model]`` biases
    and ``[d_model, d_model]`` linear maps, keys among ``layers``, no part missing: ``check_complete``); shared by
    :func:`parallel_blocks` and :func:`tl_steering.parallelize`."""
    from ._util.plan_parts import check_complete

    check_complete(caller, gates, biases, linears,
                   "plan.hooks(model)" if caller == "parallel_blocks" else "parallelize(model, plan)")
    g_of = {ad.check_layer(k, "gates key (layer)"): validation.as_float(v, f"gate of layer {k}")
            for k, v in (gates or {}).items()}
    b_of: dict[int, Tensor] = {}
    for k, v in (biases or {}).items():
        if not isinstance(v, Tensor) or v.dim() != 1 or v.shape[0] != ad.d_model:
            raise InputError(f"bias of layer {k} must be a [d_model={ad.d_model}] tensor, got "
                             f"{getattr(v, 'shape', type(v).__name__)}")
        b_of[ad.check_layer(k, "biases key (layer)")] = v.detach().to(torch.float64)
    w_of: dict[int, Tensor] = {}
    d = ad.d_model
    for k, v in (linears or {}).items():
        if not isinstance(v, Tensor) or tuple(v.shape) != (d, d):
            raise InputError(f"linear map of layer {k} must be a [d_model, d_model] = [{d}, {d}] tensor, got "
                             f"{getattr(v, 'shape', type(v).__name__)}")
        w_of[ad.check_layer(k, "linears key (layer)")] = v.detach().to(torch.float64)
    stray = sorted((set(g_of) | set(b_of) | set(w_of)) - set(layers))
    if stray:
        raise InputError(f"{caller}: corrections given for layers {stray} that are not made parallel here "
                         f"(not in layers={list(layers)})")
    return g_of, b_of, w_of


def parallel_blocks(model: Any, layers: Sequence[int] | int, gates: Mapping[int, float] | None = None,
                    biases: Mapping[int, Tensor] | None = None,
                    linears: Mapping[int, Tensor] | None = None) -> HookList:
    """Make the chosen sequential blocks compute the parallel surrogate x + A(x) + Phi(x) exactly (docs/hooks.md),
    with the corrected write ``g_l Phi(x) + b_l + a W_l`` where ``gates`` / ``biases`` / ``linears`` (``{layer: g}``,
    ``{layer: b}``, ``{layer: W}``) are given (docs/parallel.md, "Refit")."""
    ad = adapt(model)
    chosen = validation.as_layers(layers, ad.n_layers, "layers", allow_none=False, allow_empty=True)
    parts = [name for name, v in (("gates", gates), ("biases", biases), ("linears", linears)) if v]
    desc = f"parallel_blocks(layers={list(chosen)}" + (f", corrected by {'+'.join(parts)})" if parts else ")")
    return parallel_hooks(model, chosen, corrected_write(ad, chosen, gates, biases, "parallel_blocks", linears),
                          desc=desc)


def corrected_write(ad: Any, chosen: Sequence[int], gates: Mapping[int, float] | None,
                    biases: Mapping[int, Tensor] | None, where: str,
                    linears: Mapping[int, Tensor] | None = None) -> "Write":
    """The :data:`Write` of :func:`parallel_blocks` (also for ``ModelAdapter.run_blocks``): ``g_l Phi(x) + b_l
    (+ a W_l)`` in float64, ``Phi(x)`` for a layer with no correction; ``where`` names the caller in errors."""
    g_of, b_of, w_of = checked_corrections(ad, chosen, gates, biases, where, linears)

    def write(layer: int, act: Tensor, par: Tensor, attn: Tensor) -> Tensor:
        if layer not in g_of and layer not in b_of and layer not in w_of:
            return par.to(act.dtype)
        return corrected_ffn_write(par, g_of.get(layer, 1.0), b_of.get(layer), w_of.get(layer), attn, act.dtype)

    write.reads_sequential = False  # act gives only its dtype: run_blocks may pass Phi(x) instead
    return write


#: ``write(layer, sequential_write, parallel_write, attn_write)``: the FFN write of a chosen block
Write = Callable[[int, Tensor, Tensor, Tensor], Tensor]


def parallel_hooks(model: Any, layers: Sequence[int], write: "Write", desc: str | None = None) -> HookList:
    """The hooks of :func:`parallel_blocks` with the FFN write of each chosen sequential layer given by ``write``
    (docs/hooks.md); most callers want :func:`parallel_blocks`."""
    ad = adapt(model)
    hooks: HookList = []
    chosen = validation.as_layers(layers, ad.n_layers, "layers", allow_none=False, allow_empty=True)
    for layer in chosen:  # an empty plan (k = 0) is the sequential model: no hooks
        if ad.is_parallel(layer):
            continue
        phi = ad.ffn(layer)
        # x as resid_pre's hook sees it, and a capture of the x the block really uses (ln1's input, after every
        # hook on resid_pre, also a user's listed after ours)
        stash, take = _armed_capture(ad, layer, "resid_pre")
        state: dict[str, Tensor] = {}

        def swap(act: Tensor, hook: Any, state: dict = state, take: Callable = take, phi: Callable = phi,
                 layer: int = layer) -> Tensor:
            if (x := take(act)) is None:
                raise HookNotFoundError(
                    f"parallel_blocks: resid_pre of layer {layer} did not fire before hook_mlp_out (a run "
                    "interrupted earlier may have left this hook attached: call model.reset_hooks())")
            if (attn := state.pop("attn", None)) is None:
                raise HookNotFoundError(
                    f"parallel_blocks: hook_attn_out of layer {layer} did not fire before hook_mlp_out")
            return write(layer, act, phi(x), attn)

        def keep_attn(act: Tensor, hook: Any, state: dict = state) -> None:
            state["attn"] = act

        hooks += [(ad.hook_name(layer, "resid_pre"), stash),
                  (ad.hook_name(layer, "attn_out"), orphan_safe(keep_attn)),
                  (ad.hook_name(layer, "mlp_out"), orphan_safe(swap))]
    return _tagged(hooks, desc or f"parallel_hooks(layers={list(chosen)})")


def attention_gain(model: Any, gain: float, layers: Sequence[int] | int | None = None) -> HookList:
    """Scale attention writes a -> gain * a at the chosen layers (aggregation pressure, docs/protocols.md)."""
    ad = adapt(model)
    gain = validation.as_float(gain, "gain")

    def scale(act: Tensor, hook: Any) -> Tensor:
        return act * gain

    chosen = ad.layers(layers)
    return _tagged([(ad.hook_name(layer, "attn_out"), orphan_safe(scale)) for layer in chosen],
                   f"attention_gain(gain={gain:g}, layers={_layers_text(ad, chosen)})")


__all__ = ["HookList", "KEEPS", "attention_gain", "ffn_component", "ffn_gate", "parallel_blocks", "parallel_hooks"]
