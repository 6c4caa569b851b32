"""The critical-point section's per-layer table: points, labels and the claim's reading for every layer covered."""

from typing import Any

from .figures import esc as _e


def tried(r: Any) -> str:
    """What a finder tried on one layer, from its options: the words of a layer with no equilibrium."""
    o = r.options
    if r.method == "landscape":
        shift = [x for x in o.get("shift", []) if x]
        out = ("power iteration of F and -F" + (" with the shifted map" if shift else "")
               + f", {o.get('edge_rows', 0)} edge-tracking rows")
        if o.get("lm_rows"):
            out += ", LM from the starts"
        if o.get("landscape_rows"):
            out += f", {o['landscape_rows']} landscape solves"
        return out
    return f"{r.method} from the starts"


def critical_layer_table(result: Any) -> str:
    """HTML table of a :class:`~tl_steering.critical.CriticalPointsResult`: per layer the rows (starts), converged
    rows, distinct points, label counts, Morse index histogram, seconds, the "mostly saddles" fraction of the
    sample with its exact interval, the census verdict of its random starts; then the pooled fraction, why it does
    not decide the claim, what the counts sample and the Poincaré-Hopf lower bound on the points not found."""
    claim = result.claim().parts
    head = ("<tr><th>layer</th><th>finder</th><th>rows</th><th>converged</th><th>points</th><th>attractor</th>"
            "<th>repeller</th><th>saddle</th><th>rotational</th><th>Morse index: count</th><th>s</th>"
            "<th>saddle fraction [95% CI]</th><th>verdict</th><th>census: saddles / non-saddles at most</th></tr>")
    rows = []
    for i, (layer, r) in enumerate(zip(result.layers, result.results)):
        c = r.counts()
        v, cen = claim["per_layer"][int(layer)], claim["census"][int(layer)]
        hist = ", ".join(f"{k}: {n}" for k, n in sorted(r.morse_histogram().items())) or "-"
        frac = "-" if not v["n"] else f"{v['fraction']:.2f} [{v['ci_low']:.2f}, {v['ci_high']:.2f}]"
        none = (f"no equilibrium found from {r.options.get('n_starts', r.n_starts)} starts ({r.n_starts} rows): "
                f"{tried(r)}")
        rows.append(
            f"<tr><td>{int(layer)}</td><td>{_e(r.method)}</td><td>{r.n_starts}</td><td>{r.n_converged}</td>"
            f"<td>{r.n_points}</td><td>{c['attractor']}</td><td>{c['repeller']}</td><td>{c['saddle']}</td>"
            f"<td>{c['rotational']}</td><td>{_e(hist)}</td><td>{float(result.seconds[i]):.1f}</td>"
            f"<td>{frac}</td><td>{_e(v['verdict'] if r.n_points else none)}</td>"
            f"<td>{cen['saddles_found']} / {cen['non_saddles_high']:.1f}: {_e(cen['verdict'])}</td></tr>")
    p = claim["pooled"]
    pooled = ("-" if not p["n"] else
              f"{p['saddles']} saddles of {p['n']} points = {p['fraction']:.2f} [{p['ci_low']:.2f}, {p['ci_high']:.2f}]")
    miss = claim["parity"]["missing_at_least"]
    parity = ("" if miss is None else f" Poincaré-Hopf parity of the found sets: at least {miss} equilibria not "
              "found (0 does not mean all were found).")
    return ("<table class='critical-layers'>" + head + "".join(rows) + "</table>"
            f"<p>Pooled: {_e(pooled)}: <b>{_e(p['verdict'])}</b> for this sample; it does not decide the claim for "
            f"all equilibria ({_e(claim['why_undecided'])}). The counts are a sample of {_e(claim['sample'])}."
            f"{_e(parity)}</p>" + critical_histogram(result))


def _index_bins(dim: int) -> list[tuple[int, int, str]]:
    """Morse index bins of a d-dimensional field: 0 (attractor), 1, 2, 3..d/2-1, d/2..d-4, d-3, d-2, d-1 (repeller)."""
    if dim < 8:
        return [(k, k, str(k)) for k in range(dim)]
    h = dim // 2
    return [(0, 0, "0"), (1, 1, "1"), (2, 2, "2"), (3, h - 1, f"3-{h - 1}"), (h, dim - 4, f"{h}-{dim - 4}"),
            (dim - 3, dim - 3, str(dim - 3)), (dim - 2, dim - 2, str(dim - 2)), (dim - 1, dim - 1, str(dim - 1))]


def critical_histogram(result: Any) -> str:
    """The pooled Morse index histogram (points per index bin; index = unstable directions of the tangent
    spectrum, 0 = attractor, d - 1 = repeller) and the sentence saying which sample it counts."""
    hist = result.morse_histogram()
    dims = {int(r.dim) for r in result.results if getattr(r, "dim", 0)}
    if not hist or len(dims) != 1:
        return "<p class='muted'>Morse index histogram: no equilibrium.</p>" if not hist else ""
    bins = _index_bins(dims.pop())
    counts = [sum(n for k, n in hist.items() if lo <= k <= hi) for lo, hi, _ in bins]
    s = result.sample()
    starts = "/".join(str(x) for x in s["starts_per_layer"])
    token = "/".join(str(x) for x in s["token_starts_per_layer"])
    sentence = (f"Sample: {s['points']} distinct equilibria over {s['layers']} layer(s), finder "
                f"{', '.join(s['methods'])}, {starts} starts per layer ({token} token directions, the rest random), "
                f"{s['converged_rows']} of {s['rows']} rows converged; {s['note']}.")
    return ("<table class='critical-index'><tr><th>Morse index</th>"
            + "".join(f"<th>{_e(name)}</th>" for _, _, name in bins) + "</tr><tr><td>points</td>"
            + "".join(f"<td>{n}</td>" for n in counts) + "</tr></table>"
            + f"<p class='muted'>{_e(sentence)}</p>")


__all__ = ["critical_histogram", "critical_layer_table", "tried"]
