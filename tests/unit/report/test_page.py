"""The report rendered from a loaded SuiteResult with no model (tl_steering/report/): every section and figure,
escaped, offline, verdicts, the comparison with every published number."""

import html
import json
import re
from pathlib import Path

from tl_steering.reference import published_numbers
from tl_steering.report import SECTIONS, figures
from tl_steering.report.comparison import comparison_rows
from tl_steering.suite import SuiteResult, published_value, run_suite
from tests.unit.conftest import EVIL

REPO = Path(__file__).resolve().parents[3]


def s_starts(suite) -> str:
    return "/".join(str(x) for x in suite.critical.sample()["starts_per_layer"])


def test_report_renders_a_loaded_result_without_a_model(rendered, suite):
    page, loaded = rendered
    assert page.name == "index.html" and page.exists()
    text = page.read_text()
    figs = figures(loaded)
    for key, *_ in SECTIONS:
        assert f"<h2 id='{key}'>" in text, key
        assert "This stage was not run" not in text
    for name in ("summary", "parallel", "provenance"):
        assert f"id='{name}'" in text, name
    # the critical section's per-layer table: one row per layer covered, then the pooled reading and its sample
    table = text.split("<table class='critical-layers'>")[1].split("</table>")[0]
    assert table.count("<tr>") == 1 + len(loaded.critical.layers)
    assert f"<td>{loaded.critical.results[0].n_starts}</td>" in table
    assert "The counts are a sample of landscape: the flow finder" in text
    # and the pooled Morse index histogram with the sentence naming the sample (finder, starts, token directions)
    assert "<table class='critical-index'>" in text and "<th>Morse index</th>" in text
    assert f"finder landscape, {s_starts(loaded)} starts per layer" in text
    # the chosen plan: its figure (every strategy's curve), its rows in the summary table and its executor run
    assert "plan_choice" in figs and "id='figure-plan_choice'" in text
    assert len(figs["plan_choice"].data) == 2 * len(suite.plan_choice.plan.strategies)
    for row in ("chosen plan: strategy, correction", "chosen / lowest-C held-out ΔCE",
                "parallel executor, chosen plan: measured forward speedup"):
        assert row in text, row
    assert f"{suite.plan_choice.plan.strategy}, linear (sequential)" in text
    # the plan table: every compared strategy, uncorrected and corrected at every k, and its passes
    table = text.split("<h3 id='plan_table'>")[1].split("</table>")[0]
    assert table.count("<tr>") == 1 + len(suite.plan_choice.plan.strategies)
    assert all(f"<td>{n}</td>" in table or f"<td><b>{n}</b></td>" in table for n in suite.plan_choice.plan.strategies)
    assert "k = 1: linear" in table and "k = 0" not in table  # k = 0: clean
    assert f"chosen plan: 1 layers</th><td class='num'>{suite.plan_choice.plan.layers[0]}</td>" in text
    assert f"{suite.plan_choice.ratio_to_lowest_c:.4g}" in text
    # every figure embedded once and written as JSON + standalone HTML
    assert text.count('class="plotly-graph-div"') == len(figs) >= 9
    for name in figs:
        assert f"id='figure-{name}'" in text, name
        assert (page.parent / "figures" / f"{name}.json").exists()
        assert (page.parent / "figures" / f"{name}.html").exists()
    assert (page.parent / "figures" / "plotly.min.js").exists()
    # the numbers on the page are the result's
    assert f"{suite.checks.clean_loss:.4g}" in text


def test_every_section_opens_with_a_verdict_and_hides_raw_keys(rendered):
    """Each section: one verdict sentence (computed: docs/suite.md "Verdicts") before its explanation, labelled
    numbers up front, the raw keys in a collapsed table; the executor's timing as median and interval of
    alternating rounds beside the A/A control."""
    page, loaded = rendered
    text = page.read_text()
    for key, *_ in SECTIONS + [("parallel",)]:
        tag = f"<h2 id='{key}'>" if key != "parallel" else "<h3 id='parallel'>"
        body = text.split(tag)[1]
        assert body.split("</h", 1)[1].split("<p", 1)[1].startswith(" class='verdict'>"), key
    for raw in ("error_parallel_mean", "r2_attention_mean", "delta_ce_base_heldout", "frac_layers_ffn_diversifies"):
        first = text.index(f"<th>{raw}</th>")
        assert text.rfind("<details class='raw'>", 0, first) > text.rfind("</details>", 0, first), raw
    assert "one-step angular error with attention + FFN, e_AF (rad)" in text
    ex = loaded.executor
    assert ex.rounds == 5 and len(ex.timing_sequential_s) == len(ex.timing_control_s) == len(ex.timing_parallel_s) == 5
    ratios = [a / b for a, b in zip(ex.timing_sequential_s, ex.timing_parallel_s)]
    assert ex.speedup_interval == [min(ratios), max(ratios)] and ex.speedup_coverage == 1 - 2**-4  # --quick
    assert ex.timing_shape == [1, 16]  # --quick times one window
    assert ex.speedup_interval[0] <= ex.measured_speedup <= ex.speedup_interval[1]
    assert loaded.executor_choice.timing_sequential_s == ex.timing_sequential_s  # timed in the same rounds
    assert "A/A control" in text and "alternating rounds" in text


def test_the_page_shows_the_claims_of_the_results(rendered):
    """The report only formats the claims: each section's verdict on the page of a saved and loaded result is the
    sentence of that section's claim (the protocol result's own ``claim()``, collected by ``SuiteResult.claims()``),
    and each row of the comparison table shows the one band check's verdict."""
    page, loaded = rendered
    text = page.read_text()
    claims = loaded.claims()
    assert set(claims) == {key for key, *_ in SECTIONS} | {"parallel"}
    for key, claim in claims.items():
        tag = f"<h2 id='{key}'>" if key != "parallel" else "<h3 id='parallel'>"
        shown = text.split(tag)[1].split("<p class='verdict'>", 1)[1].split("</p>", 1)[0]
        assert html.unescape(shown) == claim.sentence(), key
    assert claims["deficit"] == loaded.deficit.claim() and claims["critical"] == loaded.critical.claim()
    table = text.split("<h2 id='summary'>")[1].split("<h2 ")[0]
    for row in comparison_rows(loaded):
        assert f">{html.escape(row['verdict'].why)}</span>" in table, row["id"]


def test_page_is_self_contained_and_escaped(rendered):
    page, _ = rendered
    text = page.read_text()
    assert EVIL not in text and "<script>alert" not in text
    assert "&lt;script&gt;alert" in text
    assert not re.search(r'<script[^>]+src="https?://', text), "no external script: the page opens offline"
    from plotly.offline import get_plotlyjs

    assert text.count(get_plotlyjs()[:500]) == 1, "plotly.js inlined exactly once"
    css = (REPO / "tl_steering" / "report" / "style.css").read_text()
    assert css.strip() and css.strip() in text


def test_report_package_runs_no_model():
    """The report package imports nothing that loads or runs a model."""
    src = "\n".join(p.read_text() for p in (REPO / "tl_steering" / "report").glob("*.py"))
    for banned in ("run_suite", "load_model", "adapt(", "backends", "protocols", "transformer_lens", "hooks"):
        assert banned not in src, banned


def test_comparison_lists_every_published_number(suite):
    rows = comparison_rows(suite)
    assert [r["id"] for r in rows] == [r["id"] for r in published_numbers()]
    rel = {r["id"]: r["relation"] for r in rows}
    assert rel["deficit_gpt2"] == "same protocol, other model"
    assert rel["low_trust_auto_summaries"] == "not compared (low trust)"
    ours = {r["id"]: r["ours"] for r in rows}
    assert ours["deficit_gpt2"] == suite.deficit.mean == published_value(suite, "deficit_gpt2")
    assert ours["parallel_gpt2_large_delta_ce"] == suite.plan.delta_ce_lowest
    assert ours["ablation_radial"] == suite.ablation.delta_loss["radial"]


def test_results_json_is_the_suite(rendered):
    page, _ = rendered
    doc = json.loads((page.parent / "results.json").read_text())
    assert doc["__kind__"] == "suite" and SuiteResult.kind == "suite"


def test_a_nan_headline_says_why(suite):
    """The quick report's defect runs without its gold standard, so C_l's Spearman correlation with the single-layer
    ΔCE is NaN: ``nan_reasons()`` says why in words, and the defect section of the page shows those words."""
    import dataclasses
    import math

    from tl_steering.report.page import render_html

    quick = dataclasses.replace(suite, defect=dataclasses.replace(suite.defect, evaluated=False, spearman={}))
    assert math.isnan(quick.summary()["defect_spearman_C"])
    why = quick.nan_reasons()["defect_spearman_C"]
    assert "gold standard" in why and "--quick" in why
    page = render_html(quick, {})
    assert "n/a: not measured: this run skipped the defect" in page
    if suite.defect.evaluated and math.isfinite(suite.defect.spearman.get("C", math.nan)):
        assert suite.nan_reasons() == {}
