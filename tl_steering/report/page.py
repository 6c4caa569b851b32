"""The report's HTML page: one self-contained file (plotly.js inlined once, every figure embedded, the CSS
from ``style.css``), rendered from a :class:`~tl_steering.suite.SuiteResult` alone. User-supplied text
(model names, corpus labels, arguments) is always escaped."""

import dataclasses
import json
import math
from functools import lru_cache
from importlib import resources
from typing import Any

from .._util.claims import Claim, span
from ..results import _encode
from ..stats import median_interval
from ..suite import SuiteResult
from ..suite.claims import timing_claim
from .comparison import comparison_rows
from .critical_table import critical_layer_table
from .figures import esc as _esc, figure_html
from .labels import labelled


@lru_cache(maxsize=1)
def css() -> str:
    """The page's style sheet (``tl_steering/report/style.css``, shipped in the wheel)."""
    return resources.files(__package__).joinpath("style.css").read_text(encoding="utf-8")


def _fmt(x: Any) -> str:
    """A number or value as short text (escaped)."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if math.isnan(x):
            return "n/a"
        if math.isinf(x):
            return "∞" if x > 0 else "-∞"
        return _esc(f"{x:.4g}")
    if isinstance(x, (list, tuple)):
        if len(x) > 12:
            return _esc(", ".join(str(v) for v in x[:12]) + f", ... ({len(x)} items)")
        return ", ".join(_fmt(v) for v in x)
    if isinstance(x, dict):
        return _esc(json.dumps(_encode(x))[:300])
    return _esc(x)


def _kv_table(d: dict[str, Any]) -> str:
    rows = "".join(f"<tr><th>{_esc(k)}</th><td class='num'>{_fmt(v)}</td></tr>" for k, v in d.items())
    return f"<table>{rows}</table>"


def _numbers(d: dict[str, Any]) -> str:
    """The labelled numbers of a summary up front, every raw key below in a collapsed table."""
    head = labelled(d)
    return ((_kv_table(head) if head else "")
            + "<details class='raw'><summary>All numbers of this section (raw keys of results.json)</summary>"
            + _kv_table(d) + "</details>")


def _verdict(claim: Claim | None) -> str:
    """A section's claim (``SuiteResult.claims()``) as its opening sentence."""
    return f"<p class='verdict'>{_esc(claim.sentence())}</p>" if claim is not None else ""


def median_spread(times: list[float]) -> str:
    """``median [low, high] s`` of a list of seconds (the order-statistic interval of the median)."""
    if not times:
        return "n/a"
    m, lo, hi, _ = median_interval(times)
    return f"{m:.4g} s [{lo:.4g}, {hi:.4g}]"


def _asdict(x: Any) -> dict[str, Any]:
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}


#: (result field, title, explanation, figure names): one page section each, in this order
SECTIONS: list[tuple[str, str, str, list[str]]] = [
    ("deficit", "Angular deficit (protocol 1)",
        "How well the attention-only update aligns with the real block update, on the tangent space at the block "
        "input: deficit<sub>l</sub> = 1 − mean cos(P<sub>u</sub>a, P<sub>u</sub>Δx) (position 0 excluded). A large "
        "deficit means the FFN drives much of the change of direction.", ["deficit_layers", "deficit_positions"]),
    ("ablation", "Radial / tangential FFN ablation (protocol 2)",
        "Every FFN write keeps only its tangential part (P<sub>u</sub>φ) or its radial part (⟨u,φ⟩u), u = the FFN "
        "input direction, all layers at once; ΔCE against the clean model.", ["ablation"]),
    ("diversity", "Diversity under aggregation (protocol 3)",
        "Mean pairwise cosine of the token directions before attention, after attention and after the FFN "
        "(higher = more concentrated), clean and under the ablations, and the effect of scaling attention writes.",
        ["diversity"]),
    ("defect", "Sequential-to-parallel defect C<sub>l</sub> (protocol 4)",
        "C<sub>l</sub> = RMS of d = Φ(x+a) − Φ(x) relative to the block update; the gold standard is the CE increase "
        "with layer l alone made parallel. Curves: the k lowest-C, highest-C, contiguous and random layers made "
        "parallel.", ["defect_scores", "defect_curves"]),
    ("plan_choice", "The chosen plan: planner strategies compared",
        "Cheap planner strategies (one-shot scores: the paper's C and C1, our first- and second-order loss "
        "attributions) each choose k layers on the first half of the windows (calibration), every plan with the "
        "closed-form correction g<sub>l</sub>Φ(x) + b<sub>l</sub> of its parallel FFN writes fitted there; the plan "
        "of lowest calibration ΔCE is chosen and reported on the second half (held out), beside the paper's "
        "lowest-C plan (uncorrected) on the same held-out windows. Curves: held-out (solid) and calibration (dotted) "
        "ΔCE vs k for every strategy; the chosen one is drawn thick.", ["plan_choice"]),
    ("gates", "FFN gates on the low-C plan",
        "One scalar gate per FFN on top of the parallelized plan, fitted on a calibration split and evaluated on "
        "held-out windows.", ["gates"]),
    ("critical", "Critical points of the FFN field",
        "Equilibria u* of F(u) = Φ(ρu) on the sphere (P<sub>u</sub>F(u) = 0), classified by the tangent spectrum "
        "of M = QᵀDF Q − λI: attractor, repeller, saddle, with rotational modes, found by critical_points' one finder "
        "(power iteration, edge tracking, Levenberg-Marquardt, the solution landscape: docs/critical_points.md "
        "section 9). The points are a sample: the label counts say which kinds exist, not their share. One verified "
        "attractor decides 'not attractors'; the share of points with a rotational mode decides 'rotational modes'; "
        "'mostly saddles' is judged per layer by the census bound of the random starts' rows (docs/critical_points.md "
        "section 11; loose at the report's few starts), and the Poincaré-Hopf parity of each layer's found set bounds "
        "from below how many equilibria were not found.",
        ["critical_counts", "critical_spectra", "critical_fixed_point_counts", "critical_fixed_point_spectra"]),
    ("prefix", "Prefix-indexed causal dynamics",
        "A small perturbation of the residual at position j spreads only forward: positions i &lt; j must be "
        "unchanged, later ones change with distance.", ["prefix"])]


#: headline key of SuiteResult.nan_reasons() -> (section, key of that section's summary) where its number shows
NAN_IN_SECTIONS: dict[str, tuple[str, str]] = {"defect_spearman_C": ("defect", "spearman_C")}


def render_html(suite: SuiteResult, figs: dict[str, Any]) -> str:
    """The self-contained page for ``suite`` with the figures ``figs`` (plotly.js inlined once in the head)."""
    from plotly.offline import get_plotlyjs

    name = suite.model.name
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>tl_steering report: {_esc(name)}</title>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<style>{css()}</style>",
        f"<script type='text/javascript'>{get_plotlyjs()}</script>",
        "</head><body><main>",
        f"<h1>Feed-forward steering report: {_esc(name)}</h1>",
        f"<p class='muted'>tl_steering {_esc(suite.environment.tl_steering)} · arXiv:2608.02071 (Mudarisov, Burtsev, "
        f"State) · {_esc(suite.provenance.corpus)} · {_esc(suite.started)} · {suite.total_wall_s:.0f} s"
        + (" · quick settings" if suite.settings.quick else "") + "</p>",
        "<nav><a href='#summary'>Summary vs paper</a>"
        + "".join(f"<a href='#{key}'>{_esc(key)}</a>" for key, *_ in SECTIONS)
        + "<a href='#parallel'>parallel executor</a><a href='#provenance'>Provenance</a></nav>",
        summary_section(suite)]
    claims = suite.claims()
    reasons = suite.nan_reasons()
    for key, title, text, names in SECTIONS:
        result = getattr(suite, key)
        if result is None:
            parts.append(f"<h2 id='{key}'>{title}</h2><p class='muted'>This stage was not run.</p>")
            continue
        parts.append(f"<h2 id='{key}'>{title}</h2>{_verdict(claims.get(key))}<p>{text}</p>")
        summ = result.summary()
        if key == "critical" and suite.critical_fixed_point is not None:
            fp = suite.critical_fixed_point.summary()
            summ = {**{f"{result.results[0].method if result.results else 'finder'}: {k}": v for k, v in summ.items()},
                    **{f"fixed point: {k}": v for k, v in fp.items()}}
        for headline, (section, name) in NAN_IN_SECTIONS.items():  # a NaN number says why, in words
            why = reasons.get(headline)
            value = summ.get(name, math.nan)
            if section == key and why and isinstance(value, float) and math.isnan(value):
                summ = {**summ, name: f"n/a: {why}"}
        if key == "defect" and suite.plan is not None:
            summ = {**summ, "plan: strategy": suite.plan.strategy, "plan: layers": suite.plan.layers,
                    "plan dCE": suite.plan.delta_ce_lowest}
            if suite.speedup is not None:
                sp = _asdict(suite.speedup)
                summ.update({f"speedup estimate: {k}": sp[k]
                             for k in ("speedup", "speedup_with_other", "T_seq_s", "T_par_s", "label")})
        if key == "plan_choice":
            summ = {k: _layers_text(v) if k in ("chosen layers", "lowest-C plan") else v for k, v in summ.items()}
        parts.append(_numbers(summ))
        if key == "plan_choice":  # every strategy at equal k, uncorrected and corrected
            parts.append(plan_table(getattr(result, "plan", None)))
        if key == "critical" and getattr(result, "results", None):
            parts.append(critical_layer_table(result))
        parts.extend(figure_html(figs[n], n) for n in names if n in figs)
        if key == "defect" and suite.executor is not None:
            parts.append(parallel_section(suite, claims.get("parallel")))
    parts += [provenance_section(suite),
              "<p class='muted'>Figures are also in <code>figures/</code> (plotly JSON and standalone HTML); every "
              "number is in <code>results.json</code> (<code>SuiteResult.load</code>).</p>", "</main></body></html>"]
    return "\n".join(parts)


def summary_section(suite: SuiteResult) -> str:
    """The paper's published numbers beside ours, after the headline table."""
    h = suite.summary()
    model = _esc(suite.model.name)
    rows = []
    for r in comparison_rows(suite):
        v = r["verdict"]
        cls = {True: "ok", False: "off"}.get(v.ok, "muted")
        against = v.parts.get("against", "")
        uses = f" <span class='muted'>(against the {_esc(against)})</span>" if against else ""
        band = r.get("band")
        band_txt = "—" if band is None else f"{_esc(span(*band))}<br><span class='muted'>{_esc(r.get('tolerance', ''))}</span>"
        lowtrust = " class='lowtrust'" if not r["regress"] else ""
        rows.append(f"<tr{lowtrust}><td>{_esc(r['claim'])}</td><td>{_esc(r['paper_model'])}</td>"
                    f"<td class='num'>{_esc(r['paper_value'])}</td><td class='num'>{band_txt}</td>"
                    f"<td><span class='tag'>[{_esc(r['certainty'])}]</span></td><td class='num'>{_fmt(r['ours'])}"
                    f"</td><td>{_esc(r['ours_note'])}</td><td>{_esc(r['relation'])}</td>"
                    f"<td><span class='{cls}'>{_esc(v.why)}</span>{uses}</td></tr>")
    est = h.get("speedup_estimate")
    key = {
        "clean CE (nats)": h.get("clean_loss"),
        "angular deficit (mean)": h.get("deficit_mean"),
        "ΔCE tangential-only": h.get("ablation_delta_loss_tangential"),
        "ΔCE radial-only": h.get("ablation_delta_loss_radial"),
        "ΔCE zero FFN": h.get("ablation_delta_loss_zero"),
        f"plan: {h.get('plan_k', '?')} lowest-C layers, ΔCE": h.get("plan_delta_ce"),
        "speedup estimate (sub-module times)": None if est is None else
        f"{_fmt(est)} (critical-path estimate from sub-module median times: a model, no interval)",
        "parallel executor: measured forward speedup": None if suite.executor is None else
        timing_claim(suite.executor).why,
        **_choice_rows(suite),
        "critical points: saddle fraction": h.get("critical_saddle_fraction"),
        "prefix positions i < j unchanged bitwise": h.get("prefix_bitwise_equal")}
    return (
        f"<h2 id='summary'>Summary: the paper's numbers beside ours ({model})</h2>"
        "<div class='note'>The paper reports GPT-2, GPT-2-large, Pythia, Mistral and Llama-3-8B; this run is on "
        f"<b>{model}</b>, so most rows are <i>the same protocol on another model</i>: they show where this model "
        "sits, not whether the package reproduces the paper (that is <code>pytest -m published</code>, on the "
        "paper's models). Certainty: [P] the paper says it, [S] only the summary we started from, [I] our "
        "inference. <b>Verdict</b>: where the paper publishes a range (over its models), ours is judged against "
        "that range and a value outside it says \"outside the paper's range\", whatever the tolerance band; "
        "where it publishes one number or a threshold, against the tolerance band around it "
        "(tl_steering/reference/published.json, docs/published.md); a shape target holds or does not. The column "
        "says which one each verdict used. Timings: the median of paired ratios over alternating rounds with its "
        "interval, beside an A/A control (the original timed against itself); \"within noise\" where the interval "
        "holds 1 or overlaps the control's.</div>"
        + _kv_table(key)
        + "".join(f"<p class='muted'>{_esc(k)} is n/a: {_esc(why)}.</p>" for k, why in suite.nan_reasons().items())
        + "<table><tr><th>claim</th><th>paper model</th><th>paper value</th><th>tolerance band</th>"
        "<th>certainty</th><th>ours</th><th>how ours was measured</th><th>relation</th><th>verdict</th></tr>"
        + "".join(rows)
        + "</table>")


def _layers_text(layers: list[int]) -> str:
    """A layer list in full, runs of consecutive layers as ranges: ``3, 6-10, 20-27``."""
    runs: list[list[int]] = []
    for lay in sorted(layers):
        if runs and lay == runs[-1][1] + 1:
            runs[-1][1] = lay
        else:
            runs.append([lay, lay])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def _choice_rows(suite: SuiteResult) -> dict[str, Any]:
    """The summary table's rows of the chosen plan (none when the plan_choice stage did not run)."""
    pc = suite.plan_choice
    if pc is None or pc.plan is None:
        return {}
    p = pc.plan
    rows: dict[str, Any] = {
        f"chosen plan: {p.k} layers": _layers_text(list(p.layers)),
        "chosen plan: strategy, correction": f"{p.strategy}, {p.refit}"
        + (f" ({p.refit_order})" if p.refit != "none" else ""),
        f"chosen plan: calibration ΔCE ({p.n_calibration} windows)": p.calibration_delta_ce,
        f"chosen plan: held-out ΔCE ({p.n_held_out} windows)": p.held_out_delta_ce,
        f"lowest-C plan ({_layers_text(pc.lowest_c_layers)}), uncorrected: held-out ΔCE":
            pc.lowest_c_held_out_delta_ce,
        "chosen / lowest-C held-out ΔCE": pc.ratio_to_lowest_c}
    ex = suite.executor_choice
    if ex is not None:
        rows["parallel executor, chosen plan: measured forward speedup"] = timing_claim(ex).why
    return rows


def _executor_rows(ex: Any) -> dict[str, Any]:
    """The labelled numbers of one executor run: the plan, its loss, its times and the timing verdict."""
    rows: dict[str, Any] = {
        "plan": f"{ex.strategy} ({_layers_text(list(ex.layers))})"
        + (f", {ex.correction} correction" if ex.correction != "none" else ""),
        "ΔCE over all windows (nats)": ex.delta_ce}
    if ex.status != "ok":
        rows["status"] = f"{ex.status}: {ex.reason}"
        return rows
    n = getattr(ex, "rounds", 0)
    if n:
        rows.update({
            "sequential forward: median [interval]": median_spread(ex.timing_sequential_s),
            "A/A control (the sequential forward again)": median_spread(ex.timing_control_s),
            "parallel forward: median [interval]": median_spread(ex.timing_parallel_s)})
    else:
        rows.update({"sequential forward: median (s)": ex.t_forward_sequential_s,
                     "parallel forward: median (s)": ex.t_forward_parallel_s})
    rows["speedup, sequential / parallel: verdict"] = timing_claim(ex).why
    return rows


def _num(v: float) -> str:
    return f"{v:+.3f}" if isinstance(v, float) and math.isfinite(v) else "—"


def plan_table(plan: Any) -> str:
    """HTML table of a ``ParallelPlan``: every strategy of the ``plan_choice`` stage at every k, held-out dCE without
    and with the fitted correction, and the passes each needed (docs/parallel.md "Planners against the field");
    empty without curves."""
    if plan is None or not getattr(plan, "held_out_curves", None):
        return ""
    unc = getattr(plan, "held_out_curves_uncorrected", {}) or {}
    ks = list(plan.k_values)
    cols = [j for j, k in enumerate(ks) if k > 0]  # k = 0 is the clean model: zero everywhere
    refit = _esc(plan.refit)
    head = "".join(f"<th>k = {ks[j]}: none</th><th>k = {ks[j]}: {refit}</th>" for j in cols)
    rows = []
    for s in plan.strategies:
        cells = []
        for j in cols:
            u = float(unc[s][j]) if s in unc else math.nan
            c = float(plan.held_out_curves[s][j])
            cells.append(f"<td>{_num(u if plan.refit != 'none' else c)}</td><td>{_num(c)}</td>")
        cost = plan.strategy_costs.get(s, {})
        name = f"<b>{_esc(s)}</b>" if s == plan.strategy else _esc(s)
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
        f"<table><tr><th>strategy</th>{head}<th>passes (fwd + bwd)</th></tr>{''.join(rows)}</table>")


def parallel_section(suite: SuiteResult, verdict: Claim | None = None) -> str:
    ex = suite.executor
    n = getattr(ex, "rounds", 0)
    how = (f"in {n} alternating rounds (each times one forward of the original, of the original again as the A/A "
           "control, and of every parallel copy, the order rotated per round), shown as median and order-statistic "
           "interval" if n else "as one median per model (a result from before the alternating rounds: no verdict)")
    out = (
        f"<h3 id='parallel'>The plans run by the parallel executor</h3>{_verdict(verdict)}<p>The low-C plan made "
        "parallel for real (<code>tl_steering.parallel.parallelize</code>, fused blocks) and timed as a whole "
        f"forward on this machine {how}; the estimate above is the critical-path model of the paper.</p>"
        + _kv_table(_executor_rows(ex)))
    if suite.executor_choice is not None:
        out += (
            "<p>The chosen plan (section <a href='#plan_choice'>plan_choice</a>) run the same way, in the same "
            "rounds, its fitted corrections folded into the fused weights "
            "(<code>parallelize(model, layers, gates=, biases=, linears=)</code>).</p>"
            + _kv_table(_executor_rows(suite.executor_choice)))
    raw = _kv_table(_asdict(ex)) + (_kv_table(_asdict(suite.executor_choice)) if suite.executor_choice else "")
    return out + ("<details class='raw'><summary>All numbers of the executor runs (raw keys of results.json)"
                  "</summary>" + raw + "</details>")


def provenance_section(suite: SuiteResult) -> str:
    timings = {
        k: (f"{v.wall_s:.1f} s wall, {v.cpu_s:.1f} s CPU"
            + (f", {v.forwards} forwards ({v.tokens:,} tokens)" if v.forwards >= 0 else "")
            if math.isfinite(v.wall_s) else "—")
        for k, v in suite.timings.items()}
    return ("<h2 id='provenance'>Provenance</h2><h3>Model and data</h3>" + _kv_table(_asdict(suite.model))
            + _kv_table(_asdict(suite.provenance)) + "<h3>Arguments and settings</h3>"
            + _kv_table(_asdict(suite.arguments)) + _kv_table(_asdict(suite.settings)) + "<h3>Environment</h3>"
            + _kv_table(_asdict(suite.environment)) + "<h3>Stage timings</h3>" + _kv_table(timings))


__all__ = ["SECTIONS", "css", "render_html", "summary_section"]
