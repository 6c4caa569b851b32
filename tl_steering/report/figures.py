"""The report's figures: plotly figures built from a :class:`~tl_steering.suite.SuiteResult` (no model), and
their files under ``figures/`` (plotly JSON and standalone HTML sharing one ``plotly.min.js``)."""

import html
from pathlib import Path
from typing import Any

from ..suite import SuiteResult


def esc(x: Any) -> str:
    """``x`` as escaped HTML text: the report's one escape of user-supplied text (model names, corpus, arguments)."""
    return html.escape(str(x), quote=True)


def figures(suite: SuiteResult) -> dict[str, Any]:
    """Every figure of the page, titled by us (user-supplied names escaped); stages not run have none."""
    mn = esc(suite.model.name)
    figs: dict[str, Any] = {}
    d, a, v, c, g, cr, p = (suite.deficit, suite.ablation, suite.diversity, suite.defect, suite.gates,
                             suite.critical, suite.prefix)
    if d is not None:
        figs["deficit_layers"] = d.plot(title=f"Angular deficit per layer (mean {d.mean:.3f}; {mn})")
        figs["deficit_positions"] = d.plot_positions(title=f"Angular deficit by layer and position bin ({mn})")
    if a is not None:
        figs["ablation"] = a.plot(title=f"FFN component ablation, all layers (clean CE {a.clean_loss:.3f}; {mn})")
    if v is not None:
        figs["diversity"] = v.plot(title=f"Direction diversity ({mn})")
    if c is not None:
        figs["defect_scores"] = c.plot(title=f"Sequential-to-parallel defect C_l ({mn})")
    if g is not None:
        figs["gates"] = g.plot(title=f"FFN gates on the low-C plan ({g.method}; {mn})")
    if cr is not None:
        figs["critical_counts"] = cr.plot(title=f"Critical points of the FFN field (saddle fraction "
                                                f"{cr.saddle_fraction():.2f}; {mn})")
    if p is not None:
        figs["prefix"] = p.plot(title=f"Prefix sensitivity (noise at layer {p.perturb_layer}; {mn})")
    pc = suite.plan_choice
    if pc is not None and pc.plan is not None:
        pl = pc.plan
        figs["plan_choice"] = pl.plot(title=f"Loss increase vs parallel layers, every strategy with the {pl.refit} "
                                            f"correction; chosen: {pl.strategy} at k={pl.k} ({mn})")
    if c is not None and c.evaluated:
        figs["defect_curves"] = c.plot_curves(title=f"Loss increase vs layers made parallel ({mn})")
    for key in ("critical", "critical_fixed_point"):
        summ = getattr(suite, key)
        if summ is None:
            continue
        label = f"{summ.results[0].method} finder" if summ.results else "finder"
        if key != "critical":
            figs[f"{key}_counts"] = summ.plot(title=f"Critical points of the FFN field, {label} (biased to stable "
                                                    f"points; {mn})")
        best = max(range(len(summ.results)), key=lambda i: summ.results[i].n_points, default=None)
        if best is not None and (r := summ.results[best]).n_points:
            figs[f"{key}_spectra"] = r.plot(title=f"Tangent spectra at layer {summ.layers[best]}, {label} "
                                                  f"({r.n_points} equilibria; {mn})")
    return figs


def write_figures(figs: dict[str, Any], fig_dir: Path) -> None:
    """Write each figure as ``NAME.json`` (``plotly.io.from_json``) and ``NAME.html``."""
    fig_dir.mkdir(parents=True, exist_ok=True)
    for i, (name, fig) in enumerate(figs.items()):
        (fig_dir / f"{name}.json").write_text(fig.to_json(), encoding="utf-8")
        # the first standalone page copies plotly.min.js next to itself; the others reference it
        fig.write_html(str(fig_dir / f"{name}.html"), include_plotlyjs="plotly.min.js" if i else "directory",
                       full_html=True)


def figure_html(fig: Any, name: str) -> str:
    """A figure as a ``<div>`` of the page (plotly.js is inlined once in the page's head)."""
    height = fig.layout.height or 480
    div = fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"fig-{name}", default_width="100%",
                      default_height=f"{int(height)}px", config={"displaylogo": False, "responsive": True})
    return f"<div class='fig' id='figure-{esc(name)}'>{div}</div>"


__all__ = ["figure_html", "figures", "write_figures"]
