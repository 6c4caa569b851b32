"""Streaming probes (tl_steering.probe, module tl_steering.probing.trace) against the same metrics computed afterwards from a full cache.

The reference (:func:`reference_metrics`) restates each metric with tl_steering.geometry on the cached
float64 activations of a TransformerLens ``run_with_cache`` over all the batches at once; the probe sees the
batches one forward at a time. Agreement: <= 1e-6 relative (float64 sums in a different order, and the
effective rank through a Gram matrix instead of an SVD), plus, for the norms of tangential parts, an absolute
floor that bounds the probe's rounding (:func:`_tangent_floor`). tests/integration/test_probe_smollm2.py reuses
the reference on SmolLM2.
"""

import math
import time

import pytest
import torch
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from tests.helpers import assert_no_hooks
from tl_steering import geometry as geo
from tl_steering.backends import adapt, backend_of
from tl_steering.errors import InputError
from tl_steering.hooks import ffn_component
from tl_steering.probing.trace import ALL_QUANTITIES, QUANTITIES, ProbeResult, probe
from tl_steering.stats import position_bin_edges

F64 = torch.float64
TOL = 1e-6


def cache_for(model, tokens, fwd_hooks=()):
    """float64 activations of every probed site from TL's own run_with_cache (hooks applied first)."""
    ad = adapt(model)
    names = set(ad.identity_names())
    with model.hooks(fwd_hooks=list(fwd_hooks)):
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    assert_no_hooks(model)
    return {n: cache[n].to(F64) for n in names}


def _tangent_floor(v: Tensor, x: Tensor) -> Tensor:
    """Per row, a bound on the probe's rounding error in ||P_x v|| / ||x||.

    The probe takes the norm of a tangential part from float64 Gram entries, ||P_x v||^2 = <v,v> - <x^,v>^2, to
    stay one pass over the activations. Each entry is a float64 sum of d products, so the difference carries an
    absolute error of at most ~ d * eps64 * ||v||^2 (the classic dot-product bound), and its square root one of
    sqrt(d * eps64) * ||v||: a zero tangential part (a radial-only write, zero up to the float32 rounding of the
    write itself) comes back as anything in [0, that bound]. The geometry reference projects explicitly and is
    accurate there, so two rounding-noise values are compared against this floor, not relative to each other.
    """
    d = v.shape[-1]
    return 4.0 * math.sqrt(d * torch.finfo(F64).eps) * geo.norm(v) / geo.norm(x).clamp_min(geo.EPS_NORM)


def _bin_of(p: int) -> int:
    return 0 if p == 0 else int(math.floor(math.log2(p))) + 1


def reference_metrics(model, cache, layers=None, exclude_positions=(0,), bins=False):
    """Every probe quantity from a cache, one layer at a time: {quantity: [layer] (or [layer, bin])}.

    Rows whose statistic is undefined (zero-norm vectors; sequences with < 2 valid rows for the pairwise
    cosine) are dropped from the means; zero-norm rows are dropped from the diversity sets.
    """
    ad = adapt(model)
    layers = ad.layers(layers)
    some = cache[ad.hook_name(0, "resid_pre")]
    n_pos = some.shape[1]
    keep = torch.ones(n_pos, dtype=torch.bool)
    for p in exclude_positions:
        keep[p] = False
    pos = torch.arange(n_pos)[keep]
    n_bins = len(position_bin_edges(int(ad.cfg.n_ctx))) - 1 if bins else 1
    pos_bin = torch.tensor([_bin_of(int(p)) for p in pos]) if bins else torch.zeros(len(pos), dtype=torch.long)
    out = {q: torch.full((len(layers), n_bins) if bins else (len(layers),), math.nan, dtype=F64)
           for q in ALL_QUANTITIES}
    # the absolute rounding floor of each quantity the probe takes from a Gram difference (assert_matches)
    floors = {q: torch.zeros((len(layers), n_bins) if bins else (len(layers),), dtype=F64)
              for q in ("tangential_speed_attn", "tangential_speed_ffn", "tangent_alignment")}
    eps = geo.EPS_NORM

    def mean(q, i, v, ok, into=out):
        if bins:
            for b in range(n_bins):
                sel = ok & (pos_bin == b)[None]
                if sel.any():
                    into[q][i, b] = v[sel].mean()
        elif ok.any():
            into[q][i] = v[ok].mean()

    for i, layer in enumerate(layers):
        g = lambda s: cache[ad.hook_name(layer, s)][:, keep]  # noqa: E731
        x, a, phi, z = g("resid_pre"), g("attn_out"), g("mlp_out"), g("resid_post")
        y = None if ad.is_parallel(layer) else g("resid_mid")
        f = x if y is None else y
        nx, nf, na, nphi = (geo.norm(t) for t in (x, f, a, phi))
        ones = torch.ones_like(nx, dtype=torch.bool)
        mean("resid_norm_pre", i, nx, ones)
        if y is not None:
            mean("resid_norm_mid", i, geo.norm(y), ones)
        mean("resid_norm_post", i, geo.norm(z), ones)
        mean("radial_coef_attn", i, geo.cosine_radial(a, x), (nx > eps) & (na > eps))
        mean("radial_coef_ffn", i, geo.cosine_radial(phi, f), (nf > eps) & (nphi > eps))
        pa, pdx = geo.tangential_part(a, x), geo.tangential_part(z - x, x)
        ok_align = (nx > eps) & (geo.norm(pa) > eps) & (geo.norm(pdx) > eps)
        mean("tangent_alignment", i, geo.tangent_alignment(a, z - x, x), ok_align)
        mean("tangential_speed_attn", i, geo.tangential_speed(a, x), nx > eps)
        mean("tangential_speed_ffn", i, geo.tangential_speed(phi, f), nf > eps)
        mean("tangential_speed_attn", i, _tangent_floor(a, x), nx > eps, into=floors)
        mean("tangential_speed_ffn", i, _tangent_floor(phi, f), nf > eps, into=floors)
        # a cosine of two tangential parts: each part's rounding relative to its own norm
        rel = (_tangent_floor(a, x) / geo.norm(pa).clamp_min(eps)
               + _tangent_floor(z - x, x) / geo.norm(pdx).clamp_min(eps))
        mean("tangent_alignment", i, rel, ok_align, into=floors)
        for which, t in (("pre", x), ("mid", y), ("post", z)):
            if t is None or bins:
                continue
            valid = geo.norm(t) > eps
            stats = {"pairwise_cosine": geo.mean_pairwise_cosine(t, valid),
                     "resultant_length": geo.mean_resultant_length(t, valid),
                     "effective_rank": geo.effective_rank(t, valid),
                     "participation_ratio": geo.participation_ratio(t, valid)}
            for k, v in stats.items():
                ok = ~torch.isnan(v)
                if ok.any():
                    out[f"{k}_{which}"][i] = v[ok].mean()
    out["rounding_floor"] = floors
    return out


def assert_matches(res: ProbeResult, ref: dict, tol: float = TOL, bins: bool = False) -> None:
    for q in res.quantities:
        got = res.get_bins(q) if bins else res.get(q)
        want = ref[q]
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (q, got, want)
        fin = ~torch.isnan(want)
        floor = ref.get("rounding_floor", {}).get(q)
        floor = torch.zeros_like(want) if floor is None else floor
        # relative to |want| (a 1e-3 floor for values near zero), plus the quantity's own rounding floor
        bound = tol * want.abs().clamp_min(1e-3) + floor
        err = float(((got[fin] - want[fin]).abs() / bound[fin]).max()) if fin.any() else 0.0
        assert err <= 1.0, (q, err, got, want, floor)


# ----------------------------------------------------------------------------------------------------------


def test_probe_equals_cache_route(tiny, tiny_tokens):
    """Several forwards inside one probe give the numbers of a full run_with_cache over all batches."""
    with probe(tiny, metrics="all") as trace:
        tiny(tiny_tokens[:1])
        tiny.run_with_hooks(tiny_tokens[1:])
    assert_no_hooks(tiny)
    res = trace.result()
    assert res.n_forwards == 2 and res.n_sequences == 3 and res.n_tokens == tiny_tokens.numel()
    assert set(res.quantities) == set(ALL_QUANTITIES)
    # the reference caches the same two forwards (batch shapes 1 and 2): one forward of all 3 rows may round
    # differently in float32 under another kernel path (CONTRIBUTING.md, "Kernel paths and tolerances"), and this
    # test is about the probe's float64 accumulation over forwards, compared at float64 precision
    parts = [cache_for(tiny, tiny_tokens[:1]), cache_for(tiny, tiny_tokens[1:])]
    ref = reference_metrics(tiny, {n: torch.cat([c[n] for c in parts]) for n in parts[0]})
    assert_matches(res, ref)
    ad = adapt(tiny)
    for q in ("resid_norm_mid", "pairwise_cosine_mid", "effective_rank_mid"):
        # parallel blocks have no resid_mid: NaN, counted nothing, masked nothing
        par = torch.tensor([ad.is_parallel(lay) for lay in res.layers])
        assert torch.isnan(res.get(q)[par]).all() and not torch.isnan(res.get(q)[~par]).any()
        assert int(res.counts[q].sum(-1)[par].sum()) == 0 and int(res.n_masked(q).sum()) == 0
    # counts: every kept token once per layer; diversity: one row per sequence
    assert torch.equal(res.counts["tangent_alignment"].sum(-1), torch.full((ad.n_layers,), 3 * 15))
    assert torch.equal(res.counts["effective_rank_pre"].sum(-1), torch.full((ad.n_layers,), 3))


def test_merge_equals_one_big_batch(tiny, tiny_tokens):
    with probe(tiny, position_bins=True) as big:
        tiny(tiny_tokens)
    with probe(tiny, position_bins=True) as parts:
        for b in range(tiny_tokens.shape[0]):
            tiny(tiny_tokens[b:b + 1])
    a, b = big.result(), parts.result()
    for q in a.quantities:
        assert torch.equal(a.counts[q], b.counts[q]) and torch.equal(a.masked[q], b.masked[q])
        assert torch.allclose(a.sums[q], b.sums[q], rtol=1e-12, atol=1e-12), q
    # re-entering a probe keeps adding; result.merge adds two results
    with parts:
        tiny(tiny_tokens)
    again = parts.result()
    merged = b.merge(a)
    for q in a.quantities:
        assert torch.allclose(again.sums[q], merged.sums[q], rtol=1e-12, atol=1e-12)
    assert again.n_tokens == merged.n_tokens == 2 * tiny_tokens.numel()


def test_position_bins(tiny, tiny_tokens):
    with probe(tiny, metrics=["tangent_alignment", "radial_coef", "resid_norm", "tangential_speed"],
               position_bins=True) as trace:
        tiny(tiny_tokens)
    res = trace.result()
    ref = reference_metrics(tiny, cache_for(tiny, tiny_tokens), bins=True)
    assert_matches(res, ref, bins=True)
    assert res.bin_edges.tolist()[:6] == [0, 1, 2, 4, 8, 16]
    assert torch.isnan(res.get_bins("tangent_alignment")[:, 0]).all()  # position 0 excluded
    fig = res.plot_bins("radial_coef_ffn")
    assert fig.data[0].type == "heatmap"


def test_metric_subset_layers_and_positions(tiny, tiny_tokens):
    ad = adapt(tiny)
    with probe(tiny, metrics="diversity", layers=[ad.n_layers - 1], exclude_positions=(0, -1)) as trace:
        tiny(tiny_tokens)
    res = trace.result()
    assert res.layers == [ad.n_layers - 1] and res.metrics == ["diversity"]
    assert set(res.quantities) == set(QUANTITIES["diversity"])
    ref = reference_metrics(tiny, cache_for(tiny, tiny_tokens), layers=[ad.n_layers - 1],
                            exclude_positions=(0, tiny_tokens.shape[1] - 1))
    assert_matches(res, ref)
    with pytest.raises(InputError, match="was not probed"):
        res.get("tangent_alignment")
    with pytest.raises(InputError, match="several quantities"):
        res.get("diversity")
    with pytest.raises(InputError, match="unknown probe metric"):
        probe(tiny, metrics=["curvature"])


def test_probe_sees_steering_hooks(tiny, tiny_tokens):
    """Steering hooks added inside the probe (run_with_hooks) are applied before the probe reads a point."""
    hooks = ffn_component(tiny, keep="radial")
    with probe(tiny) as trace:
        tiny.run_with_hooks(tiny_tokens, fwd_hooks=hooks)
    assert_no_hooks(tiny)
    res = trace.result()
    assert_matches(res, reference_metrics(tiny, cache_for(tiny, tiny_tokens, hooks)))
    # radial-only FFN: no tangential FFN motion, |cos(FFN input, phi)| = 1
    assert float(res.get("tangential_speed_ffn").abs().max()) < 1e-5
    # and inside model.hooks: same numbers
    with tiny.hooks(fwd_hooks=hooks), probe(tiny) as trace2:
        tiny(tiny_tokens)
    assert_no_hooks(tiny)
    assert_matches(trace2.result(), reference_metrics(tiny, cache_for(tiny, tiny_tokens, hooks)))


def test_zero_rows_masked_and_counted(tiny, tiny_tokens):
    """A zero FFN write at layer 0 and a zeroed residual row at layer 1: masked, counted, never NaN."""
    ad = adapt(tiny)

    def zero_row(act, hook):
        act = act.clone()
        act[0, 5] = 0.0
        return act

    hooks = ffn_component(tiny, keep="zero", layers=[0]) + [(ad.hook_name(1, "resid_pre"), zero_row)]
    with tiny.hooks(fwd_hooks=hooks), probe(tiny) as trace:
        tiny(tiny_tokens)
    res = trace.result()
    n_rows = tiny_tokens.shape[0] * (tiny_tokens.shape[1] - 1)
    assert torch.isnan(res.get("radial_coef_ffn")[0]) and int(res.n_masked("radial_coef_ffn")[0]) == n_rows
    assert float(res.get("tangential_speed_ffn")[0]) == 0.0
    assert int(res.n_masked("radial_coef_attn")[1]) == 1 and int(res.n_masked("tangent_alignment")[1]) >= 1
    assert int(res.n_masked("tangential_speed_attn")[1]) == 1
    for q in res.quantities:
        assert not torch.isnan(res.sums[q]).any(), q
    assert_matches(res, reference_metrics(tiny, cache_for(tiny, tiny_tokens, hooks)))


def test_hooks_removed_after_exception(tiny, tiny_tokens):
    user_hook = lambda act, hook: None  # noqa: E731
    name = adapt(tiny).hook_name(0, "resid_pre")
    tiny.add_hook(name, user_hook)
    try:
        with pytest.raises(ZeroDivisionError):
            with probe(tiny) as trace:
                tiny(tiny_tokens)
                1 / 0
        # the user's own hook survives, the probe's are gone
        hp = tiny.hook_dict[name]
        assert len(hp.fwd_hooks) == 1 and len(hp._forward_hooks) == 1
        assert all(len(h._forward_pre_hooks) == 0 for h in tiny.modules() if isinstance(h, HookPoint))
    finally:
        tiny.reset_hooks(including_permanent=True)
    assert_no_hooks(tiny)
    assert trace.result().n_forwards == 1
    # an exception inside the forward (a hook of the user raising) as well
    bad = [(name, lambda act, hook: (_ for _ in ()).throw(RuntimeError("boom")))]
    with pytest.raises(RuntimeError, match="boom"):
        with probe(tiny):
            tiny.run_with_hooks(tiny_tokens, fwd_hooks=bad)
    assert_no_hooks(tiny)


def test_state_size_independent_of_forwards(tiny, tiny_tokens):
    with probe(tiny, position_bins=True) as trace:
        tiny(tiny_tokens)
        size = trace.state_nbytes()
        for _ in range(3):
            tiny(tiny_tokens)
        assert trace.state_nbytes() == size
    assert trace.result().n_forwards == 4


@pytest.mark.parametrize("n_stopped", [1, 2])
def test_forward_stopped_midway_then_another(tiny, tiny_tokens, n_stopped):
    """The layers of a forward that a hook stopped midway count once, summed with a later forward of another batch
    size or the same one (the probe sums a forward's layers at its last one, a layer's rows then twice in one
    batch): equal to the two runs probed apart, merged."""
    ad = adapt(tiny)
    stop = [(ad.hook_name(ad.n_layers - 1, "resid_pre"), lambda act, hook: (_ for _ in ()).throw(KeyError("stop")))]

    def stopped_then_full(trace):
        with pytest.raises(KeyError):
            tiny.run_with_hooks(tiny_tokens[:n_stopped], fwd_hooks=stop)
        if trace is not None:
            tiny(tiny_tokens[1:])

    with probe(tiny, metrics="all", position_bins=True) as both:
        stopped_then_full(both)
    with probe(tiny, metrics="all", position_bins=True) as first:
        stopped_then_full(None)
    with probe(tiny, metrics="all", position_bins=True) as second:
        tiny(tiny_tokens[1:])
    got, want = both.result(), first.result().merge(second.result())
    assert got.counts["tangent_alignment"].sum(-1).tolist() == [(n_stopped + 2) * 15] * (ad.n_layers - 1) + [2 * 15]
    for q in want.quantities:
        assert torch.equal(got.counts[q], want.counts[q]) and torch.equal(got.masked[q], want.masked[q]), q
        assert torch.allclose(got.sums[q], want.sums[q], rtol=1e-12, atol=1e-12), q


def test_no_activation_buffer_held_between_forwards(tiny, tiny_tokens):
    """No activation and no float64 buffer outlive a forward: the buffer of the path without the one-pass kernel
    (every metric) lives only while the probed layers run, released at the last probed layer's resid_post, before
    the forward's own peak (the logits); the default metrics never make one; a later forward gives the same sums as
    one run alone."""
    ad = adapt(tiny)
    last = ad.n_layers - 1
    for metrics in (None, "all"):
        for layers in (None, [0], [0, last]):
            seen = []
            with probe(tiny, layers=layers, metrics=metrics) as trace:
                tiny.run_with_hooks(tiny_tokens, fwd_hooks=[(ad.hook_name(last, "resid_pre"),
                                                             lambda act, hook: seen.append(trace._buf is not None))])
                assert trace._buf is None and trace._carry is None
                tiny(tiny_tokens)
                assert trace._buf is None and trace._carry is None
            assert seen == [metrics == "all" and layers != [0]]
            alone = probe(tiny, layers=layers, metrics=metrics)
            with alone:
                tiny(tiny_tokens)
            two, one = trace.result(), alone.result()
            for q in two.quantities:
                assert torch.allclose(two.get(q), one.get(q), rtol=1e-12, atol=1e-12, equal_nan=True), q


def test_one_pass_kernel_equals_float64_copies(tiny, tiny_tokens, monkeypatch):
    """On a CPU the default metrics come from the one-pass kernel over the float32 activations: the same numbers as
    the float64 copies in torch (the path on a GPU and for the spectra) up to the order of each sum, the same counts;
    a hook that edits a site's activation in place after the probe read it is refused, naming layer and site, and
    leaves no hook."""
    import tl_steering.probing.trace as trace_mod

    runs = {}
    for one in (True, False):
        monkeypatch.setattr(trace_mod, "one_pass_runs", lambda arrays, one=one: one)
        with probe(tiny, position_bins=True) as trace:
            tiny(tiny_tokens)
            tiny(tiny_tokens[:1])
        runs[one] = trace.result()
    a, b = runs.values()
    assert a.quantities == b.quantities and a.n_forwards == b.n_forwards == 2
    for q in a.quantities:
        assert torch.equal(a.counts[q], b.counts[q]) and torch.equal(a.masked[q], b.masked[q]), q
        # float32 products are exact in float64: only the order of each d-term sum differs (~d * eps relative)
        assert torch.allclose(a.sums[q], b.sums[q], rtol=1e-12, atol=1e-12, equal_nan=True), q
    monkeypatch.undo()
    ad, held = adapt(tiny), {}
    edits = [(ad.hook_name(1, "attn_out"), lambda act, hook: held.update(a=act)),
             (ad.hook_name(1, "resid_post"), lambda act, hook: held["a"].mul_(2.0))]
    with pytest.raises(InputError, match="attn_out activation of layer 1 was changed in place"):
        with probe(tiny):
            tiny.run_with_hooks(tiny_tokens, fwd_hooks=edits)
    assert_no_hooks(tiny)


def test_result_roundtrip_and_plot(tiny, tiny_tokens, tmp_path):
    with probe(tiny, position_bins=True, corpus="random ids") as trace:
        tiny(tiny_tokens)
    res = trace.result()
    assert res.provenance.corpus == "random ids" and res.provenance.n_tokens == tiny_tokens.numel()
    assert res.provenance.extra["metrics"] == res.metrics
    for path in (tmp_path / "p.json", tmp_path / "p.safetensors"):
        back = ProbeResult.load(res.save(path))
        for q in res.quantities:
            assert torch.equal(back.get(q), res.get(q), ) or torch.allclose(back.get(q), res.get(q), equal_nan=True)
        assert back.layers == res.layers and back.position_bins
    assert torch.equal(res.tangent_alignment, res.get("tangent_alignment"))
    assert res.summary()["n_tokens"] == tiny_tokens.numel()
    fig = res.plot()
    assert len(fig.data) == len(res.quantities)


def test_add_cache_equals_hooks(tiny, tiny_tokens):
    """The cache route (ProbeTrace.add_cache on a finished run_with_cache) gives the hooks' numbers."""
    with probe(tiny) as live:
        tiny(tiny_tokens)
    offline = probe(tiny).add_cache(cache_for(tiny, tiny_tokens))
    a, b = live.result(), offline.result()
    assert b.n_tokens == a.n_tokens and b.n_forwards == 1
    for q in a.quantities:
        assert torch.equal(a.counts[q], b.counts[q])
        assert torch.allclose(a.sums[q], b.sums[q], rtol=1e-12, atol=1e-12), q
    with pytest.raises(InputError, match="cache lacks"):
        probe(tiny).add_cache({})


def test_resid_post_reused_as_next_resid_pre(tiny, tiny_tokens, monkeypatch):
    """Layer l+1's resid_pre is layer l's resid_post: its diversity statistics are computed once."""
    import tl_steering.probing.trace as trace_mod

    ad = adapt(tiny)
    n_sets, real = [], trace_mod.diversity

    def counted(sets, *args, **kw):
        n_sets.append(len(sets))
        return real(sets, *args, **kw)

    monkeypatch.setattr(trace_mod, "diversity", counted)
    with probe(tiny, metrics="diversity") as trace:
        tiny(tiny_tokens)
    per_layer = 2 if ad.is_parallel(0) else 3
    assert sum(n_sets) == per_layer * ad.n_layers - (ad.n_layers - 1)
    assert_matches(trace.result(), reference_metrics(tiny, cache_for(tiny, tiny_tokens)))


@pytest.mark.parametrize("in_place", [False, True])
def test_steered_resid_pre_is_measured_not_the_previous_resid_post(tiny, tiny_tokens, in_place):
    """A layer whose resid_pre is the previous resid_post untouched takes that float64 copy from the buffer;
    a hook that edits resid_pre (a new tensor, or the same tensor in place) makes the probe copy the edited
    activation: every metric of the probed layers equals the cache route on the steered forward."""
    ad = adapt(tiny)
    layer = min(1, ad.n_layers - 1)
    name = ad.hook_name(layer, "resid_pre")

    def steer(act, hook):
        if in_place:
            act[:, 2:] *= 1.7
            return act
        return act * torch.linspace(0.5, 2.0, act.shape[-1], dtype=act.dtype)

    hooks = [(name, steer)]
    with probe(tiny) as trace:
        tiny.run_with_hooks(tiny_tokens, fwd_hooks=hooks)
    assert_no_hooks(tiny)
    res = trace.result()
    later = list(range(layer, ad.n_layers))
    # an in-place edit of resid_pre also edits the cached tensor of the previous resid_post (the same tensor),
    # so only the layers from the steered one on are compared
    ref = reference_metrics(tiny, cache_for(tiny, tiny_tokens, hooks), layers=later)
    for q in res.quantities:
        got, want = res.get(q)[layer:], ref[q]
        assert torch.equal(torch.isnan(got), torch.isnan(want)), q
        fin = ~torch.isnan(want)
        assert torch.allclose(got[fin], want[fin], rtol=TOL, atol=1e-9), (q, got, want)
    unsteered = probe(tiny)
    with unsteered:
        tiny(tiny_tokens)
    assert not torch.allclose(unsteered.result().get("resid_norm_pre")[layer:], res.get("resid_norm_pre")[layer:])


@pytest.mark.parametrize("metric", ["resid_norm", "radial_coef", "tangent_alignment", "tangential_speed",
                                    "diversity", "effective_rank", "participation_ratio"])
def test_single_metric(tiny, tiny_tokens, metric):
    """Each metric alone hooks what it needs and gives the numbers of the full probe."""
    with probe(tiny, metrics=metric) as trace:
        tiny(tiny_tokens)
    res = trace.result()
    if metric == "resid_norm" and adapt(tiny).is_parallel(0):
        assert set(res.quantities) == set(QUANTITIES[metric])  # no resid_mid: same names, other order
    else:
        assert res.quantities == list(QUANTITIES[metric])
    assert_matches(res, reference_metrics(tiny, cache_for(tiny, tiny_tokens)))


@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_diversity_kernel_equals_full_gram_formula(n):
    """probing.kernels.diversity (||sum u||^2 read off each sequence's Gram matrix) against the plain formula on
    the full Gram matrix of the unit rows, per sequence: pairwise cosine, resultant length, effective rank and
    participation ratio to 1e-12 relative; zero rows masked; n > d takes the d x d branch; the participation ratio
    alone (gram=True, spectrum=False) solves no eigenproblem and gives the same; squared norms passed in (the
    probe's, from its per-token Grams) give the numbers of the ones the kernel takes itself."""
    from tl_steering.probing.kernels import diversity, erank_from_eigvalsh

    gen = torch.Generator().manual_seed(n)
    d = 16
    sets = [torch.randn(3, n, d, generator=gen, dtype=F64) + torch.randn(d, generator=gen, dtype=F64)
            for _ in range(2)]
    sets[1][1, 0] = 0.0  # a zero row: left out of its sequence's statistics
    values, valid = diversity(sets)
    given, given_ok = diversity(sets, sq=[torch.linalg.vector_norm(t, dim=-1) ** 2 for t in sets])
    assert torch.equal(given_ok, valid) and torch.allclose(given, values, rtol=1e-12, atol=1e-14)
    cheap, cheap_ok = diversity(sets, spectrum=False)  # no Gram matrix: sum_j u_j directly
    assert torch.equal(cheap_ok[:, :2], valid[:, :2]) and not cheap_ok[:, 2:].any()
    assert torch.allclose(cheap[:, :2][valid[:, :2]], values[:, :2][valid[:, :2]], rtol=1e-12, atol=1e-14)
    pr, pr_ok = diversity(sets, spectrum=False, gram=True)  # the Gram matrix, no eigvalsh
    assert torch.equal(pr_ok[:, [0, 1, 3]], valid[:, [0, 1, 3]]) and not pr_ok[:, 2].any()
    assert torch.equal(pr[:, 3], values[:, 3])
    for s, X in enumerate(sets):
        for b in range(3):
            U = X[b][torch.linalg.vector_norm(X[b], dim=-1) > geo.EPS_NORM]
            c = U.shape[0]
            assert valid[s, :, b].tolist() == [c >= 2, c >= 1, c >= 1, c >= 1]
            if c == 0:
                continue
            U = U / geo.norm(U)[:, None]
            G = U @ U.T
            expect = [(G.sum() - c) / max(c * (c - 1), 1), G.sum().sqrt() / c,
                      erank_from_eigvalsh(torch.linalg.eigvalsh(G if c <= d else U.T @ U)),
                      geo.participation_ratio(U)]
            for k in range(4):
                if valid[s, k, b]:
                    assert float(values[s, k, b]) == pytest.approx(float(expect[k]), rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("batch", [1, 2, 5])
@pytest.mark.parametrize("n_parts", [2, 3])
def test_kernels_split_over_threads_equal_one_thread(batch, n_parts, monkeypatch):
    """diversity_sums on row parts of a batch, one per thread (the probe's path when torch has >= 2 threads), put
    side by side per set, and one_pass on parts of the token grid give the numbers of the whole batch on one
    thread; in_parts cuts consecutive ranges (sizes within one, the larger first) and waits for every part."""
    from tl_steering.probing import kernels
    from tl_steering.probing.kernels import diversity_sums, in_parts, one_pass

    monkeypatch.setattr(kernels, "ONE_PASS_SPLIT", 0)  # these layers are tiny: split them anyway

    assert in_parts(lambda a, b: (a, b), 5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert in_parts(lambda a, b: (a, b), 2, 3) == [(0, 1), (1, 2)] and in_parts(lambda a, b: (a, b), 7, 1) == [(0, 7)]
    done = []

    def slow_or_bad(a, b):
        if a == 0:
            raise ValueError("part 0")
        time.sleep(0.05)
        done.append(a)

    with pytest.raises(ValueError, match="part 0"):
        in_parts(slow_or_bad, 6, 3)
    assert sorted(done) == [2, 4]  # the other parts had finished when the error came out
    gen = torch.Generator().manual_seed(batch)
    for n, d in ((7, 16), (20, 6)):  # n <= d (pos x pos Gram) and n > d (d x d Gram)
        sets = [torch.randn(batch, n, d, generator=gen, dtype=F64) for _ in range(3)]
        sets[0][0, 1] = 0.0
        sq = [(t * t).sum(-1) for t in sets]
        for spectrum in (False, True):  # the direction sums alone, and the Gram route
            whole = diversity_sums(sets, sq, spectrum, spectrum)
            parts = in_parts(lambda a, b: diversity_sums([t[a:b] for t in sets], [q[a:b] for q in sq], spectrum,
                                                         spectrum), batch, n_parts)
            for i, w in enumerate(whole):
                got = torch.cat([p[i].view(3, -1) for p in parts], 1).flatten()
                assert torch.allclose(got, w, rtol=1e-13, atol=0, equal_nan=True), (spectrum, i)
    # the one-pass kernel: float32 activations, kept positions, a zero row; any split of the token grid gives the
    # float64 dot products and the diversity sums of the whole
    acts = {s: torch.randn(batch, 9, 5, generator=gen) for s in ("x", "a", "y")}
    acts["x"][0, 3] = 0.0
    pos = torch.tensor([1, 2, 3, 5, 8])
    ref = {s: t[:, pos].double() for s, t in acts.items()}
    expect = diversity_sums([ref["x"], ref["y"]], [(ref[s] ** 2).sum(-1) for s in ("x", "y")], False, False)
    for k in (1, n_parts):
        for groups in ([["x", "a"], ["y"]], [["x", "a", "y"], ["y", "a"], ["x"]]):  # groups of 1-3, sites shared
            dot, finite, sums = one_pass(acts, groups, ["x", "y"], pos, k)
            assert finite and torch.equal(sums[1], expect[1]) and sums[1][0] == len(pos) - 1
            assert torch.allclose(sums[0], expect[0], rtol=1e-13, atol=1e-13)
            for s1, s2 in {(s1, s2) for g in groups for s1 in g for s2 in g}:
                assert torch.allclose(dot(s1, s2), (ref[s1] * ref[s2]).sum(-1), rtol=1e-14, atol=1e-14), (s1, s2)
    # bfloat16 activations (exact in float32) and a float64 one beside float32 ones: the same float64 products
    low = {"x": acts["x"].bfloat16(), "a": acts["a"].bfloat16(), "y": acts["y"].double()}
    dot, finite, _ = one_pass(low, [["x", "a"], ["y"]], [], pos, n_parts)
    x, a = (low[s][:, pos].double() for s in ("x", "a"))
    assert finite and torch.allclose(dot("x", "a"), (x * a).sum(-1), rtol=1e-14, atol=1e-14)
    assert torch.allclose(dot("y", "y"), (ref["y"] ** 2).sum(-1), rtol=1e-14, atol=1e-14)


def test_one_pass_splits_only_large_layers(monkeypatch):
    """one_pass runs a layer on one part below ONE_PASS_SPLIT kept tokens x d_model (torch's spinning OpenMP workers
    make a split slower there), on the parts asked for from it."""
    from tl_steering.probing import kernels

    asked = []
    monkeypatch.setattr(kernels, "in_parts", lambda fn, n, parts: asked.append(parts) or [fn(0, n)])
    acts = {s: torch.randn(2, 9, 16) for s in ("x", "a")}
    pos = torch.arange(1, 9)
    kernels.one_pass(acts, [["x", "a"]], ["x"], pos, 3)
    monkeypatch.setattr(kernels, "ONE_PASS_SPLIT", 2 * 8 * 16)
    kernels.one_pass(acts, [["x", "a"]], ["x"], pos, 3)
    assert asked == [1, 3]


def test_layer_update_split_over_threads_equals_one_thread(tiny, tiny_tokens, monkeypatch):
    """Each layer's Grams and per-sequence sums taken on two or three parts of the batch, one per thread (the probe's
    path when torch has >= 2 threads), equal those of the whole batch on one thread: every metric, per position
    bin, batches of 1-3 sequences; a non-finite activation on that path still raises, naming its layer and site."""
    import tl_steering.probing.trace as trace_mod
    from tl_steering.errors import NonFiniteError
    from tl_steering.probing import kernels

    monkeypatch.setattr(kernels, "ONE_PASS_SPLIT", 0)  # the tiny model's layers would run on one part
    for metrics in ("all", None):  # None: no spectrum, so one sequence splits its positions
        runs = {}
        for split in (1, 2, 3):
            monkeypatch.setattr(trace_mod, "parts_for", lambda device, s=split: s)
            with probe(tiny, metrics=metrics, position_bins=True) as trace:
                for rows in (slice(0, 1), slice(0, 2), slice(0, 3)):
                    tiny(tiny_tokens[rows])
            runs[split] = trace.result()
        a = runs[1]
        for b in (runs[2], runs[3]):
            assert a.quantities == b.quantities
            for q in a.quantities:
                assert torch.equal(a.counts[q], b.counts[q]) and torch.equal(a.masked[q], b.masked[q]), q
                # the same float64 operations on the same rows, per part: only the order of a few sums may differ
                assert torch.allclose(a.sums[q], b.sums[q], rtol=1e-13, atol=1e-13, equal_nan=True), q
    # the parts follow torch's threads as they are outside the layer update's one-thread cap
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "usable_cores", lambda: 4)
    seen, in_float64 = [], trace_mod.ProbeTrace._in_float64
    monkeypatch.setattr(trace_mod.ProbeTrace, "_in_float64", lambda self, *a: seen.append(a[-1]) or in_float64(self, *a))
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with probe(tiny, metrics="all"):
            tiny(tiny_tokens)
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {3}
    bad = [(adapt(tiny).hook_name(1, "mlp_out"), lambda act, hook: act * float("nan"))]
    with pytest.raises(NonFiniteError, match="layer 1, .*mlp_out"):
        with probe(tiny, metrics="all") as trace:
            tiny.run_with_hooks(tiny_tokens, fwd_hooks=bad)
    assert_no_hooks(tiny)


def test_gram_sets_numpy_route_equals_torch():
    """gram_sets (numpy's symmetric BLAS kernel on CPU float64) gives torch's full Gram matrices T T^T to 1e-12,
    both triangles, and with cols=True T^T T; other dtypes, non-contiguous sets and tensors that require grad take
    the torch route and give the same."""
    from tl_steering.probing.kernels import gram_sets

    gen = torch.Generator().manual_seed(3)
    sets = [torch.randn(3, 9, 20, generator=gen, dtype=F64) + 2.0 for _ in range(2)]
    want = torch.cat([t @ t.mT for t in sets])
    got = gram_sets(sets)
    assert got.shape == (6, 9, 9) and torch.equal(got, got.mT)
    assert torch.allclose(got, want, rtol=1e-13, atol=1e-12)
    strided = [torch.randn(3, 20, 9, generator=gen, dtype=F64).mT for _ in range(2)]
    assert torch.allclose(gram_sets(strided), torch.cat([t @ t.mT for t in strided]), rtol=0, atol=1e-12)
    g32 = gram_sets([t.float() for t in sets])
    assert g32.dtype == torch.float32 and torch.allclose(g32.double(), want, rtol=1e-5, atol=1e-3)
    leaf = sets[0].clone().requires_grad_(True)
    assert torch.allclose(gram_sets([leaf]).detach(), want[:3], rtol=0, atol=1e-12)
    # cols=True: the d x d Gram T^T T (long sequences), on both routes
    want_cols = torch.cat([t.mT @ t for t in sets])
    got_cols = gram_sets(sets, cols=True)
    assert got_cols.shape == (6, 20, 20) and torch.allclose(got_cols, want_cols, rtol=1e-13, atol=1e-11)
    assert torch.allclose(gram_sets(strided, cols=True), torch.cat([t.mT @ t for t in strided]), rtol=0, atol=1e-11)


def test_single_threaded_caps_numpy_blas_and_restores():
    """single_threaded runs torch and numpy's BLAS on one thread inside the block and puts both counts back
    afterwards, also when the block raises (threadpoolctl reads the BLAS's own setting)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from tl_steering._util.threads import single_threaded

    def blas_threads() -> list[int]:
        return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]

    torch_before = torch.get_num_threads()
    with threadpool_limits(limits=2, user_api="blas"):  # the suite runs at OMP_NUM_THREADS=1: start from 2
        torch.set_num_threads(2)
        try:
            before_blas = blas_threads()
            assert before_blas and max(before_blas) == 2, "numpy's BLAS is not visible to threadpoolctl"
            with pytest.raises(RuntimeError, match="inside"):
                with single_threaded():
                    assert torch.get_num_threads() == 1
                    assert blas_threads() == [1] * len(before_blas)
                    raise RuntimeError("inside")
            assert torch.get_num_threads() == 2 and blas_threads() == before_blas
        finally:
            torch.set_num_threads(torch_before)


def _full_probe_then_no_eigvalsh(model, tokens, monkeypatch) -> ProbeResult:
    """The result of a probe with every metric; then ``torch.linalg.eigvalsh`` raises until the test ends."""
    full = probe(model, metrics="all")
    with full:
        model(tokens)

    def no_eig(*a, **k):
        raise AssertionError("eigvalsh called without effective_rank")

    monkeypatch.setattr(torch.linalg, "eigvalsh", no_eig)
    return full.result()


def _assert_alone_gives_the_full_sums(model, tokens, metric: str, full: ProbeResult) -> None:
    """A probe of ``metric`` alone has exactly its quantities, with the full probe's sums and counts."""
    with probe(model, metrics=metric) as trace:
        model(tokens)
    res = trace.result()
    assert res.quantities == list(QUANTITIES[metric])
    for q in res.quantities:
        assert torch.equal(res.sums[q], full.sums[q]) and torch.equal(res.counts[q], full.counts[q]), q


def test_diversity_without_effective_rank_solves_no_eigenproblem(tiny, tiny_tokens, monkeypatch):
    """metrics="diversity" gives the pairwise cosine and resultant length with no Gram matrix and no
    eigenproblem (O(n d) per sequence), equal to the spectral route's numbers; the effective rank alone
    gives what the full probe gives."""
    full_res = _full_probe_then_no_eigvalsh(tiny, tiny_tokens, monkeypatch)
    with probe(tiny, metrics="diversity") as trace:
        tiny(tiny_tokens)
    res = trace.result()
    assert res.metrics == ["diversity"] and not any(q.startswith("effective_rank") for q in res.quantities)
    for q in res.quantities:
        assert torch.allclose(res.get(q), full_res.get(q), rtol=1e-12, atol=1e-14, equal_nan=True), q
    monkeypatch.undo()
    _assert_alone_gives_the_full_sums(tiny, tiny_tokens, "effective_rank", full_res)


def test_result_saved_before_the_effective_rank_split_reads_as_both_metrics():
    """A ProbeResult whose metrics say "diversity" but whose sums hold effective_rank_* (the layout before
    effective_rank became its own metric) lists both metrics and plots both groups."""
    qs = [*QUANTITIES["diversity"], *QUANTITIES["effective_rank"]]
    one = {q: torch.ones(2, 1, dtype=F64) for q in qs}
    cnt = {q: torch.ones(2, 1, dtype=torch.int64) for q in qs}
    res = ProbeResult(metrics=["diversity"], layers=[0, 1], parallel=[False, False], exclude_positions=[0],
                      position_bins=False, bin_edges=torch.tensor([0, 8]), n_tokens=8, n_sequences=1,
                      n_forwards=1, sums=one, counts=cnt, masked={q: torch.zeros_like(c) for q, c in cnt.items()})
    assert res.metrics == ["diversity", "effective_rank"]
    assert res.get("effective_rank_mid").tolist() == [1.0, 1.0]
    assert len(res.plot().data) == len(qs)


def test_participation_ratio_alone_solves_no_eigenproblem(tiny, tiny_tokens, monkeypatch):
    """metrics="participation_ratio" takes each sequence's Gram matrix (tr(G)^2 / ||G||_F^2) and no eigvalsh,
    with the numbers of the full probe (where it shares the Gram matrix with the effective rank)."""
    full_res = _full_probe_then_no_eigvalsh(tiny, tiny_tokens, monkeypatch)
    _assert_alone_gives_the_full_sums(tiny, tiny_tokens, "participation_ratio", full_res)


def test_no_transformerlens_conversion_records_pile_up(tiny, tiny_tokens):
    """A bridge's attention hook points keep a record per tensor they pass to a hook and never drop it (TL 3.9 and
    4.3): about 0.4 kB per hooked attention site and forward, for the life of the model. The probe drops the
    records of unchanged tensors after each forward (and on exit), the adapter's run_with_hooks after its forward;
    a record of a real conversion (a transposed attention pattern) is kept."""
    from tl_steering.backends.lifecycle import conversion_records, drop_identity_conversions, hook_points

    records = conversion_records(hook_points(tiny))
    if not records:
        assert backend_of(tiny) == "hooked", "a bridge without conversion records: the check would be empty"
        return

    def count():
        return sum(len(r) for r in conversion_records(hook_points(tiny)))

    with probe(tiny) as trace:
        for i in range(3):
            tiny(tiny_tokens[i:i + 1])
            assert count() == 0, f"records after forward {i}"
    assert trace.result().n_forwards == 3
    ad = adapt(tiny)
    ad.run_with_hooks(tiny_tokens, [(ad.hook_name(0, "attn_out"), lambda act, hook: None)])
    assert count() == 0
    tiny.run_with_hooks(tiny_tokens, fwd_hooks=[(ad.hook_name(0, "attn_out"), lambda act, hook: None)])
    assert count() >= 1  # TransformerLens's own run_with_hooks (not ours) keeps its record
    records[0][-1] = {"original_shape": (1, 2, 3, 3), "conversion_type": "transpose_1_2", "n_heads": 2}
    drop_identity_conversions(records)
    assert count() == 1 and records[0][-1]["conversion_type"] == "transpose_1_2"
    records[0].pop(-1)


def test_protocol_inside_probe_is_not_a_user_hook(tiny, tiny_tokens):
    """A protocol run inside a probe hooks the model with the package's own (tagged) hooks: the probe neither
    lists them as the user's nor warns, while a user's own hook inside the same block is listed."""
    import warnings

    import tl_steering as ts
    from tl_steering.errors import UserHooksWarning

    ad = adapt(tiny)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with probe(tiny, metrics="resid_norm") as trace:
            ts.angular_deficit(tiny, tiny_tokens, n_bootstrap=2)
            ad.run_with_cache(tiny_tokens, [ad.hook_name(0, "resid_post")])
        res = trace.result()
    assert res.n_forwards >= 2 and res.provenance.user_hooks == []
    assert not [x for x in w if issubclass(x.category, UserHooksWarning)]
    name = ad.hook_name(0, "attn_out")
    with probe(tiny, metrics="resid_norm") as trace:
        tiny.run_with_hooks(tiny_tokens, fwd_hooks=[(name, lambda act, hook: None)])
    with pytest.warns(UserHooksWarning):
        assert name in trace.result().provenance.user_hooks
