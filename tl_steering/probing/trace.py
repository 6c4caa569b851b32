"""The streaming geometry probe, ``with tl_steering.probe(model, metrics=[...]) as trace:``: per-layer residual
geometry accumulated in float64 during ordinary forwards, no activation kept (specification: docs/probe.md)."""

import collections
import contextlib
import functools
import math
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import validation
from ..backends import adapt
from ..backends.lifecycle import (add_hook_last, conversion_records, drop_identity_conversions, hook_guard,
                                  refuse_meta_inputs)
from ..backends.ownership import hooks_among, named_hook_points
from ..errors import InputError, NonFiniteError
from .kernels import (DIVERSITY_STATS, F64, SLOT_ORDER, Accumulator, diversity, diversity_sums,
                      in_parts, one_pass, one_pass_runs, parts_for, token_quantities)
from .result import ALL_QUANTITIES, DEFAULT_METRICS, METRICS, QUANTITIES, SEQUENCE_METRICS, SITES3, TOKEN_METRICS, ProbeResult
from .._util.threads import single_threaded
from ..stats import position_bin_edges, position_bin_index

_SITE_OF = {"pre": "resid_pre", "mid": "resid_mid", "post": "resid_post"}
_Pending = collections.namedtuple("_Pending", "key batch row st dot sums n_sets div_from")  # a layer for _flush


def _sites_needed(metrics: Sequence[str]) -> set[str]:
    need: set[str] = {"resid_pre", "resid_post"}  # resid_post also triggers the layer's update
    for m in metrics:
        if m in ("resid_norm", "diversity", "effective_rank", "participation_ratio"):
            need |= {"resid_pre", "resid_mid", "resid_post"}
        elif m in ("radial_coef", "tangential_speed"):
            need |= {"resid_pre", "attn_out", "ffn_input", "mlp_out"}
        elif m == "tangent_alignment":
            need |= {"resid_pre", "attn_out", "resid_post"}
    return need


class ProbeTrace:
    """A live probe (see :func:`probe`): a context manager that accumulates while it is entered (possibly several
    times); :meth:`result` reads the numbers at any time, also inside the block."""

    def __init__(self, model: Any, metrics: Sequence[str] | str | None = None,
                 layers: Sequence[int] | int | None = None, exclude_positions: Sequence[int] = (0,),
                 position_bins: bool = False, corpus: str | None = None):
        self.ad = adapt(model)
        self.model = self.ad.model
        metrics = DEFAULT_METRICS if metrics is None else METRICS if metrics == "all" else metrics
        metrics = validation.as_choices(metrics, "probe metric", METRICS)
        self.metrics = [m for m in METRICS if m in metrics]
        self.layers = self.ad.layers(layers)
        self.exclude_positions = validation.as_positions(exclude_positions, "exclude_positions")
        self.position_bins = validation.as_bool(position_bins, "position_bins")
        self.corpus = corpus
        n_ctx = int(getattr(self.ad.cfg, "n_ctx", 0) or 2048)
        self.bin_edges = torch.tensor(position_bin_edges(n_ctx) if self.position_bins else [0, n_ctx])
        n_bins = len(self.bin_edges) - 1
        token_q = [q for m in self.metrics if m in TOKEN_METRICS for q in QUANTITIES[m]]
        seq_q = [q for m in self.metrics if m in SEQUENCE_METRICS for q in QUANTITIES[m]]
        self._acc = Accumulator(token_q, seq_q, len(self.layers), n_bins, self.ad.device)
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        self._sites = _sites_needed(self.metrics)
        self.n_tokens = 0
        self.n_sequences = 0
        self.n_forwards = 0
        self._longest = 0  # the longest window seen, and the most positions one left after exclude_positions
        self._most_kept = 0
        self._user_hooks: set[str] = set()
        self._interventions: set[str] = set()
        self._pos_cache: dict[tuple[int, str], tuple[Tensor | slice | None, Tensor | None, Tensor]] = {}
        self._stack: contextlib.ExitStack | None = None
        self._entered = False
        self._carry: dict[str, Any] | None = None
        self._pending: list[_Pending] = []  # the layers not summed yet
        self._spectrum, self._gram = "effective_rank" in self.metrics, "participation_ratio" in self.metrics
        self._buf: Tensor | None = None  # the float64 copies of a layer's sites where the one-pass kernel does not run
        # the per-sequence statistics asked for (rows of the diversity kernel's output)
        asked = {q.rsplit("_", 1)[0] for m in self.metrics if m in SEQUENCE_METRICS for q in QUANTITIES[m]}
        self._div_stats = [i for i, stat in enumerate(DIVERSITY_STATS) if stat in asked]
        self._div_names = {mid: [f"{DIVERSITY_STATS[i]}_{w}" for w in SITES3 if w != "mid" or mid
                                 for i in self._div_stats] for mid in (False, True)}
        hook_dict = self.model.hook_dict  # one snapshot: a bridge rebuilds this dict on every access
        self._points = named_hook_points(self.model, hook_dict)  # the hooks seen during forwards: provenance
        self._conversions = conversion_records(self._points)
        self._sites_of = {layer: self._find_sites(layer, hook_dict) for layer in self.layers}
        slot_sites = {s_ for layer in self.layers for s_, _ in self._sites_of[layer]}
        self._slots = {s_: i for i, s_ in enumerate(s_ for s_ in SLOT_ORDER if s_ in slot_sites)}
        self._last_layer = max(self.layers)

    # -- hooks -------------------------------------------------------------------------------------------
    def _buffer(self, st: dict[str, Any], idx: Tensor | slice | None) -> Tensor:
        """Float64 copies of the kept positions ``idx`` of the layer's sites in ``st``, in the reused buffer
        ``[n_slots, batch, kept_pos, d_model]`` (the path without the one-pass kernel; docs/probe.md, "Cost")."""
        for site, i in self._slots.items():
            src = st[site].detach() if site in st else None
            if src is not None:
                src = src if idx is None else src[..., idx, :] if isinstance(idx, slice) else src.index_select(-2, idx)
                shape = (len(self._slots), *src.shape)
                if self._buf is None or tuple(self._buf.shape) != shape or self._buf.device != src.device:
                    self._buf = torch.empty(shape, dtype=F64, device=src.device)
                self._buf[i].copy_(src)
        assert self._buf is not None
        return self._buf

    def _positions(self, n_pos: int, device: torch.device) -> tuple[Tensor | slice | None, Tensor | None, Tensor]:
        """(kept positions: None for all, a slice when contiguous, else an index; bin of each kept one, None
        without ``position_bins``; the kept positions as a CPU int64 tensor)."""
        key = (n_pos, str(device))
        if key not in self._pos_cache:
            keep = torch.ones(n_pos, dtype=torch.bool)
            keep[[p for p in self.exclude_positions if -n_pos <= p < n_pos]] = False
            pos = torch.arange(n_pos)[keep]
            idx: Tensor | slice | None
            if bool(keep.all()):
                idx = None
            elif pos.numel() and int(pos[-1] - pos[0]) + 1 == pos.numel():
                idx = slice(int(pos[0]), int(pos[-1]) + 1)
            else:
                idx = pos.to(device)
            bins = position_bin_index(pos).clamp_max(len(self.bin_edges) - 2).to(device) if self.position_bins else None
            self._pos_cache[key] = (idx, bins, pos)
        return self._pos_cache[key]

    def _find_sites(self, layer: int, hook_dict: Mapping[str, Any]) -> list[tuple[str, str]]:
        """(site, hook name) pairs this probe reads at ``layer``, in forward order."""
        ad = self.ad
        sites = set(self._sites)
        if ad.is_parallel(layer):
            sites.discard("resid_mid")
        if "ffn_input" in sites:
            sites.discard("ffn_input")
            sites.add(ad.ffn_input_site(layer))
        return [(site, ad.hook_name(layer, site, hook_dict))
                for site in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post") if site in sites]

    def _count_forward(self, act: Tensor) -> None:
        self.n_forwards += 1
        self.n_sequences += int(act.shape[0])
        n = int(act.shape[1])
        self.n_tokens += int(act.shape[0]) * n
        users, interventions = hooks_among(self._points)  # e.g. run_with_hooks(..., ffn_component(...))
        self._user_hooks.update(users)
        self._interventions.update(interventions)
        if n > self._longest:
            self._longest = n
            self._most_kept = n - len({p % n for p in self.exclude_positions if -n <= p < n})

    def _check_positions(self) -> None:
        """Refuse windows that left no position for statistics (every number would be NaN); warn when the
        per-sequence metrics had fewer than two positions in every window."""
        excl = list(self.exclude_positions)
        if self._most_kept == 0:
            raise InputError(
                f"the probe saw {self.n_forwards} forward pass(es) but no position was left for statistics: the "
                f"longest window has {self._longest} position(s) and exclude_positions={excl} excludes them all "
                "(position 0, the attention sink, is excluded by default). Statistics need at least 2 positions "
                "per window once position 0 is excluded (one per token metric, two for the per-sequence ones): "
                "use longer windows (e.g. ts.text_tokens(model, length=16)), or exclude_positions=() to include "
                "position 0.")
        seq = [m for m in self.metrics if m in SEQUENCE_METRICS]
        if seq and self._most_kept < 2:
            warnings.warn(
                f"probe: {', '.join(seq)} need at least 2 positions per window after exclude_positions={excl}, "
                f"and the longest window left {self._most_kept}: those metrics are NaN. Use windows of length >= "
                f"{self._longest - self._most_kept + 2}.", UserWarning, stacklevel=3)

    def _make_hooks(self, layer: int) -> list[tuple[str, Callable]]:
        state: dict[str, Any] = {}
        first = layer == self.layers[0]
        hooks: list[tuple[str, Callable]] = []
        for site, name in self._sites_of[layer]:
            if site == "resid_pre":
                def fn(act: Tensor, hook: Any, state: dict = state, first: bool = first,
                       layer: int = layer) -> None:
                    state.clear()
                    carry, self._carry = self._carry, None
                    # the previous layer's resid_post, untouched: its diversity was measured
                    if carry is not None and carry["layer"] == layer and carry["src"] is act \
                            and _version(act) is not None and _version(act) == carry["version"]:
                        state["_div_from"] = carry["st"]
                    state["resid_pre"], state["versions"] = act, {"resid_pre": _version(act)}
                    state["bins"] = self._positions(act.shape[-2], act.device)[1]
                    if first:
                        self._count_forward(act)
            elif site == "resid_post":
                def fn(act: Tensor, hook: Any, state: dict = state, layer: int = layer) -> None:
                    try:
                        if "resid_pre" in state:
                            state["resid_post"] = act
                            st = dict(state)
                            self._update(layer, st)
                            if layer + 1 in self._row:
                                self._carry = {"layer": layer + 1, "src": act, "version": _version(act), "st": st}
                            elif layer == self._last_layer:  # done with this forward (docs/probe.md, "Cost")
                                self._buf = None
                                drop_identity_conversions(self._conversions)
                    finally:
                        state.clear()
            else:
                def fn(act: Tensor, hook: Any, state: dict = state, site: str = site) -> None:
                    if "resid_pre" in state:
                        state[site] = act
                        state["versions"][site] = _version(act)
            hooks.append((name, fn))
        return hooks

    def __enter__(self) -> "ProbeTrace":
        if self._entered:
            raise InputError("this probe is already active; use one `with` block at a time")
        # interrupt-safe: the guard only reads the model on entry; everything added after it (TL hooks, the
        # pre-hooks that keep ours last) is undone by closing the stack, also when an interrupt lands here
        stack = contextlib.ExitStack()
        try:
            # the user's hooks are read during the forwards (_count_forward), not recorded on entry
            stack.enter_context(hook_guard(self.model, "tl_steering.probe", record_hooks=False))
            self._stack = stack
            refuse_meta_inputs(self.model)  # the user's forwards: a clear error for meta tokens (removed on exit)
            hook_dict = self.model.hook_dict
            for layer in self.layers:
                for name, fn in self._make_hooks(layer):
                    add_hook_last(self.model, name, fn, hook_dict)
            self._entered = True
            return self
        except BaseException:
            self._detach(*sys.exc_info())
            stack.close()
            raise

    def _detach(self, *exc: Any) -> None:
        self._carry = self._buf = None
        try:
            drop_identity_conversions(self._conversions)
            self._flush()  # the layers of a forward that stopped before its last one
        finally:
            stack, self._stack = self._stack, None
            if stack is not None:
                stack.__exit__(*exc)

    def __exit__(self, *exc: Any) -> None:
        self._entered = False
        self._detach(*exc)

    # No __del__ safety net: a Ctrl-C landing anywhere, also on entry to __exit__, is handled by the guard's
    # SIGINT handler (backends/interrupts.py); a finalizer would restore a stale snapshot inside a later call.

    def add_cache(self, cache: Mapping[str, Tensor]) -> "ProbeTrace":
        """Add the activations of a finished forward (``model.run_with_cache(tokens)[1]``) to the sums, with the same
        arithmetic as the hooks."""
        for layer in self.layers:
            sites = self._sites_of[layer]
            missing = [name for _, name in sites if name not in cache]
            if missing:
                raise InputError(f"the cache lacks {missing[:3]}{'...' if len(missing) > 3 else ''}; cache "
                                 "those hook points (names_filter) or run the probe during the forward")
            st: dict[str, Any] = {site: cache[name] for site, name in sites}
            st["versions"] = {}
            pre = cache[sites[0][1]]
            st["bins"] = self._positions(pre.shape[-2], pre.device)[1]
            if layer == self.layers[0]:
                self._count_forward(pre)
            self._update(layer, st)
        if not self._entered:
            self._buf = None
        return self

    # -- metrics -----------------------------------------------------------------------------------------
    def _update(self, layer: int, st: dict[str, Any]) -> None:
        """All metrics of one layer from its activations, at its resid_post (docs/probe.md, "Cost")."""
        changed = [s_ for s_, v in st["versions"].items() if _version(st[s_]) != v]
        if changed:
            raise InputError(f"probe: the {', '.join(changed)} activation of layer {layer} was changed in place after "
                             "its hook ran (by a hook of yours or the model); the probe reads a layer's activations at "
                             "its resid_post. Return an edited copy from such a hook (act + delta) instead.")
        n_parts = parts_for(st["resid_pre"].device)  # before the cap: torch's threads, one part each
        with single_threaded(blas=self._spectrum or self._gram):
            self._update_layer(layer, st, n_parts)  # only the spectra use numpy's BLAS

    def _update_layer(self, layer: int, st: dict[str, Any], n_parts: int) -> None:
        div_from = st.pop("_div_from", {})  # the previous layer's state: its resid_post diversity
        parallel, pre = self.ad.is_parallel(layer), st["resid_pre"]
        idx, _, pos = self._positions(pre.shape[-2], pre.device)
        if pos.numel() == 0:  # every position excluded
            return
        has_mid = not parallel and "resid_mid" in st
        # every dot product a token needs, within two groups of sites: (x, a, z) and (f, phi), f the FFN input
        groups = [["resid_pre", *(["attn_out"] if "attn_out" in st else []), "resid_post"]]
        if "mlp_out" in st:
            groups.append(["resid_mid" if has_mid else "resid_pre", "mlp_out"])
        elif has_mid:
            groups.append(["resid_mid"])
        which = [w for w in ("pre", "mid", "post") if w != "mid" or has_mid]
        todo = [_SITE_OF[w] for w in which if not (w == "pre" and div_from)] if self._div_stats else []
        arrays = {s_: st[s_].detach() for s_ in dict.fromkeys([*(s_ for g in groups for s_ in g), *todo])}
        if not (self._spectrum or self._gram) and one_pass_runs(list(arrays.values())):
            dot, finite, sums = one_pass(arrays, groups, todo, pos, n_parts)
        else:
            dot, finite, sums = self._in_float64(self._buffer(st, idx), groups, todo, n_parts)
        key = (parallel, has_mid, "attn_out" in st, "mlp_out" in st, id(st["bins"]), *pre.shape[:-1], pre.device)
        for s_ in SLOT_ORDER:  # the activations are read: the carried state keeps only the diversity
            st.pop(s_, None)
        if not finite:  # a NaN/Inf in a site shows in its squared norm: name layer and site
            sites = dict.fromkeys(s_ for g in groups for s_ in g)
            bad = [s_ for s_ in sites if not bool(torch.isfinite(dot(s_, s_)).all())]
            raise NonFiniteError(
                f"probe: non-finite activation at layer {layer}, {', '.join(bad) or 'unknown site'} (NaN or Inf "
                "in the residual stream). Check the model weights (a NaN weight spreads from its layer on) and any "
                "hooks of yours on that point; in float16 try float32 or bfloat16.")
        # the rest is batched over the layers of a forward: at its last layer (or on exit, or before a result)
        self._pending.append(_Pending(key, pre.shape[0], self._row[layer], st, dot, sums if todo else None, len(todo),
                                      div_from))
        if layer == self._last_layer:
            self._flush()

    def _flush(self) -> None:
        """The metrics of the pending layers from their dot products and sums, batched per layout and batch size;
        the per-sequence ones in forward order (a resid_pre's can be the previous layer's resid_post's)."""
        pending, self._pending = self._pending, []
        for key in dict.fromkeys(p.key for p in pending) if self._acc.tq else ():
            items = [p for p in pending if p.key == key]
            dot = functools.cache(lambda s1, s2, dots=[p.dot for p in items]: torch.stack([d(s1, s2) for d in dots]))
            names, values, valid = token_quantities(dot, self.metrics, *key[:4])
            if names:
                self._acc.add(True, torch.tensor([p.row for p in items]), names, values, valid, items[0].st["bins"])
        seq = [p for p in pending if p.sums is not None]
        for b in dict.fromkeys(p.batch for p in seq):
            items = [p for p in seq if p.batch == b]
            values, valid = diversity([torch.empty(b)] * sum(p.n_sets for p in items), self._spectrum, self._gram,
                                      sums=[torch.cat([p.sums[i] for p in items]) for i in range(4)])
            out: dict[bool, list] = {}
            for p, v, ok in zip(items, *(x.split([p.n_sets for p in items]) for x in (values, valid))):
                if p.div_from:  # resid_pre is the previous layer's resid_post: the statistics are its ones
                    v, ok = (torch.cat([a, x]) for a, x in zip(p.div_from["_div_post"], (v, ok)))
                p.st["_div_post"] = (v[-1:], ok[-1:])
                out.setdefault(p.key[1], []).append((p.row, *(x[:, self._div_stats].flatten(0, 1) for x in (v, ok))))
            for has_mid, (rows, vs, oks) in ((m, zip(*r)) for m, r in out.items()):
                self._acc.add(False, torch.tensor(rows), self._div_names[has_mid], torch.stack(vs, 1),
                              torch.stack(oks, 1))

    def _in_float64(self, buf: Tensor, groups: list[list[str]], todo: list[str], n_parts: int
                    ) -> tuple[Callable[[str, str], Tensor], bool, list[Tensor] | None]:
        """(dot products ``dot(site1, site2)`` ``[batch, pos]``, whether all are finite, the per-sequence sums of
        :func:`diversity`) from the float64 copies ``buf`` in torch: the path without :func:`one_pass`."""
        k, views, at = self._slots, [], []
        for sites in groups:  # each group's slots are evenly spaced in the buffer: a strided view, no copy
            slots = sorted(k[s_] for s_ in sites)
            step = slots[1] - slots[0] if len(slots) > 1 else 1
            assert slots == list(range(slots[0], slots[-1] + 1, step)), slots
            views.append(buf[slots[0]:slots[-1] + 1:step].permute(1, 2, 0, 3))  # [batch, pos, m, d]
            at.append({s_: (k[s_] - slots[0]) // step for s_ in sites})

        def dot(grams: list[Tensor], s1: str, s2: str) -> Tensor:
            g = next(i for i, pos in enumerate(at) if s1 in pos and s2 in pos)
            return grams[g][..., at[g][s1], at[g][s2]]

        def part(a: int, b: int) -> tuple[list[Tensor], Any, bool]:  # rows a:b; docs/probe.md "Cost"
            grams = [V[a:b] @ V[a:b].mT for V in views]  # each [rows, positions, m, m]
            finite = math.isfinite(float(sum(G.diagonal(dim1=-2, dim2=-1).sum() for G in grams)))
            if not todo or not finite:
                return grams, None, finite
            return grams, diversity_sums([buf[k[s_]][a:b] for s_ in todo], [dot(grams, s_, s_) for s_ in todo],
                                         self._spectrum, self._gram), True

        parts = in_parts(part, buf.shape[1], n_parts)
        grams = [torch.cat(g) for g in zip(*(p[0] for p in parts))] if len(parts) > 1 else parts[0][0]
        finite = all(p[2] for p in parts)
        # row parts, each set-major [len(todo) * rows]: side by side per set
        sums = [torch.cat([p[1][i].view(len(todo), -1) for p in parts], 1).flatten() for i in range(4)] \
            if todo and finite else None
        return (lambda s1, s2: dot(grams, s1, s2)), finite, sums

    # -- reading -----------------------------------------------------------------------------------------
    def state_nbytes(self) -> int:
        """Bytes held by the accumulators (constant: it does not grow with the number of forwards)."""
        a = self._acc
        return sum(t.numel() * t.element_size() for t in (a.t_sum, a.t_cnt, a.t_msk, a.s_sum, a.s_cnt, a.s_msk))

    def result(self) -> "ProbeResult":
        """The numbers accumulated so far, as a :class:`ProbeResult` (a snapshot; the probe keeps running);
        :class:`InputError` when no forward pass ran inside the probe."""
        if self.n_forwards == 0:
            raise InputError("the probe saw no forward pass: run the model inside the with-block, e.g. "
                             "`with ts.probe(model) as trace: model(tokens)`, or feed a cache with "
                             "trace.add_cache(cache)")
        self._check_positions()
        self._flush()
        acc = self._acc
        rows = [(q, acc.t_sum[i], acc.t_cnt[i], acc.t_msk[i]) for q, i in acc.tq.items()] + [
            (q, acc.s_sum[i, :, None], acc.s_cnt[i, :, None], acc.s_msk[i, :, None]) for q, i in acc.sq.items()]
        sums, counts, masked = ({q: r[k].cpu().clone() for q, *r in rows} for k in range(3))
        prov = self.ad.provenance(None, corpus=self.corpus or "unknown (pass corpus= to probe)",
                                  metrics=list(self.metrics), layers=list(self.layers),
                                  exclude_positions=list(self.exclude_positions),
                                  position_bins=self.position_bins, n_forwards=self.n_forwards,
                                  user_hooks=sorted(self._user_hooks),
                                  interventions=sorted(self._interventions))
        prov.n_sequences, prov.n_tokens = self.n_sequences, self.n_tokens
        return ProbeResult(provenance=prov, metrics=list(self.metrics), layers=list(self.layers),
                           parallel=[self.ad.is_parallel(lay) for lay in self.layers],
                           exclude_positions=list(self.exclude_positions), position_bins=self.position_bins,
                           bin_edges=self.bin_edges.clone(), n_tokens=self.n_tokens,
                           n_sequences=self.n_sequences, n_forwards=self.n_forwards,
                           sums=sums, counts=counts, masked=masked)


def _version(t: Tensor) -> int | None:
    """The in-place version counter of a tensor (None for inference tensors, which have none)."""
    try:
        return int(t._version)
    except (RuntimeError, AttributeError):
        return None


def probe(model: Any, metrics: Sequence[str] | str | None = None, layers: Sequence[int] | int | None = None,
          exclude_positions: Sequence[int] = (0,), position_bins: bool = False,
          corpus: str | None = None) -> ProbeTrace:
    """Streaming geometry probe: ``with probe(model) as trace: model(tokens)``; then ``trace.result()``. Returns a
    :class:`ProbeTrace`; arguments, definitions and cost: docs/probe.md."""
    return ProbeTrace(model, metrics=metrics, layers=layers, exclude_positions=exclude_positions,
                      position_bins=position_bins, corpus=corpus)


__all__ = ["ALL_QUANTITIES", "METRICS", "QUANTITIES", "SITES3", "ProbeResult", "ProbeTrace", "probe"]
