"""Critical points of a layer's steering field on the sphere for TransformerLens models: the ``ffn``,
``attention`` and ``block`` fields of docs/critical_points.md section 1, evaluated at ρu on the backend's private
float64 copy of the block (:class:`tl_steering.backends.field64.Float64Block`: the user's model is never changed and
no hook of the user fires); the equilibria are found by :func:`tl_steering.critical.finder.find_equilibria`."""

import math
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..backends import ModelAdapter, adapt, check_finite
from ..backends.field64 import Float64Block
from ..data.sharding import World, split_map
from ..data.windows import token_source
from ..errors import InputError
from ..validation import as_choice, as_int
from .census import CensusResult, census
from .finder import ROW_KEYS, find_equilibria, polish_points
from .options import CENSUS_LANDSCAPE_SOLVES, DEFAULT_FINDER, DEFAULT_N_STARTS, FinderOptions, finder_options
from .results import CriticalPointsResult, EquilibriaResult
from .spectrum import LABELS
from ..backends.ownership import exclusive

FieldKind = Literal["ffn", "attention", "block"]
FIELDS: tuple[str, ...] = ("ffn", "attention", "block")
#: the hook site whose median norm is ρ and whose rows are the token starts
_SITE = {"ffn": "ffn_input", "attention": "resid_pre", "block": "resid_pre"}


class CriticalField:
    """The field F: [n, d] -> [n, d] of one layer, in float64 (see the module docstring).

    Attributes:
        kind: "ffn", "attention" or "block".
        layer: the block.
        radius: ρ.
        dim: d_model.
        prefix: for attention/block, the frozen clean rows ``resid_pre[sequence, :token_index]`` (float64).
        token_index, sequence: the token whose field this is (attention/block)."""

    def __init__(self, block: Float64Block, kind: str, radius: float, prefix: Tensor | None = None,
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

    def evaluate_no_grad(self, u: Float[Tensor, "n d"]) -> Float[Tensor, "n d"]:
        """F at the rows of ``u`` without autograd (the FFN field through the block's recorded float64 FFN: same
        values, less call overhead); used by the first-order phases of the finder."""
        if self.kind != "ffn":
            with torch.no_grad():
                return self(u)
        return self.block.ffn_no_grad(self.radius * u)

    def jacobian_no_grad(self, u: Float[Tensor, "n d"], dtype: torch.dtype = torch.float64) -> Tensor | None:
        """DF at the rows of ``u`` in ``dtype`` from the block's structured FFN Jacobian
        (:meth:`~tl_steering.backends.field64.Float64Block.ffn_jacobian`); None for the other fields or an MLP of
        another form (the finder then differentiates the field by autograd)."""
        jac = self.block.ffn_jacobian(self.radius * u, dtype) if self.kind == "ffn" else None
        return None if jac is None else jac.mul_(self.radius)


def _default_tokens(model: Any) -> Any:
    """The windows a call without ``tokens`` draws, with their corpus label (so its provenance names them)."""
    from ..data.windows import text_windows

    return text_windows(model, n_windows=4, length=64)


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
    names = {layer: ad.hook_name(layer, _SITE[kind]) for layer in layers}
    _, cache = ad.run_with_cache(tokens, sorted(set(names.values())))
    out = {}
    for layer, name in names.items():
        check_finite(cache[name], layer, _SITE[kind])
        out[layer] = cache[name].detach().to(torch.float64)
    return out


def _build_field(ad: ModelAdapter, layer: int, kind: str, radius: Any, acts: Tensor,
                 token_index: int | None, sequence: int) -> tuple[CriticalField, str]:
    rho, mode = _resolve_radius(radius, acts)
    block = Float64Block(ad, layer)
    if kind == "ffn":
        return CriticalField(block, kind, rho), mode
    n_seq, n_pos = acts.shape[0], acts.shape[1]  # negative indices count from the end, as in Python
    sequence = as_int(sequence, "sequence", minimum=-n_seq, maximum=n_seq - 1) % n_seq
    i = as_int(n_pos - 1 if token_index is None else token_index, "token_index", minimum=-n_pos,
               maximum=n_pos - 1) % n_pos
    prefix = acts[sequence, :i].clone()
    return CriticalField(block, kind, rho, prefix=prefix, token_index=i, sequence=sequence), mode


@exclusive
def critical_field(model: Any, layer: int, field: FieldKind = "ffn", radius: str | float = "median",
                   tokens: Tensor | None = None, token_index: int | None = None, sequence: int = 0) -> CriticalField:
    """The float64 field of :func:`critical_points` as a callable ``[n, d] -> [n, d]`` (or ``[d] -> [d]``).

    Args: as :func:`critical_points`. Tokens default to ``text_tokens(model, n_windows=4, length=64)``."""
    return _layer_field(model, layer, field, radius, tokens, None, token_index, sequence)[3]


def _layer_field(model: Any, layer: int, field: Any, radius: Any, tokens: Any, corpus: str | None,
                 token_index: int | None, sequence: int) -> tuple[ModelAdapter, Tensor, str | None, CriticalField, str]:
    """(adapter, tokens, corpus, field, radius mode) of one layer, for critical_field and critical_census."""
    ad = adapt(model)
    layer = ad.check_layer(layer)
    kind = as_choice(field, "field", FIELDS)
    tokens, corpus = token_source(_default_tokens(model) if tokens is None else tokens, corpus)
    tokens = ad.validate_tokens(tokens)
    acts = _activations(ad, tokens, [layer], kind)[layer]
    return (ad, tokens, corpus, *_build_field(ad, layer, kind, radius, acts, token_index, sequence))


@exclusive
def critical_census(model: Any, layer: int, n_starts: int = 64, seed: int = 0,
                    landscape_solves: int = CENSUS_LANDSCAPE_SOLVES, level: float = 0.95, field: FieldKind = "ffn",
                    radius: str | float = "median", tokens: Tensor | None = None, corpus: str | None = None,
                    options: FinderOptions | dict[str, Any] | None = None) -> CensusResult:
    """:func:`tl_steering.critical.census.census` of one layer's field (docs/critical_points.md section 11): the
    upper bound on its attractors and repellers from random starts, the saddles found from below, and whether
    saddles are more than half of all its equilibria. Arguments as :func:`critical_points` and ``census``: the
    same finder and options as every entry point, with the census's own budget."""
    ad, tokens, corpus, fld, mode = _layer_field(model, layer, field, radius, tokens, corpus, None, 0)
    out = census(fld, fld.dim, n_starts=n_starts, seed=seed, landscape_solves=landscape_solves, level=level,
                 options=options)
    out.provenance = ad.provenance(tokens, corpus=corpus, seed=seed, protocol="census", layer=fld.layer, field=fld.kind,
                                   radius=fld.radius, radius_mode=mode, n_starts=n_starts,
                                   landscape_solves=landscape_solves, level=level)
    return out


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
         where: tuple[int | None, int], seed: int, eigensolver: str, scales: tuple[float, ...],
         opts: FinderOptions, corpus: str | None = None) -> EquilibriaResult:
    t0 = time.perf_counter()
    fld, mode = _build_field(ad, layer, kind, radius, acts, *where)
    starts = _token_starts(acts, n_starts // 2, seed)
    res = find_equilibria(fld, fld.dim, n_starts=n_starts, starts=starts, seed=seed, options=opts,
                          eigensolver=eigensolver)
    sensitivity: dict[str, Any] = {}
    for s in scales:
        if res.n_points == 0:
            sensitivity[f"{s:g}"] = {"scale": s, "radius": s * fld.radius, "n_points": 0,
                                     "counts": {k: 0 for k in (*LABELS, "rotational")}}
            continue
        again = polish_points(fld.with_radius(s * fld.radius), res.points.to(acts.device), opts, eigensolver)
        sensitivity[f"{s:g}"] = {"scale": s, "radius": s * fld.radius, "n_points": again.n_points,
                                 "n_converged": again.n_converged, "counts": again.counts()}
    options = {
        "protocol": "critical_points", "layer": layer, "field": kind, "radius": fld.radius, "radius_mode": mode,
        "radius_site": ad.hook_name(layer, _SITE[kind]), "token_index": fld.token_index,
        "sequence": fld.sequence, "n_token_starts": int(starts.shape[0]),
        "post_ffn_norm": fld.block.has_post_ffn_norm, "radius_scales": list(scales),
        "radius_sensitivity": sensitivity}
    res.options = {**res.options, **options}
    res.provenance = ad.provenance(tokens, corpus=corpus, seed=seed, **{
        k: v for k, v in res.options.items() if k not in ("seed", *ROW_KEYS)})
    res.seconds = time.perf_counter() - t0
    return res


@exclusive
def critical_points(model: Any, layers: Sequence[int] | int | None = None, field: FieldKind = "ffn",
                    radius: str | float = "median", n_starts: int = DEFAULT_N_STARTS,
                    tokens: Int[Tensor, "batch pos"] | None = None, token_index: int | None = None,
                    seed: int = 0, eigensolver: str = "auto", radius_scales: Sequence[float] | None = None,
                    sequence: int = 0, corpus: str | None = None,
                    options: FinderOptions | dict[str, Any] | None = None,
                    world: World | None = None) -> CriticalPointsResult:
    """Equilibria u* of each layer's field on S^{d-1}, their labels and the "mostly saddles" claim.

    One call for one layer (``layers=7``) or many (``layers=[0, 5]``, None = all); one forward pass collects the
    radii and token starts of every layer. See docs/critical_points.md.

    Args:
        model: a TransformerLens model (HookedTransformer or TransformerBridge); never changed, no hook left.
        layers: a layer, a list of layers, or None for all.
        field: ``"ffn"`` (F(u) = Phi(ρu)), ``"attention"`` (token i's attention field, prefix frozen) or
            ``"block"`` (their sum).
        radius: ``"median"`` (median norm of the field's input site, position 0 excluded: FFN input for "ffn",
            resid_pre for "attention"/"block") or a positive float ρ.
        n_starts: starts per layer; ``n_starts // 2`` are token directions of that site (seeded choice), the rest
            random.
        tokens: calibration tokens (default ``text_tokens(model, n_windows=4, length=64)``), a tensor or a
            :class:`~tl_steering.data.windows.TokenWindows` (its corpus label goes into the provenance).
        token_index: token i of the attention/block field (default: the last position).
        seed: seed of the token-start choice and of the random starts.
        eigensolver: "auto" | "dense" | "arpack" (see :func:`find_equilibria`).
        radius_scales: e.g. ``(0.5, 1, 2)``: re-solve from the found points at ρ·scale and record the label counts
            per scale in each layer's ``options["radius_sensitivity"]``.
        sequence: which sequence supplies the frozen prefix (attention/block).
        corpus: the corpus label recorded in the provenance (wins over a TokenWindows label).
        options: :class:`~tl_steering.critical.options.FinderOptions` (or a dict of some of its fields) of the one
            finder, :func:`find_equilibria`'s (docs/critical_points.md, "The one way in"); None: ``DEFAULT_OPTIONS``,
            whose landscape phase runs at most 32 Newton solves per layer (cost: docs/critical_points.md section 1,
            "Structured Jacobian").
        world: a process group's :class:`~tl_steering.data.sharding.World`: layer ``i`` of ``layers`` runs on rank
            ``i % size`` and every rank returns the whole result, the one-process numbers (docs/scale_out.md).

    Returns:
        A :class:`CriticalPointsResult`; ``.result(layer)`` is that layer's :class:`EquilibriaResult`."""
    ad = adapt(model)
    kind = as_choice(field, "field", FIELDS)
    scales = _check_scales(radius_scales)
    sel = ad.layers(layers)
    ad.require_resident(sel, "critical_points (a float64 copy of the block)")
    n_starts = as_int(n_starts, "n_starts", minimum=1)
    opts = finder_options(options)
    tokens, corpus = token_source(_default_tokens(model) if tokens is None else tokens, corpus)
    tokens = ad.validate_tokens(tokens)
    acts = _activations(ad, tokens, sel, kind)
    results = split_map(lambda layer: _run(ad, tokens, layer, kind, radius, acts[layer], n_starts,
                                            (token_index, sequence), seed, eigensolver, scales, opts, corpus), sel, world)
    counts = torch.tensor([[r.labels.count(lab) for lab in LABELS] for r in results], dtype=torch.int64)
    i64 = torch.int64
    return CriticalPointsResult(
        provenance=ad.provenance(tokens, corpus=corpus, seed=seed, protocol="critical_points", layers=sel,
                                 field=kind, radius=radius if isinstance(radius, str) else float(radius),
                                 n_starts=n_starts, eigensolver=eigensolver, radius_scales=list(scales),
                                 method=DEFAULT_FINDER, finder_options=opts.as_dict()),
        layers=sel, field=kind, counts=counts.reshape(len(sel), len(LABELS)),
        rotational=torch.tensor([int(sum(r.rotational)) for r in results], dtype=i64),
        rotational_pairs=torch.tensor([int(sum(r.rotational_pairs())) for r in results], dtype=i64),
        n_points=torch.tensor([r.n_points for r in results], dtype=i64),
        n_converged=torch.tensor([r.n_converged for r in results], dtype=i64),
        n_starts=torch.tensor([r.n_starts for r in results], dtype=i64),
        radius=torch.tensor([r.options["radius"] for r in results], dtype=torch.float64),
        seconds=torch.tensor([r.seconds for r in results], dtype=torch.float64), results=results)


__all__ = ["CriticalField", "CriticalPointsResult", "FIELDS", "critical_census", "critical_field", "critical_points"]
