"""The sequential-to-parallel defect, its Lie-bracket terms, the parallelization scores C_l and the field's peer
scores, with the gold standard and the speedup estimate (protocol 4; specification: docs/defect.md)."""

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from .. import geometry as geo
from .._util.timing import median_seconds
from ..backends import autodiff, check_finite
from ..backends.adapter import shared_rows
from ..backends.ownership import exclusive
from ..data.batching import iter_batches
from ..data.sharding import World, batch_slices, gather_rows, my_batches, on_rank0
from ..data.windows import model_tokens
from ..errors import InputError, ResidualIdentityError
from ..stats import check_exclude_positions, position_mask
from ..validation import as_int
from . import strategies as st
from .defect_result import BRACKET_TERMS, DEFECT_VARIANTS, SPEEDUP_LABEL, DefectResult
from .gold import PlanLoss, delta_curves, single_layer_gold
from .strategies import PEER_SCORES, default_k_values

_PHI_CHECK_FACTOR = 10.0  # Phi(ffn input) vs hook_mlp_out may differ by kernel rounding: 10x the identity tol


class _Sums:
    """Float64 sums of squared norms per sequence and layer over the valid tokens (``[n_seq, n_layer]``), kept per
    sequence so that the ranks of a distributed run gather them in window order; :meth:`get` pools them."""

    def __init__(self, n_seq: int, n: int) -> None:
        self.v: dict[str, Tensor] = {}
        self.n_seq, self.n = n_seq, n

    def add(self, key: str, rows: slice, i: int, value: Tensor) -> None:
        if key not in self.v:
            self.v[key] = torch.zeros(self.n_seq, self.n, dtype=torch.float64)
        self.v[key][rows, i] = (value * value).flatten(1).sum(-1).cpu()

    def get(self, key: str) -> Tensor:
        return self.v[key].sum(0) if key in self.v else torch.full((self.n,), math.nan, dtype=torch.float64)


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
        _, ja = autodiff.jvp(phi, (x,), (a,))
        ja = geo.to64(ja)
    return {"d": d, "ja": ja, "tan": geo.tangential_part(d, ffn_in), "phi": geo.to64(phi_in)}


def _peer_terms(x: Tensor, post: Tensor, phi_x: Tensor, phi_in: Tensor, keep: Tensor) -> dict[str, Tensor]:
    """Per sequence, the sums over the kept positions of the per-token terms of :data:`~.strategies.PEER_SCORES`
    (``[batch]`` float64): ``1 - cos(x, post)``, ``angle(x, post) / pi`` and ``1 - cos(phi_in, phi_x)``."""
    cos_block = geo.safe_cosine(x[:, keep], post[:, keep])
    ang = geo.angle(x[:, keep], post[:, keep]) / math.pi
    cos_ffn = geo.safe_cosine(phi_in[:, keep], phi_x[:, keep])
    return {"block_influence": (1.0 - cos_block).sum(-1), "angular_distance": ang.sum(-1),
            "ffn_fusion": (1.0 - cos_ffn).sum(-1)}


@exclusive
def parallel_defect(model: Any, tokens: Int[Tensor, "batch pos"], layers: Sequence[int] | int | None = None,
                    exclude_positions: Sequence[int] = (0,), brackets: bool = False, evaluate: bool = False,
                    k_values: Sequence[int] | None = None, n_random: int = 5, seed: int = 0,
                    corpus: str | None = None, timing: bool = False, batch_size: int = 8,
                    timing_repeats: int = 7, world: World | None = None,
                    timing_windows: int = 2) -> DefectResult:
    """Per-layer sequential-to-parallel defect scores C_l (every argument in docs/defect.md); planning beyond the
    paper's lowest-C choice is :func:`tl_steering.plan_parallel`."""
    t_start = time.perf_counter()
    ad, tokens, corpus = model_tokens(model, tokens, corpus)
    sel = ad.layers(layers)
    ad.require_resident(sel, "parallel_defect")
    exclude = check_exclude_positions(exclude_positions)
    batch_size = as_int(batch_size, "batch_size", minimum=1)
    seed = as_int(seed, "seed")
    n_random = as_int(n_random, "n_random", minimum=0)
    timing_repeats = as_int(timing_repeats, "timing_repeats", minimum=1)
    timing_windows = as_int(timing_windows, "timing_windows", minimum=1)
    parallel = [ad.is_parallel(lay) for lay in sel]
    ks = _k_values(k_values, parallel.count(False))  # k counts the sequential (candidate) layers
    keep = position_mask(tokens.shape[1], exclude, device=tokens.device)
    sums, peer_sums, phi_check = _collect(ad, tokens, sel, parallel, keep, brackets, batch_size, world)
    n_tokens = int(tokens.shape[0] * keep.sum())
    scores, cf_scores, nonlin, cf_nonlin, rms, bracket_rms = _reduce(sums, parallel, n_tokens, brackets)
    nan = torch.full((len(sel),), math.nan, dtype=torch.float64)
    tm = {"t_attn": nan, "t_ffn": nan.clone(), "t_forward": math.nan, "t_other": math.nan, "timing_shape": []}
    tw = min(timing_windows, batch_size, int(tokens.shape[0]))
    # on rank 0 (a machine's times, not a statistic over windows), handed to the other ranks after the gold standard,
    # which gives rank 0 that much less of its plans
    timed = on_rank0(lambda: submodule_times(ad, tokens[:tw], sel, timing_repeats), world) if timing else None
    gold = _gold(model, tokens, sel, parallel, scores, ks, n_random, seed, batch_size, world,
                 (timing_repeats, tw) if timing else None) if evaluate else {}
    tm = timed() if timed is not None else tm
    options = {"layers": sel, "exclude_positions": list(exclude), "brackets": bool(brackets),
               "evaluate": bool(evaluate), "k_values": ks, "n_random": n_random, "timing": bool(timing),
               "batch_size": batch_size, "timing_repeats": timing_repeats,
               "timing_windows": timing_windows}
    peers = {k: (v.sum(0) / n_tokens) if n_tokens else nan.clone() for k, v in peer_sums.items()}
    return DefectResult(
        provenance=ad.provenance(tokens, corpus=corpus, seed=seed, **options), layers=sel,
        already_parallel=parallel, score=scores["C"].clone(), scores=scores, nonlinearity=nonlin,
        counterfactual_scores=cf_scores, counterfactual_nonlinearity=cf_nonlin, rms=rms,
        phi_check=torch.tensor(phi_check, dtype=torch.float64), brackets=bracket_rms, peer_scores=peers,
        n_tokens=n_tokens, evaluated=bool(evaluate), clean_loss=gold.get("clean_loss", math.nan),
        delta_ce=gold.get("delta_ce", nan.clone()), spearman=gold.get("spearman", {}),
        k_values=ks if evaluate else [], curves=gold.get("curves", {}), curve_layers=gold.get("curve_layers", {}),
        t_attn=torch.as_tensor(tm["t_attn"], dtype=torch.float64),
        t_ffn=torch.as_tensor(tm["t_ffn"], dtype=torch.float64), t_forward=tm["t_forward"], t_other=tm["t_other"],
        timing_shape=tm["timing_shape"], timing_device=str(ad.device) if timing else "",
        seconds=time.perf_counter() - t_start, options=options)


def _k_values(k_values: Sequence[int] | None, n_candidates: int) -> list[int]:
    if k_values is None:
        return default_k_values(n_candidates)
    ks = sorted({int(k) for k in k_values})
    bad = [k for k in ks if not 0 <= k <= n_candidates]
    if bad:
        raise InputError(f"k_values {bad} are outside [0, {n_candidates}] (the number of sequential "
                         "layers analysed)")
    return ks


def _collect(ad: Any, tokens: Tensor, sel: list[int], parallel: list[bool], keep: Tensor, brackets: bool,
             batch_size: int, world: World | None) -> tuple["_Sums", dict[str, Tensor], list[float]]:
    """The float64 sums of every layer per window (:func:`_window_sums`; inside a suite run, the rows of an earlier
    call on windows holding these: ``shared_rows``): the defect terms, the peers' terms and the Phi check's error."""
    n, n_seq = len(sel), tokens.shape[0]
    names = [p + k for p in ("", "cf_") for k in ("d", "ja", "tan", "phi", "res")] + ["dx", "__phi_check"] + [
        "__peer_" + k for k in PEER_SCORES] + (list(BRACKET_TERMS) if brackets else [])
    got = shared_rows(ad.model, ("parallel_defect", tuple(sel), tuple(parallel), keep.cpu().numpy().tobytes()),
                      tokens, names, lambda: _window_sums(ad, tokens, sel, parallel, keep, brackets, batch_size,
                                                          world),
                      reuse=world is None or not world.active)  # the ranks of a group compute alike
    phi_rows, peer_sums = got.pop("__phi_check"), {k: got.pop("__peer_" + k) for k in PEER_SCORES}
    sums = _Sums(n_seq, n)
    sums.v = got
    return sums, peer_sums, (phi_rows.max(0).values.tolist() if n_seq else [0.0] * n)


def _window_sums(ad: Any, tokens: Tensor, sel: list[int], parallel: list[bool], keep: Tensor, brackets: bool,
                 batch_size: int, world: World | None) -> dict[str, Tensor]:
    """The sums ``[window, layer]`` of :func:`_collect` over this rank's batches (gathered in window order), or with
    fewer batches than ranks over every batch for this rank's layers (``i % size``; gathered by layer)."""
    n, n_seq = len(sel), tokens.shape[0]
    sums = _Sums(n_seq, n)
    peer_sums = {name: torch.zeros(n_seq, n, dtype=torch.float64) for name in PEER_SCORES}
    phi_rows = torch.zeros(n_seq, n, dtype=torch.float64)  # per sequence: its batch's Phi check error
    names = []
    for lay in sel:
        names += [ad.hook_name(lay, s) for s in ("resid_pre", "attn_out", "mlp_out", "resid_post")]
        if not ad.is_parallel(lay):
            names.append(ad.hook_name(lay, "resid_mid"))
    by_layer = world is not None and world.active and len(batch_slices(n_seq, batch_size)) < world.size
    mine = batch_slices(n_seq, batch_size) if by_layer else my_batches(n_seq, batch_size, world)
    todo = range(n)[world.rank::world.size] if by_layer else range(n)  # the layer columns this rank computes
    with torch.no_grad():
        for rows, _, cache in iter_batches(ad, tokens, names, batch_size, rows=mine):
            ad.check_residual_identity(cache, sel)
            for i in todo:
                _layer_sums(ad, cache, sel[i], i, parallel[i], rows, keep, brackets, sums, peer_sums, phi_rows)
            del cache
    got = {**{k: sums.v[k] for k in sorted(sums.v)}, "__phi_check": phi_rows,
           **{"__peer_" + k: v for k, v in peer_sums.items()}}
    if by_layer:  # the other ranks' layer columns (gathered as rows of the transposes)
        got = gather_rows({k: v.T.contiguous() for k, v in got.items()}, [slice(i, i + 1) for i in todo], world)
        return {k: v.T.contiguous() for k, v in got.items()}  # the one-process layout: its sums, bit for bit
    return gather_rows(got, mine, world)  # the other ranks' rows


def _layer_sums(ad: Any, cache: Any, lay: int, i: int, par: bool, rows: slice, keep: Tensor, brackets: bool,
                sums: "_Sums", peer_sums: dict[str, Tensor], phi_rows: Tensor) -> None:
    """Add one layer's terms of one batch: the actual block's defect, the counterfactual (sequential) one, the
    block update, the peers' terms and, with ``brackets``, the Lie-bracket terms."""
    g = {s: cache[ad.hook_name(lay, s)] for s in ("resid_pre", "attn_out", "mlp_out", "resid_post")}
    for site, act in g.items():
        check_finite(act, lay, site)
    x, a, mlp_out = g["resid_pre"], g["attn_out"], g["mlp_out"]
    phi = ad.ffn(lay)
    phi_x = phi(x)
    if par:
        ffn_in, phi_in_ours = x, phi_x
        y_cf = x + a
        phi_cf = phi(y_cf)
    else:
        ffn_in = cache[ad.hook_name(lay, "resid_mid")]
        phi_in_ours = phi(ffn_in)
        y_cf, phi_cf = ffn_in, mlp_out
    scale = max(float(mlp_out.abs().max()), 1e-30)
    err = float((geo.to64(phi_in_ours) - geo.to64(mlp_out)).abs().max()) / scale
    phi_rows[rows, i] = err
    tol = _PHI_CHECK_FACTOR * ad.identity_tolerance()
    if not err <= tol:
        raise ResidualIdentityError(
            f"layer {lay}: MLP(LN2(ffn input)) recomputed by tl_steering differs from hook_mlp_out (relative error "
            f"{err:.3g} > {tol:.1g}). A hook of yours may rewrite the FFN input or output, or this model's FFN is "
            "not what the adapter assumes.")
    # actual block: d = hook_mlp_out - Phi(x); the FFN input moved by a (sequential) or not at all
    act = _defect_terms(phi, x, torch.zeros_like(a) if par else a, phi_x, mlp_out, ffn_in)
    # counterfactual: the sequential ordering at this block, d = Phi(x + a) - Phi(x)
    cf = act if not par else _defect_terms(phi, x, a, phi_x, phi_cf, y_cf)
    dx = geo.to64(g["resid_post"]) - geo.to64(x)
    for name, v in _peer_terms(x, g["resid_post"], phi_x, phi_cf, keep).items():
        peer_sums[name][rows, i] = v.cpu()
    for prefix, terms in (("", act), ("cf_", cf)):
        for key in ("d", "ja", "tan", "phi"):
            sums.add(prefix + key, rows, i, terms[key][:, keep])
        sums.add(prefix + "res", rows, i, (terms["d"] - terms["ja"])[:, keep])
    sums.add("dx", rows, i, dx[:, keep])
    if brackets:
        _, da_phi = autodiff.jvp(ad.attention(lay), (x,), (phi_x,))
        da_phi = geo.to64(da_phi)
        sums.add("DPhi_A", rows, i, cf["ja"][:, keep])
        sums.add("DA_Phi", rows, i, da_phi[:, keep])
        sums.add("bracket", rows, i, (cf["ja"] - da_phi)[:, keep])


def _reduce(sums: "_Sums", parallel: list[bool], n_tokens: int, brackets: bool) -> tuple[Any, ...]:
    """The pooled ratios: the C variants (actual and counterfactual), the nonlinearity, the RMS terms, the
    brackets."""
    n = len(parallel)
    dx2 = sums.get("dx")

    def variants(prefix: str) -> dict[str, Tensor]:
        d2 = sums.get(prefix + "d")
        return {"C": _ratio(d2, dx2), "C_phi": _ratio(d2, sums.get(prefix + "phi")),
                "C1": _ratio(sums.get(prefix + "ja"), dx2), "C_tan": _ratio(sums.get(prefix + "tan"), dx2)}

    par_mask = torch.tensor(parallel, dtype=torch.bool)
    nonlin = torch.where(par_mask, torch.full((n,), math.nan, dtype=torch.float64),
                         _ratio(sums.get("res"), sums.get("d")))
    count = float(max(n_tokens, 1))
    rms = {"defect": sums.get("d"), "update": dx2, "ffn_write": sums.get("phi"), "first_order": sums.get("ja"),
           "defect_tangential": sums.get("tan"), "first_order_error": sums.get("res")}
    rms = {k: torch.sqrt(v / count) for k, v in rms.items()}
    bracket_rms = {k: torch.sqrt(sums.get(k) / count) for k in BRACKET_TERMS} if brackets else {}
    return (variants(""), variants("cf_"), nonlin, _ratio(sums.get("cf_res"), sums.get("cf_d")), rms, bracket_rms)


def _gold(model: Any, tokens: Tensor, sel: list[int], parallel: list[bool], scores: dict[str, Tensor],
          ks: list[int], n_random: int, seed: int, batch_size: int, world: World | None,
          timing: tuple[int, int] | None = None) -> dict[str, Any]:
    """The gold standard (docs/defect.md): the clean CE, the single-layer dCE with each variant's Spearman rho, and
    the loss-vs-k curves of the lowest-C, highest-C, contiguous (lowest summed C) and random plans; ``timing``:
    (repeats, windows) of the sub-module timing rank 0 ran, weighed as its load in the plans' split."""
    loss = PlanLoss(model, tokens, batch_size, world=world)
    load = [] if timing is None else [_timing_work(loss, len(sel), *timing)]
    candidates = [lay for lay, par in zip(sel, parallel) if not par]
    score_of = {lay: float(scores["C"][i]) for i, lay in enumerate(sel)}
    sets: dict[str, list] = {
        "lowest": [st.one_shot(candidates, score_of, k, lowest=True) for k in ks],
        "highest": [st.one_shot(candidates, score_of, k, lowest=False) for k in ks],
        "contiguous": [st.contiguous(candidates, score_of, k) for k in ks],
        "random": st.random_sets(candidates, ks, n_random, seed)}
    # every plan measured once (one pass over the windows each), split over the ranks of a process group
    loss.prefetch([[]] + [[lay] for lay in candidates] + [p for name in ("lowest", "highest", "contiguous")
                                                          for p in sets[name]]
                  + [p for draw in sets["random"] for p in draw], load)
    delta_ce, spearman = single_layer_gold(loss, sel, parallel, scores)
    curves = {"k": torch.tensor(ks, dtype=torch.int64),
              **delta_curves(loss, {name: sets[name] for name in ("lowest", "highest", "contiguous")})}
    draws = delta_curves(loss, {str(r): draw for r, draw in enumerate(sets["random"])})
    rnd = torch.stack(list(draws.values())) if n_random else torch.zeros(0, len(ks), dtype=torch.float64)
    curves["random"] = rnd.reshape(n_random, len(ks))
    curves["random_mean"] = rnd.mean(0) if n_random else torch.full((len(ks),), math.nan, dtype=torch.float64)
    return {"clean_loss": loss.clean, "delta_ce": delta_ce, "spearman": spearman, "curves": curves,
            "curve_layers": sets}


def submodule_times(ad: Any, tokens: Tensor, layers: Sequence[int], repeats: int) -> dict[str, Any]:
    """Median seconds of ``ad.attention(l)`` on resid_pre and ``ad.ffn(l)`` on the FFN input per layer of
    ``layers`` on ``tokens`` (one batch, 1 warm-up call), of a hook-free forward (warmed by the cache pass that
    gives the inputs), and ``t_other`` (the forward
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
    t_forward = median_seconds(lambda: ad.model(tokens, return_type="logits"), ad.device, 0,  # warm: the cache pass
                               max(3, repeats // 2))
    t_other = max(t_forward - float(sum(t_attn) + sum(t_ffn)), 0.0) if len(layers) == ad.n_layers else math.nan
    return {"t_attn": torch.tensor(t_attn, dtype=torch.float64), "t_ffn": torch.tensor(t_ffn, dtype=torch.float64),
            "t_forward": t_forward, "t_other": t_other, "timing_shape": [int(s) for s in tokens.shape]}


def _timing_work(loss: PlanLoss, n_layers: int, repeats: int, windows: int) -> float:
    """What :func:`submodule_times` runs on ``windows`` of ``loss``'s windows, in :meth:`PlanLoss.work`'s unit:
    1 + ``repeats`` calls of each layer's attention and FFN, a cache pass and max(3, ``repeats // 2``) forwards."""
    per_window = (repeats + 1) * n_layers + (max(3, repeats // 2) + 1) * loss.work([])
    return per_window * windows / int(loss.tokens.shape[0])


__all__ = ["BRACKET_TERMS", "DEFECT_VARIANTS", "DefectResult", "SPEEDUP_LABEL", "default_k_values", "parallel_defect"]
