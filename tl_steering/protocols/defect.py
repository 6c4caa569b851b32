"""Sequential-to-parallel defect, Lie bracket and the parallelization score C_l (docs/defect.md, protocol 4).

Per layer l with x = resid_pre, a = attn_out, y = resid_mid = x + a (the FFN input of a sequential block),
Phi = MLP(LN2(.)) (``ad.ffn(l)``, positionwise) and Dx = resid_post - resid_pre:

* sequential block  S(x) = x + A(x) + Phi(x + A(x)); parallel surrogate  P(x) = x + A(x) + Phi(x);
* exact defect [P/S]  ``d = S(x) - P(x) = Phi(x + a) - Phi(x)``, measured as ``hook_mlp_out - Phi(x)`` (the
  model's own FFN write minus our Phi at the block input; ``Phi(y) == hook_mlp_out`` is verified per layer and
  recorded in ``phi_check``);
* first-order estimate  ``J_Phi(x) a = D_Phi[a](x)``: one ``torch.func.jvp(Phi, (x,), (a,))``, positionwise;
* nonlinearity index  ``nu = sqrt(sum ||d - J a||^2) / sqrt(sum ||d||^2)``;
* scores [paper + ours, docs/defect.md], pooled over the tokens of the non-excluded positions, float64:

  - ``C``     (primary) ``sqrt(sum ||d||^2) / sqrt(sum ||Dx||^2)``: relative RMS of the defect against the
    block update;
  - ``C_phi`` ``sqrt(sum ||d||^2) / sqrt(sum ||Phi(x + a)||^2)``: relative to the FFN write;
  - ``C1``    ``C`` with ``J_Phi(x) a`` in place of d (the cheap first-order "input-sensitivity" estimate);
  - ``C_tan`` ``C`` with ``P_{u(y)} d`` in place of d (only the tangential part steers);

* optional Lie-bracket terms (``brackets=True``): RMS per token of ``DPhi.A = J_Phi(x) a``, of
  ``DA.Phi = JVP of X -> A(X) = attn(LN1(X)) at X = resid_pre in the direction V = Phi(X)`` (whole sequence,
  causal: V at every position, the excluded ones included, since later tokens attend to them) and of the
  bracket ``[A, Phi] = DPhi.A - DA.Phi``. Since ``d ~ DPhi.A = 1/2 [A, Phi] + 1/2 (DPhi.A + DA.Phi)``, the
  defect is governed by the bracket *and* the directional-derivative term [S+I].

Gold standard (``evaluate=True``, :mod:`tl_steering.planning.gold`): ``dCE_l = CE(layer l alone parallel) -
CE(clean)`` with :func:`tl_steering.hooks.parallel_blocks`, the Spearman correlation of every C variant with dCE_l, and the
loss-vs-k curves of four layer choices (``lowest`` / ``highest`` C, ``random`` seeded draws, ``contiguous`` =
the window of k consecutive candidate layers with the lowest summed C, earliest on ties). CE is the mean
next-token cross-entropy over every predicted position (the loss is not subject to ``exclude_positions``).

Already-parallel blocks (GPT-NeoX/Pythia): the block IS its parallel surrogate, so the defect is 0 by
construction. It is still *measured* the same way (``hook_mlp_out - Phi(resid_pre)``, zero up to float
rounding, see ``already_parallel`` and ``phi_check``); ``C1`` is exactly 0 there (the FFN input does not move,
the JVP direction is 0) and ``nu`` is NaN (0/0). They are never candidates of :meth:`DefectResult.plan` or of
the curves, and their dCE is 0 exactly (``parallel_blocks`` leaves them alone). ``counterfactual_scores``
holds, for every block, the scores of ``Phi(x + a) - Phi(x)`` with x = resid_pre: for a sequential block
they equal ``scores``; for a parallel block they say how far a *sequential* ordering would move it
(docs/defect.md: a new construction [ours], not the paper's).

Speedup (``timing=True``, opt-in, :mod:`tl_steering.planning.speedup`) [ours]: per-submodule times on the model's device with ``ad.attention(l)`` (LN1 +
attention) and ``ad.ffn(l)`` (LN2 + MLP) on the first ``batch_size`` sequences, after warm-up, median over
repeats (CUDA events on GPU, ``time.perf_counter`` on CPU). For a set S of parallelized layers
``T_seq = sum_l (t_attn + t_ffn)`` and
``T_par = sum_{l not in S} (t_attn + t_ffn) + sum_{l in S} max(t_attn, t_ffn)``: an *estimate* of the
critical path if attention and FFN ran concurrently, not a kernel measurement.

Precision: the forward passes and JVPs run in the model dtype (fp32 for SmolLM2/GPT-2); every result is cast
to float64 before norms and sums. In fp32 the relative rounding of d is ~1e-7 ||Phi|| / ||d||; for a float64
analysis cast a copy of the model (``model.to(torch.float64)``).
"""

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .. import geometry as geo
from ..backends import adapt, check_finite
from ..data import token_source
from ..errors import InputError, ResidualIdentityError
from ..planning import strategies as _strategies
from ..planning.gold import PlanLoss, single_layer_delta
from ..planning.gold import spearman as _spearman
from ..planning.speedup import SPEEDUP_LABEL, estimate_speedup, submodule_times
from ..planning.strategies import default_k_values
from ..results import Result, register
from ._common import check_batch_size, check_exclude_positions, check_seed, iter_batches, position_mask

DEFECT_VARIANTS: tuple[str, ...] = ("C", "C_phi", "C1", "C_tan")
"""Score variants (keys of :attr:`DefectResult.scores`); ``"C"`` is the primary one."""
CURVE_STRATEGIES: tuple[str, ...] = ("lowest", "highest", "random", "contiguous")
"""Layer choices of the loss-vs-k curves."""
BRACKET_TERMS: tuple[str, ...] = ("DPhi_A", "DA_Phi", "bracket")
"""Keys of :attr:`DefectResult.brackets`: RMS of DPhi.A, DA.Phi and [A, Phi] = DPhi.A - DA.Phi."""
DEFECT_RMS_TERMS: tuple[str, ...] = ("defect", "update", "ffn_write", "first_order", "defect_tangential",
                              "first_order_error")
"""Keys of :attr:`DefectResult.rms`: per-token RMS of d, Dx, Phi(ffn input), J a, P_u d and d - J a."""

_PHI_CHECK_FACTOR = 10.0  # Phi(ffn input) vs hook_mlp_out may differ by kernel rounding: 10x the identity tol


# ----------------------------------------------------------------------------------------------------------
# result


def _nan_vec(n: int = 0) -> Callable[[], Tensor]:
    return lambda: torch.full((n,), math.nan, dtype=torch.float64)


@register
@dataclasses.dataclass(kw_only=True)
class DefectResult(Result):
    """Per-layer sequential-to-parallel defect scores, optionally with the loss they predict and timings.

    Every per-layer tensor is indexed like :attr:`layers` (entry i belongs to block ``layers[i]``).

    Attributes:
        layers: the analysed blocks (sorted).
        already_parallel: per layer, whether the block is parallel already (NeoX/Pythia); see the module doc.
        score: primary score C_l (float64), ``scores["C"]``.
        scores: every variant, keys :data:`DEFECT_VARIANTS` (``C``, ``C_phi``, ``C1``, ``C_tan``).
        nonlinearity: nu_l = ||d - J a|| / ||d|| (pooled RMS); NaN for already-parallel blocks.
        counterfactual_scores: the variants of ``Phi(x + a) - Phi(x)`` with x = resid_pre, for every block
            (equal to ``scores`` for sequential blocks).
        counterfactual_nonlinearity: nu of that counterfactual defect.
        rms: per-token RMS (absolute, float64) of the terms :data:`DEFECT_RMS_TERMS`.
        phi_check: per layer, max |Phi(ffn input) - hook_mlp_out| / max |hook_mlp_out| (our FFN callable
            reproduces the model's FFN write; rounding level).
        brackets: RMS per token of ``DPhi_A``, ``DA_Phi``, ``bracket`` (empty unless ``brackets=True``).
        n_tokens: tokens pooled per layer (non-excluded positions of every sequence).
        evaluated: whether the gold-standard losses were computed.
        clean_loss: mean next-token CE of the unmodified model (NaN unless evaluated).
        delta_ce: per layer, CE with that layer alone parallel minus clean CE (0 for already-parallel blocks).
        spearman: Spearman rho of each variant with ``delta_ce`` over the candidate (sequential) layers; NaN
            with fewer than 3 candidates or a constant input.
        k_values: the k of the curves.
        curves: ``k`` (int64), ``lowest``, ``highest``, ``contiguous``, ``random_mean`` (dCE per k, float64)
            and ``random`` ([n_random, n_k]).
        curve_layers: the layer sets behind every curve point (``random``: one list per draw).
        t_attn / t_ffn: median seconds of LN1+attention / LN2+MLP per layer (NaN unless ``timing``).
        t_forward: median seconds of a whole forward (no hooks) on the same slice.
        t_other: ``t_forward - sum_l (t_attn + t_ffn)`` over all blocks, clamped at 0: embedding, final norm,
            unembedding and framework overhead (NaN when only some layers were timed).
        timing_shape: ``[batch, pos]`` of the timed slice.
        timing_device: device the times were taken on.
        seconds: wall time of the call.
        options: every option of the call.
    """

    layers: list[int] = dataclasses.field(default_factory=list)
    already_parallel: list[bool] = dataclasses.field(default_factory=list)
    score: Float[Tensor, " layer"] = dataclasses.field(default_factory=_nan_vec())
    scores: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    nonlinearity: Float[Tensor, " layer"] = dataclasses.field(default_factory=_nan_vec())
    counterfactual_scores: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    counterfactual_nonlinearity: Float[Tensor, " layer"] = dataclasses.field(default_factory=_nan_vec())
    rms: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    phi_check: Float[Tensor, " layer"] = dataclasses.field(default_factory=_nan_vec())
    brackets: dict[str, Float[Tensor, " layer"]] = dataclasses.field(default_factory=dict)
    n_tokens: int = 0
    evaluated: bool = False
    clean_loss: float = math.nan
    delta_ce: Float[Tensor, " layer"] = dataclasses.field(default_factory=_nan_vec())
    spearman: dict[str, float] = dataclasses.field(default_factory=dict)
    k_values: list[int] = dataclasses.field(default_factory=list)
    curves: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    curve_layers: dict[str, list] = dataclasses.field(default_factory=dict)
    t_attn: Float[Tensor, " layer"] = dataclasses.field(default_factory=_nan_vec())
    t_ffn: Float[Tensor, " layer"] = dataclasses.field(default_factory=_nan_vec())
    t_forward: float = math.nan
    t_other: float = math.nan
    timing_shape: list[int] = dataclasses.field(default_factory=list)
    timing_device: str = ""
    seconds: float = 0.0
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    kind = "defect"

    def __post_init__(self) -> None:
        n = len(self.layers)
        # per-layer fields left at their (empty) defaults mean "not computed": NaN per layer
        for name in ("score", "nonlinearity", "counterfactual_nonlinearity", "phi_check", "delta_ce",
                     "t_attn", "t_ffn"):
            if n and len(getattr(self, name)) == 0:
                setattr(self, name, torch.full((n,), math.nan, dtype=torch.float64))
        if n and not self.already_parallel:
            self.already_parallel = [False] * n
        if "C" in self.scores and len(self.score) == n and bool(torch.isnan(self.score).all()):
            self.score = self.scores["C"].clone()
        per_layer: dict[str, Any] = {"already_parallel": self.already_parallel, "score": self.score,
                                     "nonlinearity": self.nonlinearity, "phi_check": self.phi_check,
                                     "delta_ce": self.delta_ce, "t_attn": self.t_attn, "t_ffn": self.t_ffn,
                                     "counterfactual_nonlinearity": self.counterfactual_nonlinearity}
        for group in ("scores", "counterfactual_scores", "rms", "brackets"):
            per_layer.update({f"{group}[{k!r}]": v for k, v in getattr(self, group).items()})
        for name, value in per_layer.items():
            if len(value) != n:
                raise InputError(f"DefectResult.{name} has {len(value)} entries for {n} layers; build it "
                                 "with parallel_defect")

    # -- layer selection ------------------------------------------------------------------------------------
    @property
    def candidates(self) -> list[int]:
        """Layers that can be made parallel (the sequential ones among :attr:`layers`)."""
        return [lay for lay, par in zip(self.layers, self.already_parallel) if not par]

    def _variant(self, variant: str) -> Tensor:
        if variant not in self.scores:
            raise InputError(f"unknown score variant {variant!r}; choose one of {sorted(self.scores)}")
        return self.scores[variant]

    def plan(self, k: int, variant: str = "C") -> list[int]:
        """The k sequential layers with the lowest score (ties: lower layer first), sorted by layer index.

        Already-parallel blocks are never chosen (nothing would change). NaN scores rank last.
        """
        return _choose(self.layers, self.candidates, self._variant(variant), k, lowest=True)

    # -- speedup --------------------------------------------------------------------------------------------
    def speedup_estimate(self, layers: Sequence[int]) -> dict[str, Any]:
        """Estimated speedup of making ``layers`` parallel, from the measured sub-module times.

        ``T_seq = sum_l (t_attn,l + t_ffn,l)``; ``T_par = sum_{l not in S} (t_attn,l + t_ffn,l) +
        sum_{l in S} max(t_attn,l, t_ffn,l)`` over the timed layers (already-parallel blocks count with
        ``max`` in both, as the model has them). ``*_with_other`` adds :attr:`t_other` (embedding, final norm,
        unembedding, overhead) to both totals. The ``label`` says what this is: an estimate of the critical
        path if attention and FFN ran concurrently, not a measured kernel speedup.
        """
        if not torch.isfinite(self.t_attn).all() or not torch.isfinite(self.t_ffn).all() or not self.layers:
            raise InputError("no sub-module times in this result: run parallel_defect(..., timing=True)")
        return estimate_speedup(self.layers, self.already_parallel, self.t_attn, self.t_ffn, layers,
                                t_other=self.t_other, timing_shape=self.timing_shape, device=self.timing_device)

    # -- display --------------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        cand = self.candidates
        out: dict[str, Any] = {"n_layers": len(self.layers), "n_candidates": len(cand),
                               "n_already_parallel": int(sum(self.already_parallel)),
                               "n_tokens": self.n_tokens}
        idx = [i for i, par in enumerate(self.already_parallel) if not par]
        if idx:
            c = self.score[idx]
            out.update({"C_mean": float(c.mean()), "C_min": float(c.min()), "C_max": float(c.max()),
                        "C_argmin_layer": cand[int(c.argmin())], "C_argmax_layer": cand[int(c.argmax())],
                        "nonlinearity_median": float(self.nonlinearity[idx].nanmedian())})
        half = len(cand) // 2
        out["k_half"] = half
        if self.evaluated:
            out["clean_loss"] = self.clean_loss
            out.update({f"spearman_{k}": v for k, v in self.spearman.items()})
            if "k" in self.curves and half in self.k_values:
                j = self.k_values.index(half)
                for s in ("lowest", "highest", "contiguous", "random_mean"):
                    out[f"dCE_{s}_half"] = float(self.curves[s][j])
        if cand and torch.isfinite(self.t_attn).all() and torch.isfinite(self.t_ffn).all():
            est = self.speedup_estimate(self.plan(half))
            out["speedup_estimate_half"] = est["speedup"]
            out["speedup_estimate_with_other_half"] = est["speedup_with_other"]
        return out

    def plot(self, title: str | None = None):
        """Per-layer score variants (top) and, when computed, the bracket norms (bottom); plotly Figure."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        rows = 2 if self.brackets else 1
        fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                            subplot_titles=["defect scores C_l"] + (["Lie-bracket terms (RMS per token)"]
                                                                    if rows == 2 else []))
        for name, val in self.scores.items():
            fig.add_trace(go.Scatter(x=self.layers, y=val.tolist(), mode="lines+markers", name=name),
                          row=1, col=1)
        par = [lay for lay, p in zip(self.layers, self.already_parallel) if p]
        if par:
            fig.add_trace(go.Scatter(x=par, y=[0.0] * len(par), mode="markers", name="already parallel",
                                     marker={"symbol": "x", "size": 10, "color": "black"}), row=1, col=1)
        for name, val in self.brackets.items():
            fig.add_trace(go.Scatter(x=self.layers, y=val.tolist(), mode="lines+markers", name=name),
                          row=2, col=1)
        fig.update_xaxes(title_text="layer", row=rows, col=1)
        fig.update_yaxes(title_text="score", row=1, col=1)
        fig.update_layout(title=title or f"Sequential-to-parallel defect ({self.provenance.model})",
                          template="plotly_white")
        return fig

    def plot_curves(self, title: str | None = None):
        """dCE vs number of parallelized layers k for each layer choice (plotly Figure)."""
        import plotly.graph_objects as go

        if not self.evaluated:
            raise InputError("no loss curves in this result: run parallel_defect(..., evaluate=True)")
        fig = go.Figure()
        k = self.curves["k"].tolist()
        for name in ("lowest", "highest", "contiguous", "random_mean"):
            fig.add_trace(go.Scatter(x=k, y=self.curves[name].tolist(), mode="lines+markers",
                                     name={"lowest": "lowest C", "highest": "highest C",
                                           "random_mean": "random (mean)"}.get(name, name)))
        rnd = self.curves.get("random")
        if rnd is not None and rnd.numel():
            for r, row in enumerate(rnd.tolist()):
                fig.add_trace(go.Scatter(x=k, y=row, mode="markers", name=f"random draw {r}",
                                         showlegend=r == 0, legendgroup="draws",
                                         marker={"color": "gray", "size": 5, "opacity": 0.5}))
        fig.update_layout(title=title or f"Loss increase vs parallelized layers ({self.provenance.model})",
                          xaxis_title="k (layers made parallel)", yaxis_title="ΔCE (nats)",
                          template="plotly_white")
        return fig


# ----------------------------------------------------------------------------------------------------------
# helpers


def _choose(layers: Sequence[int], candidates: Sequence[int], score: Tensor, k: int,
            lowest: bool) -> list[int]:
    pos = {lay: i for i, lay in enumerate(layers)}
    return _strategies.one_shot(candidates, {lay: float(score[pos[lay]]) for lay in candidates}, k, lowest)


class _Sums:
    """Float64 running sums of squared norms per layer, pooled over the valid tokens."""

    def __init__(self, n: int) -> None:
        self.v: dict[str, list[float]] = {}
        self.n = n

    def add(self, key: str, i: int, value: Tensor) -> None:
        self.v.setdefault(key, [0.0] * self.n)[i] += float((value * value).sum())

    def get(self, key: str) -> Tensor:
        return torch.tensor(self.v.get(key, [math.nan] * self.n), dtype=torch.float64)


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """sqrt(num / den) of summed squares; NaN where den is 0."""
    out = torch.sqrt(num / den.clamp_min(1e-300))
    return torch.where(den > 0, out, torch.full_like(out, math.nan))


def _defect_terms(phi: Callable[[Tensor], Tensor], x: Tensor, a: Tensor, phi_x: Tensor, phi_in: Tensor,
                  ffn_in: Tensor) -> dict[str, Tensor]:
    """d = phi_in - phi_x, J_Phi(x) a (JVP in the model dtype), P_{u(ffn_in)} d; all float64."""
    d = geo.to64(phi_in) - geo.to64(phi_x)
    if bool((a == 0).all()):
        ja = torch.zeros_like(d)
    else:
        _, ja = torch.func.jvp(phi, (x,), (a,))
        ja = geo.to64(ja)
    return {"d": d, "ja": ja, "tan": geo.tangential_part(d, ffn_in), "phi": geo.to64(phi_in)}


# ----------------------------------------------------------------------------------------------------------
# the protocol


def parallel_defect(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    layers: Sequence[int] | int | None = None,
    exclude_positions: Sequence[int] = (0,),
    brackets: bool = False,
    evaluate: bool = False,
    k_values: Sequence[int] | None = None,
    n_random: int = 5,
    seed: int = 0,
    corpus: str | None = None,
    timing: bool = False,
    batch_size: int = 8,
    timing_repeats: int = 7,
) -> DefectResult:
    """Per-layer sequential-to-parallel defect scores C_l (docs/defect.md); see the module docstring.

    Layer planning beyond the paper's lowest-C choice (a loss-aware score, greedy and contiguous planners,
    held-out evaluation) is :func:`tl_steering.plan_parallel` / :func:`tl_steering.parallel_scores`.

    Args:
        model: a TransformerLens model (HookedTransformer or TransformerBridge). Never modified; every hook
            added is removed before returning.
        tokens: ``[batch, pos]`` token ids on the model's device (calibration text).
        layers: blocks to analyse (default all). Curves and plans use the sequential ones among them.
        exclude_positions: positions left out of every pooled statistic (default the BOS/sink position 0);
            they stay in the forward pass.
        brackets: also compute the RMS of DPhi.A, DA.Phi and the Lie bracket [A, Phi] (one JVP of each
            attention sublayer over the whole sequence).
        evaluate: compute the gold standard: clean CE, single-layer dCE_l, Spearman of every variant with it,
            and the loss-vs-k curves.
        k_values: k of the curves (default :func:`default_k_values`); each in ``[0, L]`` with L the number of
            sequential layers analysed.
        n_random: random layer sets per k (seeded by ``seed``).
        seed: seed of the random layer sets.
        timing: also measure per-submodule times for :meth:`DefectResult.speedup_estimate` (opt-in: off by
            default so a scoring call is fast and deterministic; see
            :func:`tl_steering.planning.speedup.submodule_times`).
        batch_size: sequences per forward pass (also the timed slice).
        timing_repeats: timed calls per sub-module (median reported, after 2 warm-up calls).

    Returns:
        A :class:`DefectResult`.
    """
    t_start = time.perf_counter()
    ad = adapt(model)
    tokens, corpus = token_source(tokens, corpus)
    tokens = ad.validate_tokens(tokens)
    sel = ad.layers(layers)
    exclude = check_exclude_positions(exclude_positions)
    batch_size = check_batch_size(batch_size)
    seed = check_seed(seed)
    if isinstance(n_random, bool) or not isinstance(n_random, int) or n_random < 0:
        raise InputError(f"n_random must be an int >= 0, got {n_random!r}")
    if isinstance(timing_repeats, bool) or not isinstance(timing_repeats, int) or timing_repeats < 1:
        raise InputError(f"timing_repeats must be a positive int, got {timing_repeats!r}")
    parallel = [ad.is_parallel(lay) for lay in sel]
    candidates = [lay for lay, par in zip(sel, parallel) if not par]
    if k_values is None:
        ks = default_k_values(len(candidates))
    else:
        ks = sorted({int(k) for k in k_values})
        bad = [k for k in ks if not 0 <= k <= len(candidates)]
        if bad:
            raise InputError(f"k_values {bad} are outside [0, {len(candidates)}] (the number of sequential "
                             "layers analysed)")
    keep = position_mask(tokens.shape[1], exclude, device=tokens.device)
    n = len(sel)
    sums = _Sums(n)
    phi_check = [0.0] * n
    t_attn = [math.nan] * n
    t_ffn = [math.nan] * n
    names = []
    for lay in sel:
        names += [ad.hook_name(lay, s) for s in ("resid_pre", "attn_out", "mlp_out", "resid_post")]
        if not ad.is_parallel(lay):
            names.append(ad.hook_name(lay, "resid_mid"))
    tol = ad.identity_tolerance()
    n_tokens = 0

    with torch.no_grad():
        for rows, _, cache in iter_batches(ad, tokens, names, batch_size):
            ad.check_residual_identity(cache, sel)
            n_tokens += int(tokens[rows].shape[0] * keep.sum())
            for i, lay in enumerate(sel):
                g = {s: cache[ad.hook_name(lay, s)]
                     for s in ("resid_pre", "attn_out", "mlp_out", "resid_post")}
                for site, act in g.items():
                    check_finite(act, lay, site)
                x, a, mlp_out = g["resid_pre"], g["attn_out"], g["mlp_out"]
                phi = ad.ffn(lay)
                phi_x = phi(x)
                if parallel[i]:
                    ffn_in, phi_in_ours = x, phi_x
                    y_cf = x + a
                    phi_cf = phi(y_cf)
                else:
                    ffn_in = cache[ad.hook_name(lay, "resid_mid")]
                    phi_in_ours = phi(ffn_in)
                    y_cf, phi_cf = ffn_in, mlp_out
                scale = max(float(mlp_out.abs().max()), 1e-30)
                err = float((geo.to64(phi_in_ours) - geo.to64(mlp_out)).abs().max()) / scale
                phi_check[i] = max(phi_check[i], err)
                if not err <= _PHI_CHECK_FACTOR * tol:
                    raise ResidualIdentityError(
                        f"layer {lay}: MLP(LN2(ffn input)) recomputed by tl_steering differs from "
                        f"hook_mlp_out (relative error {err:.3g} > {_PHI_CHECK_FACTOR * tol:.1g}). A hook of "
                        "yours may rewrite the FFN input or output, or this model's FFN is not what the "
                        "adapter assumes."
                    )
                # actual block: d = hook_mlp_out - Phi(x); the FFN input moved by a (sequential) or not at all
                act = _defect_terms(phi, x, torch.zeros_like(a) if parallel[i] else a, phi_x, mlp_out, ffn_in)
                # counterfactual: the sequential ordering at this block, d = Phi(x + a) - Phi(x)
                cf = act if not parallel[i] else _defect_terms(phi, x, a, phi_x, phi_cf, y_cf)
                dx = geo.to64(g["resid_post"]) - geo.to64(x)
                for prefix, terms in (("", act), ("cf_", cf)):
                    sums.add(prefix + "d", i, terms["d"][:, keep])
                    sums.add(prefix + "ja", i, terms["ja"][:, keep])
                    sums.add(prefix + "tan", i, terms["tan"][:, keep])
                    sums.add(prefix + "res", i, (terms["d"] - terms["ja"])[:, keep])
                    sums.add(prefix + "phi", i, terms["phi"][:, keep])
                sums.add("dx", i, dx[:, keep])
                if brackets:
                    _, da_phi = torch.func.jvp(ad.attention(lay), (x,), (phi_x,))
                    da_phi = geo.to64(da_phi)
                    sums.add("DPhi_A", i, cf["ja"][:, keep])
                    sums.add("DA_Phi", i, da_phi[:, keep])
                    sums.add("bracket", i, (cf["ja"] - da_phi)[:, keep])
            del cache

    dx2 = sums.get("dx")

    def variants(prefix: str) -> dict[str, Tensor]:
        d2 = sums.get(prefix + "d")
        return {"C": _ratio(d2, dx2), "C_phi": _ratio(d2, sums.get(prefix + "phi")),
                "C1": _ratio(sums.get(prefix + "ja"), dx2), "C_tan": _ratio(sums.get(prefix + "tan"), dx2)}

    scores = variants("")
    cf_scores = variants("cf_")
    par_mask = torch.tensor(parallel, dtype=torch.bool)
    nonlin = torch.where(par_mask, torch.full((n,), math.nan, dtype=torch.float64),
                         _ratio(sums.get("res"), sums.get("d")))
    cf_nonlin = _ratio(sums.get("cf_res"), sums.get("cf_d"))
    count = float(max(n_tokens, 1))
    rms = {"defect": sums.get("d"), "update": dx2, "ffn_write": sums.get("phi"),
           "first_order": sums.get("ja"), "defect_tangential": sums.get("tan"),
           "first_order_error": sums.get("res")}
    rms = {k: torch.sqrt(v / count) for k, v in rms.items()}
    bracket_rms = {k: torch.sqrt(sums.get(k) / count) for k in BRACKET_TERMS} if brackets else {}

    # -- timing (opt-in): sub-module and whole-forward times on the first batch ------------------------------
    t_forward = t_other = math.nan
    timing_shape: list[int] = []
    if timing:
        tm = submodule_times(ad, tokens[:batch_size], sel, timing_repeats)
        t_attn, t_ffn = tm["t_attn"].tolist(), tm["t_ffn"].tolist()
        t_forward, t_other, timing_shape = tm["t_forward"], tm["t_other"], tm["timing_shape"]

    # -- gold standard (tl_steering.planning.gold) ----------------------------------------------------------
    clean_loss = math.nan
    delta_ce = torch.full((n,), math.nan, dtype=torch.float64)
    spearman: dict[str, float] = {}
    curves: dict[str, Tensor] = {}
    curve_layers: dict[str, list] = {}
    if evaluate:
        loss = PlanLoss(model, tokens, batch_size)
        clean_loss = loss.clean
        delta_ce = single_layer_delta(loss, sel, parallel)
        cidx = [i for i, par in enumerate(parallel) if not par]
        spearman = {v: _spearman(s[cidx], delta_ce[cidx]) for v, s in scores.items()}
        score_of = {lay: float(scores["C"][i]) for i, lay in enumerate(sel)}
        sets: dict[str, list] = {
            "lowest": [_strategies.one_shot(candidates, score_of, k, lowest=True) for k in ks],
            "highest": [_strategies.one_shot(candidates, score_of, k, lowest=False) for k in ks],
            "contiguous": [_strategies.contiguous(candidates, score_of, k) for k in ks],
            "random": _strategies.random_sets(candidates, ks, n_random, seed),
        }
        curves["k"] = torch.tensor(ks, dtype=torch.int64)
        for name in ("lowest", "highest", "contiguous"):
            curves[name] = torch.tensor([loss.delta(s) for s in sets[name]], dtype=torch.float64)
        rnd = torch.tensor([[loss.delta(s) for s in draw] for draw in sets["random"]],
                           dtype=torch.float64).reshape(n_random, len(ks))
        curves["random"] = rnd
        curves["random_mean"] = (rnd.mean(0) if n_random
                                 else torch.full((len(ks),), math.nan, dtype=torch.float64))
        curve_layers = sets

    options = {"layers": sel, "exclude_positions": list(exclude), "brackets": bool(brackets),
               "evaluate": bool(evaluate), "k_values": ks, "n_random": n_random, "timing": bool(timing),
               "batch_size": batch_size, "timing_repeats": timing_repeats}
    return DefectResult(
        provenance=ad.provenance(tokens, corpus=corpus, seed=seed, **options),
        layers=sel,
        already_parallel=parallel,
        score=scores["C"].clone(),
        scores=scores,
        nonlinearity=nonlin,
        counterfactual_scores=cf_scores,
        counterfactual_nonlinearity=cf_nonlin,
        rms=rms,
        phi_check=torch.tensor(phi_check, dtype=torch.float64),
        brackets=bracket_rms,
        n_tokens=n_tokens,
        evaluated=bool(evaluate),
        clean_loss=clean_loss,
        delta_ce=delta_ce,
        spearman=spearman,
        k_values=ks if evaluate else [],
        curves=curves,
        curve_layers=curve_layers,
        t_attn=torch.tensor(t_attn, dtype=torch.float64),
        t_ffn=torch.tensor(t_ffn, dtype=torch.float64),
        t_forward=t_forward,
        t_other=t_other,
        timing_shape=timing_shape,
        timing_device=str(ad.device) if timing else "",
        seconds=time.perf_counter() - t_start,
        options=options,
    )


__all__ = [
    "BRACKET_TERMS",
    "DefectResult",
    "DEFECT_RMS_TERMS",
    "SPEEDUP_LABEL",
    "CURVE_STRATEGIES",
    "DEFECT_VARIANTS",
    "default_k_values",
    "parallel_defect",
]
