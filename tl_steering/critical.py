"""Critical points of a layer's steering field on the sphere (MATH_SPEC §9) for TransformerLens models.

For layer l the fields are functions of a unit direction u ∈ S^{d-1}:

* ``field="ffn"``: F(u) = Phi_l(ρ u) = MLP(LN2(ρ u)), ρ = median ||FFN input|| over the calibration tokens
  (position 0 excluded) or a float. Evaluating at ρ u rather than at u matters: at unit norm the LN/RMS ``eps`` is
  comparable to the variance 1/d.
* ``field="attention"``: the field of one token i (``token_index``, default the last position) of one sequence
  with its prefix frozen, F_i(u) = A_i(u; X_<i frozen): the attention sublayer run on the clean residual matrix
  ``resid_pre[seq, :i+1]`` whose row i is replaced by ρ u (query, key and value of token i are all built from ρ u;
  batch 1, positions 0..i; exact and causal), row i of the output. ρ = median ||resid_pre|| (the attention input).
* ``field="block"``: F_i(u) = A_i(u; X_<i frozen) + Phi_l(ρ u), the ODE field of MATH_SPEC §3 at token i (same ρ).

Everything runs in float64 on a private float64 copy of the block (``copy.deepcopy`` of ``model.blocks[l]``, cast):
the user's model is never changed and no hook of the user fires. Two places where a model computes in float32
whatever the input dtype are made float64 on the copy only: Hugging Face ``*RMSNorm`` modules (replaced, on the
copy, by an exact float64 RMSNorm checked against the original) and ``softmax(..., dtype=float32)`` inside attention
(promoted to float64 while the copy runs). Without that the residual tolerance 1e-8 of the finder is out of reach.

The equilibria are then found and classified by :func:`tl_steering.equilibria.find_equilibria` (half of the starts
are actual token directions, half random), and returned as its :class:`EquilibriaResult` with the provenance of
the model and tokens, and ``options`` recording layer, field and radius.
"""

import contextlib
import copy
import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .backends import ModelAdapter, adapt, check_finite, first_output, hook_points, hooks_silenced
from .equilibria import LABELS, EquilibriaResult, find_equilibria
from .errors import InputError
from .results import Result, register

FieldKind = Literal["ffn", "attention", "block"]
FIELDS: tuple[str, ...] = ("ffn", "attention", "block")


# ----------------------------------------------------------------------------------------------------------
# a float64 copy of one block


class _ExactRMSNorm(torch.nn.Module):
    """(offset + w) * x / sqrt(mean(x^2) + eps) in the input dtype (HF RMSNorms upcast to float32 only)."""

    def __init__(self, weight: Tensor, eps: float, offset: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.eps = float(eps)
        self.offset = float(offset)

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return (self.offset + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _exact_rms_norms(module: torch.nn.Module) -> list[str]:
    """Replace every Hugging Face ``*RMSNorm`` inside ``module`` (a private copy) by :class:`_ExactRMSNorm`,
    after checking on random float64 input that the replacement reproduces it (to float32 rounding). Returns the
    names replaced; a norm that does not match either form (w or 1 + w) is left as it is."""
    swapped = []
    for name, mod in list(module.named_modules()):
        if not name or not type(mod).__name__.endswith("RMSNorm") or isinstance(mod, _ExactRMSNorm):
            continue
        weight = getattr(mod, "weight", None)
        eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
        if not isinstance(weight, Tensor) or weight.dim() != 1 or not isinstance(eps, (int, float)):
            continue
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(4, weight.shape[0], generator=gen, dtype=torch.float64).to(weight.device) * 3.0
        with torch.no_grad():
            ref = first_output(mod(probe)).to(torch.float64)
        for offset in (0.0, 1.0):
            new = _ExactRMSNorm(weight.to(torch.float64), float(eps), offset).to(weight.device)
            with torch.no_grad():
                err = float((new(probe) - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)
            if err < 1e-5:
                parent = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
                setattr(parent, name.rsplit(".", 1)[-1], new)
                swapped.append(name)
                break
    return swapped


@contextlib.contextmanager
def _softmax_in_input_precision() -> Iterator[None]:
    """While active, ``torch.nn.functional.softmax(x, dtype=float32)`` on a float64 ``x`` stays float64.

    Attention implementations (TransformerBridge, HF eager attention) request a float32 softmax for stability;
    on our float64 copy that would cap the field's precision at float32. Only float64 inputs are affected.
    """
    functional = torch.nn.functional
    original = functional.softmax

    def softmax(input: Tensor, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> Tensor:
        if dtype is not None and input.dtype == torch.float64 and dtype != torch.float64:
            dtype = torch.float64
        return original(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    functional.softmax = softmax
    try:
        yield
    finally:
        functional.softmax = original


class Block64:
    """A private float64 copy of block ``layer`` with pure ``ffn`` / ``attention`` callables (no hooks fire).

    Mirrors :meth:`ModelAdapter.ffn` and :meth:`ModelAdapter.attention` on the copy. The user's model is not
    changed: the copy is made with the block's hooks detached (the copy never carries hooks), its weights are new
    tensors. Bridges get the rotary (cos, sin) from the model's ``rotary_emb`` (hooks silenced), once per length.
    """

    def __init__(self, ad: ModelAdapter, layer: int) -> None:
        self.ad = ad
        self.layer = ad.check_layer(layer)
        blk = ad.model.blocks[self.layer]
        with hooks_silenced(blk):
            cb = copy.deepcopy(blk)
        cb.to(torch.float64)
        cb.requires_grad_(False)
        cfg = getattr(cb, "cfg", None)
        if cfg is not None and cfg is not ad.model.cfg and hasattr(cfg, "dtype"):
            cfg.dtype = torch.float64  # HookedTransformer's norms cast their output to cfg.dtype
        for hp in hook_points(cb):  # the copy is private: it never carries a hook (cheaper than silencing)
            hp._forward_hooks.clear()
            hp._forward_pre_hooks.clear()
            hp._backward_hooks.clear()
        self.rms_swapped = _exact_rms_norms(cb)
        self.blk = cb
        self.ln2 = ad.ffn_norm(cb)
        self.rotary = getattr(ad.model, "rotary_emb", None) if ad.backend == "bridge" else None
        self._rotary_cache: dict[int, Any] = {}

    def _position_embeddings(self, n_pos: int, batch: int) -> Any:
        """Rotary (cos, sin) for positions 0..n_pos-1 in float64, computed once per length (constants)."""
        if n_pos not in self._rotary_cache:
            dev = self.ad.device
            x = torch.zeros(1, n_pos, self.ad.d_model, dtype=torch.float64, device=dev)
            pos = torch.arange(n_pos, device=dev).unsqueeze(0)
            with hooks_silenced(self.rotary), torch.no_grad():
                self._rotary_cache[n_pos] = tuple(t.to(torch.float64) for t in self.rotary(x, pos))
        return tuple(t.expand(batch, *t.shape[1:]) for t in self._rotary_cache[n_pos])

    def ffn(self, x: Tensor) -> Tensor:
        """Phi(x) = MLP(LN2(x)), positionwise, for ``[..., d]`` float64 input."""
        shape = x.shape
        x3 = x if x.dim() == 3 else x.reshape(1, -1, shape[-1])
        out = first_output(self.blk.mlp(first_output(self.ln2(x3))))
        return out.reshape(shape)

    def attention(self, x: Tensor) -> Tensor:
        """A(X) = attn(LN1(X)) for ``[batch, pos, d]`` float64 input (causal; rotary for positions 0..pos-1)."""
        if x.dim() != 3:
            raise InputError(f"attention expects [batch, pos, d_model], got shape {tuple(x.shape)}")
        with _softmax_in_input_precision():
            h = first_output(self.blk.ln1(x))
            if self.ad.backend == "hooked":
                return first_output(self.blk.attn(h, h, h))
            kwargs: dict[str, Any] = {}
            if self.rotary is not None:
                kwargs["position_embeddings"] = self._position_embeddings(x.shape[1], x.shape[0])
            return first_output(self.blk.attn(hidden_states=h, **kwargs))


# ----------------------------------------------------------------------------------------------------------
# the field


class CriticalField:
    """The field F: [n, d] -> [n, d] of one layer, in float64 (see the module docstring).

    Attributes:
        kind: "ffn", "attention" or "block".
        layer: the block.
        radius: ρ.
        dim: d_model.
        prefix: for attention/block, the frozen clean rows ``resid_pre[sequence, :token_index]`` (float64).
        token_index, sequence: the token whose field this is (attention/block).
    """

    def __init__(self, block: Block64, kind: str, radius: float, prefix: Tensor | None = None,
                 token_index: int | None = None, sequence: int | None = None) -> None:
        self.block = block
        self.kind = kind
        self.layer = block.layer
        self.radius = float(radius)
        self.dim = block.ad.d_model
        self.prefix = prefix
        self.token_index = token_index
        self.sequence = sequence

    def with_radius(self, radius: float) -> "CriticalField":
        return CriticalField(self.block, self.kind, radius, self.prefix, self.token_index, self.sequence)

    def attention_rows(self, u: Float[Tensor, "n d"]) -> Float[Tensor, "n d"]:
        """A_i with row i of the frozen matrix replaced by ρ u, for each row of u."""
        x = self.radius * u
        n = x.shape[0]
        assert self.prefix is not None
        mat = torch.cat([self.prefix[None].expand(n, -1, -1), x[:, None, :]], dim=1)
        return self.block.attention(mat)[:, -1]

    def __call__(self, u: Float[Tensor, "*n d"]) -> Float[Tensor, "*n d"]:
        single = u.dim() == 1
        u2 = u[None] if single else u
        out = 0.0
        if self.kind in ("ffn", "block"):
            out = self.block.ffn(self.radius * u2)
        if self.kind in ("attention", "block"):
            out = out + self.attention_rows(u2)
        return out[0] if single else out


def _check_field(field: Any) -> str:
    if field not in FIELDS:
        raise InputError(f"field must be one of {FIELDS}, got {field!r}")
    return field


def _default_tokens(model: Any) -> Tensor:
    from .data import text_tokens

    return text_tokens(model, n_windows=4, length=64)


def _site_for(ad: ModelAdapter, layer: int, kind: str) -> str:
    return "ffn_input" if kind == "ffn" else "resid_pre"


def _median_norm(acts: Tensor) -> float:
    """Median ||x|| over every position but 0 (all positions if there is only one)."""
    x = acts[:, 1:] if acts.shape[1] > 1 else acts
    return float(x.to(torch.float64).norm(dim=-1).median())


def _resolve_radius(radius: Any, acts: Tensor) -> tuple[float, str]:
    if isinstance(radius, str):
        if radius != "median":
            raise InputError(f"radius must be 'median' or a positive float, got {radius!r}")
        return _median_norm(acts), "median"
    if isinstance(radius, bool) or not isinstance(radius, (int, float)) or not math.isfinite(radius) or radius <= 0:
        raise InputError(f"radius must be 'median' or a positive finite float, got {radius!r}")
    return float(radius), "fixed"


def _token_starts(acts: Tensor, n: int, seed: int) -> Tensor:
    """``n`` token directions (rows of ``acts`` other than position 0), chosen by a seeded permutation."""
    x = acts[:, 1:] if acts.shape[1] > 1 else acts
    x = x.reshape(-1, x.shape[-1]).to(torch.float64)
    x = x[x.norm(dim=-1) > 0]
    if n <= 0 or x.shape[0] == 0:
        return x[:0]
    gen = torch.Generator().manual_seed(int(seed) + 1)
    idx = torch.randperm(x.shape[0], generator=gen)[: min(n, x.shape[0])]
    return x[idx.to(x.device)]


def _activations(ad: ModelAdapter, tokens: Tensor, layers: Sequence[int], kind: str) -> dict[int, Tensor]:
    names = {layer: ad.hook_name(layer, _site_for(ad, layer, kind)) for layer in layers}
    _, cache = ad.run_with_cache(tokens, sorted(set(names.values())))
    out = {}
    for layer, name in names.items():
        check_finite(cache[name], layer, _site_for(ad, layer, kind))
        out[layer] = cache[name].detach().to(torch.float64)
    return out


def _build_field(ad: ModelAdapter, layer: int, kind: str, radius: Any, acts: Tensor,
                 token_index: int | None, sequence: int) -> tuple[CriticalField, str]:
    rho, mode = _resolve_radius(radius, acts)
    block = Block64(ad, layer)
    if kind == "ffn":
        return CriticalField(block, kind, rho), mode
    n_seq, n_pos = acts.shape[0], acts.shape[1]
    if isinstance(sequence, bool) or not isinstance(sequence, int) or not -n_seq <= sequence < n_seq:
        raise InputError(f"sequence must be an int in [0, {n_seq}), got {sequence!r}")
    sequence %= n_seq
    i = n_pos - 1 if token_index is None else token_index
    if isinstance(i, bool) or not isinstance(i, int) or not -n_pos <= i < n_pos:
        raise InputError(f"token_index must be an int in [0, {n_pos}) for sequences of length {n_pos}, "
                         f"got {token_index!r}")
    i %= n_pos
    prefix = acts[sequence, :i].clone()
    return CriticalField(block, kind, rho, prefix=prefix, token_index=i, sequence=sequence), mode


def critical_field(model: Any, layer: int, field: FieldKind = "ffn", radius: str | float = "median",
                   tokens: Tensor | None = None, token_index: int | None = None, sequence: int = 0
                   ) -> CriticalField:
    """The float64 field of :func:`critical_points` as a callable ``[n, d] -> [n, d]`` (or ``[d] -> [d]``).

    Args: as :func:`critical_points`. Tokens default to ``text_tokens(model, n_windows=4, length=64)``.
    """
    ad = adapt(model)
    layer = ad.check_layer(layer)
    kind = _check_field(field)
    tokens = ad.validate_tokens(_default_tokens(model) if tokens is None else tokens)
    acts = _activations(ad, tokens, [layer], kind)[layer]
    return _build_field(ad, layer, kind, radius, acts, token_index, sequence)[0]


def _check_scales(radius_scales: Any) -> tuple[float, ...]:
    if radius_scales is None:
        return ()
    try:
        scales = tuple(float(s) for s in radius_scales)
    except (TypeError, ValueError) as e:
        raise InputError(f"radius_scales must be a sequence of positive floats such as (0.5, 1, 2), got "
                         f"{radius_scales!r}") from e
    if not scales or any(not math.isfinite(s) or s <= 0 for s in scales):
        raise InputError(f"radius_scales must be non-empty positive finite floats, got {radius_scales!r}")
    return scales


def _run(ad: ModelAdapter, tokens: Tensor, layer: int, kind: str, radius: Any, acts: Tensor, n_starts: int,
         token_index: int | None, sequence: int, seed: int, eigensolver: str, scales: tuple[float, ...],
         finder_kwargs: dict[str, Any]) -> EquilibriaResult:
    t0 = time.perf_counter()
    fld, mode = _build_field(ad, layer, kind, radius, acts, token_index, sequence)
    if isinstance(n_starts, bool) or not isinstance(n_starts, int) or n_starts < 1:
        raise InputError(f"n_starts must be an int >= 1, got {n_starts!r}")
    if "starts" in finder_kwargs or "dim" in finder_kwargs:
        raise InputError("critical_points chooses the starts (half token directions, half random) and dim itself;"
                         " call tl_steering.equilibria.find_equilibria with critical_field(...) for your own")
    starts = _token_starts(acts, n_starts // 2, seed)
    res = find_equilibria(fld, fld.dim, n_starts=n_starts, starts=starts, seed=seed, eigensolver=eigensolver,
                          **finder_kwargs)
    sensitivity: dict[str, Any] = {}
    for s in scales:
        if res.n_points == 0:
            sensitivity[f"{s:g}"] = {"scale": s, "radius": s * fld.radius, "n_points": 0,
                                     "counts": {k: 0 for k in (*LABELS, "rotational")}}
            continue
        again = find_equilibria(fld.with_radius(s * fld.radius), fld.dim, n_starts=res.n_points,
                                starts=res.points.to(acts.device), seed=seed, eigensolver=eigensolver,
                                **finder_kwargs)
        sensitivity[f"{s:g}"] = {"scale": s, "radius": s * fld.radius, "n_points": again.n_points,
                                 "n_converged": again.n_converged, "counts": again.counts()}
    options = {
        "protocol": "critical_points", "layer": layer, "field": kind, "radius": fld.radius, "radius_mode": mode,
        "radius_site": ad.hook_name(layer, _site_for(ad, layer, kind)), "token_index": fld.token_index,
        "sequence": fld.sequence, "n_token_starts": int(starts.shape[0]), "rms_norms_made_exact": fld.block.rms_swapped,
        "radius_scales": list(scales), "radius_sensitivity": sensitivity,
    }
    res.options = {**res.options, **options}
    res.provenance = ad.provenance(tokens, seed=seed, **{k: v for k, v in res.options.items() if k != "seed"})
    res.seconds = time.perf_counter() - t0
    return res


def critical_points(
    model: Any,
    layer: int,
    field: FieldKind = "ffn",
    radius: str | float = "median",
    n_starts: int = 64,
    tokens: Int[Tensor, "batch pos"] | None = None,
    token_index: int | None = None,
    seed: int = 0,
    eigensolver: str = "auto",
    radius_scales: Sequence[float] | None = None,
    sequence: int = 0,
    **finder_kwargs: Any,
) -> EquilibriaResult:
    """Equilibria u* of layer ``layer``'s field on S^{d-1} and their tangent spectra (MATH_SPEC §9).

    Args:
        model: a TransformerLens model (HookedTransformer or TransformerBridge); never changed.
        layer: the block.
        field: ``"ffn"`` (F(u) = Phi(ρu)), ``"attention"`` (token i's attention field, prefix frozen) or
            ``"block"`` (their sum).
        radius: ``"median"`` (median norm of the field's input site, position 0 excluded: FFN input for "ffn",
            resid_pre for "attention"/"block") or a positive float ρ.
        n_starts: starts; ``n_starts // 2`` are token directions of that site (seeded choice), the rest random.
        tokens: calibration tokens (default ``text_tokens(model, n_windows=4, length=64)``).
        token_index: token i of the attention/block field (default: the last position).
        seed: seed of the token-start choice and of the random starts.
        eigensolver: "auto" | "dense" | "arpack" (see :func:`find_equilibria`).
        radius_scales: e.g. ``(0.5, 1, 2)``: re-run the finder from the found points at ρ·scale and record the
            label counts per scale in ``options["radius_sensitivity"]`` (sensitivity to ρ).
        sequence: which sequence supplies the frozen prefix (attention/block).
        **finder_kwargs: passed to :func:`find_equilibria` (tol, max_iter, newton_steps, n_eigs, ...).

    Returns:
        The :class:`EquilibriaResult`, ``options`` holding layer, field, radius and the sensitivity counts.
    """
    ad = adapt(model)
    layer = ad.check_layer(layer)
    kind = _check_field(field)
    scales = _check_scales(radius_scales)
    tokens = ad.validate_tokens(_default_tokens(model) if tokens is None else tokens)
    acts = _activations(ad, tokens, [layer], kind)[layer]
    return _run(ad, tokens, layer, kind, radius, acts, n_starts, token_index, sequence, seed, eigensolver,
                scales, finder_kwargs)


# ----------------------------------------------------------------------------------------------------------
# all layers


def _zeros(*shape: int, dtype: torch.dtype = torch.float64):
    return lambda: torch.zeros(*shape, dtype=dtype)


@register
@dataclasses.dataclass(kw_only=True)
class CriticalSummary(Result):
    """Critical points of one field for several layers (see :func:`critical_points_all_layers`).

    Attributes:
        layers: the layers, in order.
        field: "ffn" | "attention" | "block".
        labels: column names of ``counts``: attractor, repeller, saddle, degenerate.
        counts: ``[layer, label]`` number of distinct equilibria per label.
        rotational: ``[layer]`` points with at least one rotational mode.
        n_points: ``[layer]`` distinct equilibria; n_converged: ``[layer]`` converged starts.
        radius: ``[layer]`` ρ used.
        seconds: ``[layer]`` wall time per layer.
        results: the per-layer :class:`EquilibriaResult`.
    """

    layers: list[int] = dataclasses.field(default_factory=list)
    field: str = "ffn"
    labels: list[str] = dataclasses.field(default_factory=lambda: list(LABELS))
    counts: Int[Tensor, "layer label"] = dataclasses.field(default_factory=_zeros(0, 4, dtype=torch.int64))
    rotational: Int[Tensor, " layer"] = dataclasses.field(default_factory=_zeros(0, dtype=torch.int64))
    n_points: Int[Tensor, " layer"] = dataclasses.field(default_factory=_zeros(0, dtype=torch.int64))
    n_converged: Int[Tensor, " layer"] = dataclasses.field(default_factory=_zeros(0, dtype=torch.int64))
    radius: Float[Tensor, " layer"] = dataclasses.field(default_factory=_zeros(0))
    seconds: Float[Tensor, " layer"] = dataclasses.field(default_factory=_zeros(0))
    results: list[EquilibriaResult] = dataclasses.field(default_factory=list)

    kind = "critical_summary"

    def totals(self) -> dict[str, int]:
        out = {lab: int(self.counts[:, k].sum()) for k, lab in enumerate(self.labels)}
        out["rotational"] = int(self.rotational.sum())
        return out

    def saddle_fraction(self) -> float:
        """Saddles / all distinct equilibria, pooled over layers (NaN when none was found)."""
        total = int(self.counts.sum())
        return self.totals()["saddle"] / total if total else math.nan

    def summary(self) -> dict[str, Any]:
        frac = self.saddle_fraction()
        return {"field": self.field, "n_layers": len(self.layers), "n_points": int(self.n_points.sum()),
                **self.totals(), "saddle_fraction": frac,
                "mostly_saddles": bool(frac > 0.5) if frac == frac else False,
                "seconds_total": float(self.seconds.sum()),
                "seconds_per_layer": float(self.seconds.mean()) if len(self.layers) else math.nan}

    def plot(self, title: str | None = None):
        """Stacked bars of the label counts per layer (plotly Figure)."""
        import plotly.graph_objects as go

        colors = {"attractor": "#2ca02c", "repeller": "#d62728", "saddle": "#1f77b4", "degenerate": "#7f7f7f"}
        fig = go.Figure()
        for k, lab in enumerate(self.labels):
            fig.add_trace(go.Bar(x=list(self.layers), y=self.counts[:, k].tolist(), name=lab,
                                 marker_color=colors.get(lab)))
        fig.update_layout(barmode="stack", template="plotly_white", xaxis_title="layer",
                          yaxis_title="distinct equilibria",
                          title=title or f"Critical points of the {self.field} field per layer "
                                         f"(saddle fraction {self.saddle_fraction():.2f})")
        return fig


def critical_points_all_layers(
    model: Any,
    layers: Sequence[int] | int | None = None,
    field: FieldKind = "ffn",
    tokens: Int[Tensor, "batch pos"] | None = None,
    **kwargs: Any,
) -> CriticalSummary:
    """:func:`critical_points` for each layer (one forward for all of them); label counts per layer.

    Args:
        model, field, tokens: as :func:`critical_points`.
        layers: None for all.
        **kwargs: the other arguments of :func:`critical_points` (radius, n_starts, seed, eigensolver,
            radius_scales, token_index, sequence, finder options).
    """
    ad = adapt(model)
    kind = _check_field(field)
    sel = ad.layers(layers)
    tokens = ad.validate_tokens(_default_tokens(model) if tokens is None else tokens)
    acts = _activations(ad, tokens, sel, kind)
    opts = dict(kwargs)
    radius = opts.pop("radius", "median")
    n_starts = opts.pop("n_starts", 64)
    token_index = opts.pop("token_index", None)
    sequence = opts.pop("sequence", 0)
    seed = opts.pop("seed", 0)
    eigensolver = opts.pop("eigensolver", "auto")
    scales = _check_scales(opts.pop("radius_scales", None))
    results = []
    for layer in sel:
        results.append(_run(ad, tokens, layer, kind, radius, acts[layer], n_starts, token_index, sequence, seed,
                            eigensolver, scales, opts))
    counts = torch.tensor([[r.labels.count(lab) for lab in LABELS] for r in results], dtype=torch.int64)
    return CriticalSummary(
        provenance=ad.provenance(tokens, seed=seed, protocol="critical_points_all_layers", layers=sel, field=kind,
                                 radius=radius if isinstance(radius, str) else float(radius), n_starts=n_starts,
                                 eigensolver=eigensolver, radius_scales=list(scales),
                                 finder_kwargs={k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                                for k, v in opts.items()}),
        layers=sel,
        field=kind,
        counts=counts.reshape(len(sel), len(LABELS)),
        rotational=torch.tensor([int(sum(r.rotational)) for r in results], dtype=torch.int64),
        n_points=torch.tensor([r.n_points for r in results], dtype=torch.int64),
        n_converged=torch.tensor([r.n_converged for r in results], dtype=torch.int64),
        radius=torch.tensor([r.options["radius"] for r in results], dtype=torch.float64),
        seconds=torch.tensor([r.seconds for r in results], dtype=torch.float64),
        results=results,
    )


__all__ = ["Block64", "CriticalField", "CriticalSummary", "FIELDS", "critical_field", "critical_points",
           "critical_points_all_layers"]
