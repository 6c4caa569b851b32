"""The report: renders a saved :class:`~tl_steering.suite.SuiteResult` as one self-contained HTML page with
figures (:func:`render_report`); it never runs a model. See docs/suite.md, "The report"."""

from pathlib import Path

from ..suite import SuiteResult
from .figures import figure_html, figures, write_figures
from .page import SECTIONS, css, render_html


def render_report(suite: SuiteResult | str | Path, out: str | Path) -> Path:
    """Write ``out/index.html`` and ``out/figures/`` for ``suite`` (a SuiteResult or a saved one's path); returns the
    path of ``index.html``."""
    if not isinstance(suite, SuiteResult):
        suite = SuiteResult.load(suite)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    figs = figures(suite)
    write_figures(figs, out_dir / "figures")
    page = out_dir / "index.html"
    page.write_text(render_html(suite, figs), encoding="utf-8")
    return page


__all__ = ["SECTIONS", "css", "figure_html", "figures", "render_html", "render_report", "write_figures"]
