"""Hook factories: plain TransformerLens ``fwd_hooks`` lists.

Each factory returns ``list[tuple[str, hook_fn]]``, so it composes with everything TransformerLens offers::

    model.run_with_hooks(tokens, fwd_hooks=ffn_component(model, keep="tangential"))
    with model.hooks(fwd_hooks=parallel_blocks(model, [3, 4]) + ffn_gate(model, {3: 0.9})):
        logits, cache = model.run_with_cache(tokens)

Lists are applied in order on a shared hook point (e.g. ``parallel_blocks(...) + ffn_gate(...)`` gates the
parallel FFN write). The factories add nothing to the model themselves: TransformerLens's ``hooks`` context or
``run_with_hooks`` adds and removes them.

All geometry is computed in float64 and cast back to the activation dtype when written into the forward pass.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from . import geometry as geo
from .backends import ModelAdapter, adapt
from .errors import InputError

HookList = list[tuple[str, Callable[..., Any]]]
Keep = Literal["tangential", "radial", "zero", "random_tangent", "full"]
KEEPS: tuple[str, ...] = ("tangential", "radial", "zero", "random_tangent", "full")


def _skip_mask(act: Tensor, skip_positions: Sequence[int]) -> Tensor | None:
    if not skip_positions:
        return None
    mask = torch.zeros(act.shape[-2], dtype=torch.bool, device=act.device)
    for p in skip_positions:
        if -act.shape[-2] <= p < act.shape[-2]:
            mask[p] = True
    return mask[:, None]


def _layer_seed(seed: int, layer: int) -> int:
    return (int(seed) * 1_000_003 + int(layer)) % (2**63 - 1)


def ffn_component(
    model: Any,
    keep: Keep = "tangential",
    layers: Sequence[int] | int | None = None,
    reference: Literal["ffn_input", "resid_pre"] = "ffn_input",
    skip_positions: Sequence[int] = (),
    seed: int = 0,
) -> HookList:
    """Replace each chosen layer's FFN write phi = hook_mlp_out by one of its parts.

    With u = normalize(FFN input) read from the SAME (patched) forward:

    * ``"tangential"``: phi_T = phi - <u, phi> u  (P_u phi; MATH_SPEC §5)
    * ``"radial"``: phi_R = <u, phi> u
    * ``"zero"``: 0 (remove the FFN)
    * ``"random_tangent"``: a random tangent vector at u with the norm of phi_T (chance control)
    * ``"full"``: phi unchanged (a control that exercises the same hooks)

    Args:
        model: a TransformerLens model.
        keep: which part to keep.
        layers: layers to ablate (default: all at once, the paper's scope).
        reference: ``"ffn_input"`` (resid_mid for sequential blocks, resid_pre for parallel blocks; the
            default, see MATH_SPEC §5) or ``"resid_pre"``.
        skip_positions: positions left intact (e.g. ``(0,)`` keeps the attention sink's FFN write).
        seed: seed of the random-tangent control. The noise of layer l is drawn from a generator seeded with
            (seed, l) at every forward: the same hooks and inputs give the same forward every time.
    """
    ad = adapt(model)
    if keep not in KEEPS:
        raise InputError(f"keep must be one of {KEEPS}, got {keep!r}")
    if reference not in ("ffn_input", "resid_pre"):
        raise InputError(f"reference must be 'ffn_input' or 'resid_pre', got {reference!r}")
    hooks: HookList = []
    for layer in ad.layers(layers):
        ref_name = ad.hook_name(layer, reference)
        out_name = ad.hook_name(layer, "mlp_out")
        state: dict[str, Tensor] = {}

        def stash(act: Tensor, hook: Any, state: dict = state) -> None:
            state["u"] = geo.normalize(act)

        def patch(act: Tensor, hook: Any, state: dict = state, layer: int = layer) -> Tensor:
            u = state.pop("u", None)
            if u is None:
                raise RuntimeError(f"ffn_component: the FFN-input hook of layer {layer} did not fire before "
                                   "hook_mlp_out; this model's hook order is not supported")
            phi = act.to(torch.float64)
            if keep == "full":
                new = phi
            elif keep == "zero":
                new = torch.zeros_like(phi)
            elif keep == "radial":
                new = geo.radial_part(phi, u)
            else:
                tan = geo.tangential_part(phi, u)
                if keep == "tangential":
                    new = tan
                else:
                    # a fresh generator per call, seeded by (seed, layer): the same hooks give the same noise in
                    # every forward (and different, independent noise per layer)
                    gen = torch.Generator(device=act.device).manual_seed(_layer_seed(seed, layer))
                    noise = torch.randn(phi.shape, generator=gen, device=act.device, dtype=torch.float64)
                    noise = geo.tangential_part(noise, u)
                    new = geo.normalize(noise) * tan.norm(dim=-1, keepdim=True)
            mask = _skip_mask(act, skip_positions)
            if mask is not None:
                new = torch.where(mask, phi, new)
            return new.to(act.dtype)

        hooks += [(ref_name, stash), (out_name, patch)]
    return hooks


def ffn_gate(model: Any, gates: Mapping[int, float] | Sequence[float] | Tensor) -> HookList:
    """Scale each layer's FFN write: x^{l+1} = y + g_l Phi_l(y) (MATH_SPEC §8).

    Args:
        gates: ``{layer: g}``, or one gate per layer (sequence or tensor of length n_layers). A tensor that
            requires grad keeps its graph, so gates can be fitted by gradient descent.
    """
    ad = adapt(model)
    if isinstance(gates, Mapping):
        items = [(ad.check_layer(int(k)), v) for k, v in gates.items()]
    else:
        if len(gates) != ad.n_layers:
            raise InputError(f"gates has {len(gates)} entries but the model has {ad.n_layers} layers; "
                             "pass one per layer or a {layer: gate} dict")
        items = list(enumerate(gates))
    hooks: HookList = []
    for layer, g in items:
        if not isinstance(g, Tensor):
            g = float(g)
            if g != g or g in (float("inf"), float("-inf")):
                raise InputError(f"gate of layer {layer} is not finite: {g}")

        def scale(act: Tensor, hook: Any, g: Any = g) -> Tensor:
            return act * (g.to(act.dtype) if isinstance(g, Tensor) else g)

        hooks.append((ad.hook_name(layer, "mlp_out"), scale))
    return hooks


def parallel_blocks(model: Any, layers: Sequence[int] | int) -> HookList:
    """Make the chosen sequential blocks compute the parallel surrogate x + A(x) + Phi(x) exactly.

    Implementation: stash x = resid_pre of the layer (from the same, possibly already perturbed, forward) and
    replace hook_mlp_out by Phi(x) = MLP(LN2(x)), computed by the adapter's pure FFN callable (no hooks fire
    inside it). This needs no change of model state (``hook_mlp_in`` stays off) and behaves the same on
    HookedTransformer and TransformerBridge. Hooks inside that layer's MLP (``mlp.hook_pre`` etc.) still see
    the sequential computation; hook_mlp_out, resid_post and everything downstream see the parallel one.
    Blocks that are parallel already (NeoX/Pythia) are left as they are; an empty ``layers`` (a plan with k = 0)
    gives no hooks.
    """
    ad = adapt(model)
    hooks: HookList = []
    if not isinstance(layers, int) and len(layers) == 0:
        return hooks  # an empty plan (k = 0) is the sequential model: no hooks
    for layer in ad.layers(layers):
        if ad.is_parallel(layer):
            continue
        phi = ad.ffn(layer)
        state: dict[str, Tensor] = {}

        def stash(act: Tensor, hook: Any, state: dict = state) -> None:
            state["x"] = act

        def swap(act: Tensor, hook: Any, state: dict = state, phi: Callable = phi, layer: int = layer) -> Tensor:
            x = state.pop("x", None)
            if x is None:
                raise RuntimeError(f"parallel_blocks: resid_pre of layer {layer} did not fire before hook_mlp_out")
            return phi(x).to(act.dtype)

        hooks += [(ad.hook_name(layer, "resid_pre"), stash), (ad.hook_name(layer, "mlp_out"), swap)]
    return hooks


def attention_gain(model: Any, gain: float, layers: Sequence[int] | int | None = None) -> HookList:
    """Scale attention writes a -> gain * a at the chosen layers (aggregation pressure, MATH_SPEC §6)."""
    ad = adapt(model)
    gain = float(gain)
    if gain != gain or abs(gain) == float("inf"):
        raise InputError(f"gain must be finite, got {gain}")

    def scale(act: Tensor, hook: Any) -> Tensor:
        return act * gain

    return [(ad.hook_name(layer, "attn_out"), scale) for layer in ad.layers(layers)]


__all__ = ["HookList", "KEEPS", "attention_gain", "ffn_component", "ffn_gate", "parallel_blocks", "ModelAdapter"]
