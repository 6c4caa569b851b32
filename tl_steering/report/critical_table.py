"""The critical-point section's per-layer table: points, labels and the claim's reading for every layer covered."""

import html
from typing import Any


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def critical_layer_table(result: Any) -> str:
    """HTML table of a :class:`~tl_steering.critical.CriticalPointsResult`: per layer the rows (starts), converged
    rows, distinct points, label counts, Morse index histogram, seconds and the "mostly saddles" verdict with its
    exact interval; then the pooled verdict and what the counts are a sample of."""
    claim = result.claim()
    head = ("<tr><th>layer</th><th>finder</th><th>rows</th><th>converged</th><th>points</th><th>attractor</th>"
            "<th>repeller</th><th>saddle</th><th>rotational</th><th>Morse index: count</th><th>s</th>"
            "<th>saddle fraction [95% CI]</th><th>verdict</th></tr>")
    rows = []
    for i, (layer, r) in enumerate(zip(result.layers, result.results)):
        c = r.counts()
        v = claim["per_layer"][int(layer)]
        hist = ", ".join(f"{k}: {n}" for k, n in sorted(r.morse_histogram().items())) or "-"
        frac = "-" if not v["n"] else f"{v['fraction']:.2f} [{v['ci_low']:.2f}, {v['ci_high']:.2f}]"
        rows.append(
            f"<tr><td>{int(layer)}</td><td>{_e(r.method)}</td><td>{r.n_starts}</td><td>{r.n_converged}</td>"
            f"<td>{r.n_points}</td><td>{c['attractor']}</td><td>{c['repeller']}</td><td>{c['saddle']}</td>"
            f"<td>{c['rotational']}</td><td>{_e(hist)}</td><td>{float(result.seconds[i]):.1f}</td>"
            f"<td>{frac}</td><td>{_e(v['verdict'])}</td></tr>")
    p = claim["pooled"]
    pooled = ("-" if not p["n"] else
              f"{p['saddles']} saddles of {p['n']} points = {p['fraction']:.2f} [{p['ci_low']:.2f}, {p['ci_high']:.2f}]")
    return ("<table class='critical-layers'>" + head + "".join(rows) + "</table>"
            f"<p>Pooled: {_e(pooled)}: <b>{_e(p['verdict'])}</b>. The counts are a sample of {_e(claim['sample'])}.</p>")


__all__ = ["critical_layer_table"]
