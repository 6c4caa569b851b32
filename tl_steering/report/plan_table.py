"""The report's plan table: every strategy of the ``plan_choice`` stage at every k, held-out dCE without and with
the fitted correction, and the passes each needed (docs/parallel.md "Planners against the field")."""

import html
import math
from typing import Any


def _num(v: float) -> str:
    return f"{v:+.3f}" if isinstance(v, float) and math.isfinite(v) else "—"


def plan_table(plan: Any) -> str:
    """HTML table of a ``ParallelPlan`` with ``held_out_curves_uncorrected`` (empty string without curves)."""
    if plan is None or not getattr(plan, "held_out_curves", None):
        return ""
    unc = getattr(plan, "held_out_curves_uncorrected", {}) or {}
    ks = list(plan.k_values)
    cols = [j for j, k in enumerate(ks) if k > 0]  # k = 0 is the clean model: zero everywhere
    refit = html.escape(plan.refit)
    head = "".join(f"<th>k = {ks[j]}: none</th><th>k = {ks[j]}: {refit}</th>" for j in cols)
    rows = []
    for s in plan.strategies:
        cells = []
        for j in cols:
            u = float(unc[s][j]) if s in unc else math.nan
            c = float(plan.held_out_curves[s][j])
            cells.append(f"<td>{_num(u if plan.refit != 'none' else c)}</td><td>{_num(c)}</td>")
        cost = plan.strategy_costs.get(s, {})
        name = f"<b>{html.escape(s)}</b>" if s == plan.strategy else html.escape(s)
        rows.append(f"<tr><td>{name}</td>{''.join(cells)}<td>{cost.get('forward', 0):.0f} + "
                    f"{cost.get('backward', 0):.0f}</td></tr>")
    total = plan.total_cost
    return (
        "<h3 id='plan_table'>Every compared strategy at equal k (held-out ΔCE, nats)</h3>"
        f"<p>Plans chosen on the {plan.n_calibration} calibration windows, measured on the {plan.n_held_out} "
        f"held-out windows without correction and with the {refit} correction fitted on the calibration windows; "
        "passes: forwards + backwards over the calibration windows each strategy needed to choose (the peers' "
        "scores, ShortGPT's block influence, the angular distance of Gromov et al. and FFN Fusion's dependency, "
        f"share C's forward). The chosen one in bold. Whole comparison: {total.get('forward', 0):.0f} forwards + "
        f"{total.get('backward', 0):.0f} backwards.</p>"
        f"<table><tr><th>strategy</th>{head}<th>passes (fwd + bwd)</th></tr>{''.join(rows)}</table>"
    )


__all__ = ["plan_table"]
