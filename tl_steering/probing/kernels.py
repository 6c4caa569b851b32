"""Float64 kernels of the streaming probe (:func:`tl_steering.probe`, ``tl_steering/probing/trace.py``;
docs/probe.md)."""

import concurrent.futures
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .._util.threads import usable_cores
from ..geometry import EPS_NORM, SINGULAR_REL

F64 = torch.float64
EPS64 = torch.finfo(torch.float64).eps
# slot order of the probe's buffer: the per-token Gram groups (x, a, z) and (y, phi) are runs of slots
SLOT_ORDER = ("resid_pre", "attn_out", "resid_post", "resid_mid", "mlp_out")
DIVERSITY_STATS = ("pairwise_cosine", "resultant_length", "effective_rank", "participation_ratio")


def erank_from_eigvalsh(ev: Tensor) -> Tensor:
    """Effective rank of unit-row matrices from the eigenvalues ``[..., size]`` of their Gram matrix, batched
    (docs/probe.md, "Choices"); NaN where the Gram matrix is 0 (callers mask that)."""
    size = ev.shape[-1]
    ev = ev.clamp_min(0.0)
    ev_max = ev.amax(-1, keepdim=True)
    floor = ev_max * max(size * EPS64, SINGULAR_REL**2)
    sigma = torch.where(ev > floor, ev.sqrt(), torch.zeros_like(ev))
    total = sigma.sum(-1, keepdim=True)
    p = sigma / total.clamp_min(torch.finfo(F64).tiny)
    return torch.exp(-torch.special.xlogy(p, p).sum(-1))


def token_quantities(dot: Callable[[str, str], Tensor], metrics: Sequence[str], parallel: bool, has_mid: bool,
                     has_attn: bool, has_mlp: bool) -> tuple[list[str], Tensor, Tensor]:
    """Every token quantity of one layer from the float64 dot products ``dot(site1, site2)`` ``[batch, pos]`` of its
    sites' vectors (per-token Grams): (names, values ``[q, batch, pos]``, valid mask); docs/probe.md, "Metrics"."""
    names: list[str] = []
    values: list[Tensor] = []
    valid: list[Tensor] = []
    everywhere = None

    def put(q: str, v: Tensor, ok: Tensor | None) -> None:
        nonlocal everywhere
        if ok is None:
            if everywhere is None:
                everywhere = torch.ones_like(v, dtype=torch.bool)
            ok = everywhere
        names.append(q)
        values.append(v)
        valid.append(ok)

    xx = dot("resid_pre", "resid_pre")
    nx = xx.sqrt()
    ok_x = nx > EPS_NORM
    nxc = nx.clamp_min(EPS_NORM)
    if "resid_norm" in metrics:
        put("resid_norm_pre", nx, None)
        if has_mid:
            put("resid_norm_mid", dot("resid_mid", "resid_mid").sqrt(), None)
        put("resid_norm_post", dot("resid_post", "resid_post").sqrt(), None)
    if has_attn:
        xa, aa = dot("resid_pre", "attn_out"), dot("attn_out", "attn_out")
        ua = xa / nxc  # <u, a>
        npa = (aa - ua * ua).clamp_min(0.0).sqrt()  # ||P_u a||
        if "radial_coef" in metrics:
            na = aa.sqrt()
            put("radial_coef_attn", ua / na.clamp_min(EPS_NORM), ok_x & (na > EPS_NORM))
        if "tangential_speed" in metrics:
            put("tangential_speed_attn", npa / nxc, ok_x)
        if "tangent_alignment" in metrics:
            xz, az, zz = dot("resid_pre", "resid_post"), dot("attn_out", "resid_post"), \
                dot("resid_post", "resid_post")
            udx = (xz - xx) / nxc
            npdx = (zz - 2 * xz + xx - udx * udx).clamp_min(0.0).sqrt()
            cos = (az - xa - ua * udx) / (npa.clamp_min(EPS_NORM) * npdx.clamp_min(EPS_NORM))
            put("tangent_alignment", cos, ok_x & (npa > EPS_NORM) & (npdx > EPS_NORM))
    if has_mlp:
        f = "resid_pre" if parallel else "resid_mid"
        ff, fphi, pp = dot(f, f), dot(f, "mlp_out"), dot("mlp_out", "mlp_out")
        nf = ff.sqrt()
        nfc = nf.clamp_min(EPS_NORM)
        ok_f = nf > EPS_NORM
        if "radial_coef" in metrics:
            nphi = pp.sqrt()
            put("radial_coef_ffn", fphi / (nfc * nphi.clamp_min(EPS_NORM)), ok_f & (nphi > EPS_NORM))
        if "tangential_speed" in metrics:
            wphi = fphi / nfc
            put("tangential_speed_ffn", (pp - wphi * wphi).clamp_min(0.0).sqrt() / nfc, ok_f)
    if not values:
        return names, xx.new_zeros((0, *xx.shape)), torch.zeros((0, *xx.shape), dtype=torch.bool)
    return names, torch.stack(values), torch.stack(valid)


def gram_sets(sets: list[Tensor], cols: bool = False) -> Tensor:
    """Gram matrices ``T T^T`` (with ``cols``, ``T^T T``) of every ``[b, n, d]`` tensor in ``sets``, stacked set-major
    ``[len(sets) * b, size, size]``: numpy's ``dsyrk`` on a CPU in float64 (docs/probe.md, "Cost"), else torch."""
    b, n, d = sets[0].shape
    size = d if cols else n
    t0 = sets[0]
    if t0.device.type != "cpu" or t0.dtype != F64 or t0.requires_grad or not all(t.is_contiguous() for t in sets):
        return torch.cat([t.mT @ t if cols else t @ t.mT for t in sets])
    H = torch.empty(len(sets) * b, size, size, dtype=F64)
    out = H.numpy()
    for i, t in enumerate(sets):
        a = t.detach().numpy()
        at = a.transpose(0, 2, 1)
        np.matmul(*((at, a) if cols else (a, at)), out=out[i * b:(i + 1) * b])
    return H


# the threads of in_parts (started on first use); ONE_PASS_SPLIT: kept tokens x d_model of a layer from which
# one_pass splits it over them (smaller: torch's OpenMP workers, spinning after the forward's last op, slow the split)
ONE_PASS_SPLIT = 1 << 20
POOL = concurrent.futures.ThreadPoolExecutor(max(1, usable_cores() - 1), "tl_steering-part")


def parts_for(device: torch.device) -> int:
    """How many parts :func:`in_parts` should run at once: torch's intra-op threads (at most the usable cores) for
    work on a CPU, else 1 (the decision of every caller that runs its kernels one thread per part)."""
    return min(torch.get_num_threads(), usable_cores()) if device.type == "cpu" else 1


def in_parts(fn: Callable[[int, int], Any], n: int, parts: int) -> list[Any]:
    """``[fn(0, n)]``, or ``fn`` of ``k = min(parts, n)`` consecutive ranges of ``range(n)`` (sizes within one, the
    larger first), all but the first on :data:`POOL`'s threads while this thread runs the first; every one finished
    when this returns, also when one raises."""
    k = min(int(parts), n)
    if k < 2:
        return [fn(0, n)]
    cuts = [-(-n * i // k) for i in range(k + 1)]
    futs = [POOL.submit(torch.no_grad()(fn), a, b) for a, b in zip(cuts[1:-1], cuts[2:])]  # grad mode is per thread
    try:
        first = fn(0, cuts[1])
    finally:
        concurrent.futures.wait(futs)
    return [first, *(f.result() for f in futs)]


def one_pass_runs(arrays: list[Tensor]) -> bool:
    """Whether :func:`one_pass` takes these activations: all on a CPU."""
    return all(a.device.type == "cpu" for a in arrays)


def one_pass(arrays: dict[str, Tensor], groups: list[list[str]], todo: list[str], pos: Tensor, n_parts: int
             ) -> tuple[Callable[[str, str], Tensor], bool, list[Tensor] | None]:
    """(``dot(site1, site2)`` ``[batch, pos]``, whether all are finite, the sums of :func:`diversity` for the sets
    ``todo``) of the activations ``arrays`` ``[batch, n_pos, d]`` at positions ``pos``: the dot products within each
    group of sites and the unit-vector sums, in float64 in one read of each activation (numba kernel, token ranges
    split over ``n_parts`` threads; docs/probe.md, "Cost")."""
    from .fused import site_dots  # numba: imported, and compiled or read from its disk cache, on first use

    dtype = F64 if any(a.dtype == F64 for a in arrays.values()) else torch.float32  # float16/bfloat16: exact in it
    names, acts = tuple(arrays), tuple(a.to(dtype).contiguous().numpy() for a in arrays.values())
    group_sites, rows, norm_of, r_of = _pair_tables(names, tuple(map(tuple, groups)), tuple(todo))
    b, d, n = acts[0].shape[0], acts[0].shape[2], pos.numel()
    dots, at = np.empty((int(rows.max()) + 1, b, n)), np.ascontiguousarray(pos)
    n_parts = n_parts if b * n * d >= ONE_PASS_SPLIT else 1  # below it, one part is faster (docs/probe.md)

    def part(t0: int, t1: int) -> tuple[np.ndarray, np.ndarray]:
        totals, counts = np.zeros((b, len(todo), d)), np.zeros((b, len(todo)))
        site_dots(acts, at, group_sites, rows, norm_of, EPS_NORM, t0, t1, dots, totals, counts)
        return totals, counts

    parts = in_parts(part, b * n, n_parts)
    finite, sums = math.isfinite(float(dots.sum())), None
    if todo and finite:  # set-major [len(todo) * batch], as diversity_sums
        total, cnt = sum(p[0] for p in parts), torch.from_numpy(sum(p[1] for p in parts).T.ravel())
        sums = [torch.from_numpy(np.einsum("bjd,bjd->jb", total, total).ravel()), cnt, *[torch.zeros_like(cnt)] * 2]
    return (lambda s1, s2, D=torch.from_numpy(dots): D[r_of[s1, s2]]), finite, sums


@functools.cache  # a handful of layouts per model
def _pair_tables(names: tuple[str, ...], groups: tuple[tuple[str, ...], ...], todo: tuple[str, ...]) -> tuple:
    """:func:`one_pass`'s kernel tables: the groups' site indices, the rows of their pairs, ``(site, row)`` of each
    set of ``todo``, and ``{(site1, site2): row}``."""
    r_of: dict[tuple[str, str], int] = {}
    group_sites, rows = np.zeros((len(groups), 3), dtype=np.int64), np.full((len(groups), 6), -1, dtype=np.int64)
    for g, sites in enumerate(groups):
        if not 1 <= len(sites) <= 3:
            raise ValueError(f"one_pass takes groups of 1-3 sites, got {sites}")
        group_sites[g] = [names.index(s) for s in (*sites, sites[0], sites[0])[:3]]
        for c, (i, j) in enumerate(itertools.combinations_with_replacement(range(3), 2)):  # the kernel's order
            if j < len(sites):
                new = r_of.get((sites[j], sites[i]), int(rows.max()) + 1)
                rows[g, c] = r_of.setdefault((sites[i], sites[j]), new)
    r_of.update({(s2, s1): r for (s1, s2), r in list(r_of.items())})
    norm_of = np.array([(names.index(s), r_of[s, s]) for s in todo], dtype=np.int64).reshape(-1, 2)
    return group_sites, rows, norm_of, r_of


def _inverse_norms(nt: Tensor) -> tuple[Tensor, Tensor]:
    """(1 / norm where the norm exceeds ``EPS_NORM``, else 0; that validity mask): scaling a row by it gives its
    unit direction, or a zero row that no diversity sum sees."""
    ok = nt > EPS_NORM
    return torch.where(ok, 1.0 / nt.clamp_min(EPS_NORM), torch.zeros_like(nt)), ok


def diversity_sums(sets: list[Tensor], sq: list[Tensor], spectrum: bool, gram: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(||sum_j u_j||^2, valid-row count, effective rank, participation ratio; 0 where not asked) of each sequence of
    each ``[batch, n, d]`` set (``sq``: squared row norms), set-major ``[len(sets) * batch]``: the part of
    :func:`diversity` that runs on each part of a batch, from the smaller Gram matrix of each sequence (``||U U^T||_F
    = ||U^T U||_F``); on a CPU without the spectra, :func:`one_pass` takes ``sum_j u_j`` instead."""
    n, d = sets[0].shape[-2:]
    if n <= d:
        H = gram_sets(sets)  # [sets*batch, n, n]: the raw Gram; its diagonal gives the norms it is scaled by
        inv, ok = _inverse_norms(torch.diagonal(H, dim1=-2, dim2=-1).clamp_min(0.0).sqrt())
        Gu = H.mul_(inv[:, :, None]).mul_(inv[:, None, :])  # Gram of the unit rows (zero rows for masked ones)
        ss = Gu.sum((-1, -2))  # ||sum_j u_j||^2
    else:  # long sequences: the d x d Gram is the smaller one
        b = sets[0].shape[0]
        inv, ok = _inverse_norms(torch.cat(sq).clamp_min(0.0).sqrt())
        U = sets[0].new_empty(len(sets) * b, n, d)
        for i, t in enumerate(sets):
            torch.mul(t, inv[i * b:(i + 1) * b, :, None], out=U[i * b:(i + 1) * b])
        total = U.sum(-2)
        ss = (total * total).sum(-1)
        Gu = gram_sets([U], cols=True)
    trace = torch.diagonal(Gu, dim1=-2, dim2=-1).sum(-1)
    f2 = (Gu * Gu).sum((-1, -2))  # ||G||_F^2
    pr = trace * trace / f2.clamp_min(torch.finfo(F64).tiny)
    erank = erank_from_eigvalsh(torch.linalg.eigvalsh(Gu, UPLO="L")) if spectrum else torch.zeros_like(ss)
    return ss, ok.sum(-1).to(F64), erank, pr


def diversity(sets: list[Tensor], spectrum: bool = True, gram: bool | None = None, sq: list[Tensor] | None = None,
              sums: Sequence[Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Per sequence (pairwise cosine, resultant length, effective rank with ``spectrum``, participation ratio with
    ``gram``, default ``spectrum``; else 0 and invalid) of each ``[batch, n, d]`` set (``sq``: squared row norms or
    None; ``sums``: their :func:`diversity_sums`, taken already): values and validity masks ``[len(sets), 4, batch]``
    (docs/probe.md, "Cost")."""
    gram = spectrum if gram is None else gram
    B, n_sets = sets[0].shape[0], len(sets)
    if sums is None:
        sums = diversity_sums(sets, [(t * t).sum(-1) for t in sets] if sq is None else sq, spectrum, gram)
    ss, cnt, erank, pr = sums
    pair = (ss - cnt) / (cnt * (cnt - 1)).clamp_min(1.0)
    res = ss.clamp_min(0.0).sqrt() / cnt.clamp_min(1.0)
    values = torch.stack([pair, res, erank, pr]).view(4, n_sets, B).transpose(0, 1)
    valid = torch.stack([cnt >= 2, cnt >= 1, (cnt >= 1) & spectrum, (cnt >= 1) & gram]).view(4, n_sets, B)
    return values, valid.transpose(0, 1)


class Accumulator:
    """Running sums, counts and masked counts: ``[n_quantities, n_layers, n_bins]`` (token metrics) and
    ``[n_quantities, n_layers]`` (per-sequence metrics); their size does not grow with the forwards."""

    def __init__(self, token_q: list[str], seq_q: list[str], n_layers: int, n_bins: int,
                 device: torch.device):
        self.tq = {q: i for i, q in enumerate(token_q)}
        self.sq = {q: i for i, q in enumerate(seq_q)}
        self.t_sum = torch.zeros(len(token_q), n_layers, n_bins, dtype=F64, device=device)
        self.t_cnt = torch.zeros(len(token_q), n_layers, n_bins, dtype=torch.int64, device=device)
        self.t_msk = torch.zeros_like(self.t_cnt)
        self.s_sum = torch.zeros(len(seq_q), n_layers, dtype=F64, device=device)
        self.s_cnt = torch.zeros(len(seq_q), n_layers, dtype=torch.int64, device=device)
        self.s_msk = torch.zeros_like(self.s_cnt)

    def _rows(self, names: list[str], token: bool) -> Tensor:
        """Accumulator rows of ``names`` (an index tensor)."""
        return torch.tensor([(self.tq if token else self.sq)[q] for q in names], device=self.t_sum.device)

    def add(self, token: bool, rows: Tensor, names: list[str], values: Tensor, valid: Tensor,
            bins: Tensor | None = None) -> None:
        """Add ``values`` ``[q, layers, batch, pos]`` (per-sequence ones: ``[q, layers, batch]``) where ``valid`` (the
        others count as masked) to the sums of ``names`` at the accumulator rows ``rows`` ``[layers]`` (each any number
        of times), per position bin ``bins`` ``[pos]`` (None: one bin)."""
        sums = (self.t_sum, self.t_cnt, self.t_msk) if token else (self.s_sum, self.s_cnt, self.s_msk)
        at, c = (self._rows(names, token)[:, None], rows.to(self.t_sum.device)[None, :]), valid.sum(2)
        for tgt, src in zip(sums, (torch.where(valid, values, 0.0).sum(2), c, valid.shape[2] - c)):
            src = src.to(tgt.dtype)  # [q, layers(, pos)]
            if token:  # per position bin: [q, layers, bins]
                src = src.sum(-1, True) if bins is None else \
                    src.new_zeros(*src.shape[:2], tgt.shape[-1]).index_add_(2, bins, src)
            tgt.index_put_(at, src, accumulate=True)
