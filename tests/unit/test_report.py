"""The suite runner, its saved result and the report rendered from it, on a tiny random GPT-2 (2 layers):
save/load round trips exactly, the report renders a loaded SuiteResult with no model (every section, every
figure, escaped, offline), the one map of published numbers, and the CLI's argument checks (fail fast, one line,
exit code 2, nothing written)."""

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tl_steering as ts
from tl_steering.backends import ModelInfo
from tl_steering.cli import build_parser, check_report_args
from tl_steering.data.windows import text_windows
from tl_steering.reference import published_numbers
from tests.helpers import assert_no_hooks
from tl_steering.report import SECTIONS, figures, render_report
from tl_steering.report.comparison import comparison_rows
from tl_steering.suite import (
    PINNED,
    PUBLISHED,
    STAGES,
    SuiteResult,
    SuiteSettings,
    default_settings,
    published_value,
    run_suite,
)

EVIL = "<script>alert('x')</script>&\""
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def suite(suite_inputs):
    """One run of every stage on a tiny model (a few seconds)."""
    model, tokens, s = suite_inputs
    return run_suite(model, tokens, s, progress=False, seed=0)


@pytest.fixture(scope="module")
def suite_inputs(tmp_path_factory):
    """The tiny model, its 4 token windows and the quick settings of :func:`suite`."""
    out = tmp_path_factory.mktemp("suite")
    model = ts.tiny_model("gpt2", backend="bridge", seed=0, n_layers=2)
    model._tl_steering_info = ModelInfo(name=f"tiny {EVIL}", revision="random-init seed=0", processing="raw")
    text = out / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    s = default_settings(2, quick=True, windows=4, length=16)
    s.n_bootstrap = 20
    s.critical_n_starts = 2
    s.critical_methods = ["flow", "fixed_point"]  # the default finder and the second slot of the report
    s.timing_repeats = 1
    tokens = text_windows(model, source=str(text), n_windows=4, length=16, seed=0)
    return model, tokens, s


@pytest.fixture(scope="module")
def rendered(suite, tmp_path_factory):
    """The suite saved as results.json, loaded back (no model anywhere) and rendered."""
    out = tmp_path_factory.mktemp("report")
    path = suite.save(out / "results.json")
    loaded = SuiteResult.load(path)
    page = render_report(loaded, out)
    return page, loaded


def s_starts(suite) -> str:
    return "/".join(str(x) for x in suite.critical.sample()["starts_per_layer"])


def test_every_stage_fills_its_fields(suite):
    assert set(suite.timings) == set(STAGES)
    # forward passes per stage: checks = the clean pass over 4 windows (one batch) + the identity pass on 1 window
    assert (suite.timings["checks"].forwards, suite.timings["checks"].tokens) == (2, 4 * 16 + 16)
    assert all(t.forwards >= 1 and t.tokens >= 16 for t in suite.timings.values()), suite.timings
    for name in (
        "checks",
        "deficit",
        "ablation",
        "diversity",
        "defect",
        "plan",
        "speedup",
        "executor",
        "plan_choice",
        "executor_choice",
        "gates",
        "critical",
        "critical_fixed_point",
        "prefix",
    ):
        assert getattr(suite, name) is not None, name
    assert suite.defect_gold is None  # only when settings.defect_gold_layers is set
    assert suite.deficit.provenance.corpus == "file:corpus.txt:4x16:seed0"
    assert suite.provenance.corpus == "file:corpus.txt:4x16:seed0"
    # every stage's results carry the corpus label, the critical points' per-layer results too
    assert suite.critical.provenance.corpus == "file:corpus.txt:4x16:seed0"
    assert all(r.provenance.corpus == "file:corpus.txt:4x16:seed0" for r in suite.critical.results)
    assert suite.plan.k == 1 and len(suite.plan.layers) == 1
    assert suite.plan.source.startswith("measured by the suite")  # quick settings: no gold-standard curves
    assert suite.executor.status == "ok"
    # the executor and the surrogate hooks agree on the plan's loss
    assert suite.executor.delta_ce == pytest.approx(suite.plan.delta_ce_lowest, abs=1e-4)
    assert suite.checks.clean_loss == pytest.approx(suite.ablation.clean_loss, abs=1e-5)


def test_plan_choice_is_re_measurable(suite, suite_inputs):
    """The chosen plan (plan_choice stage): the cheap strategies and the peers' scores compared with the linear
    refit, chosen by cross-fitted calibration dCE on windows 0-1; its held-out dCE on windows 2-3 is exactly
    ParallelPlan.hooks(model) on them, every compared plan is also measured uncorrected there, the lowest-C
    comparison is the uncorrected lowest-C plan there, and the executor runs the corrected plan (maps folded)."""
    from tl_steering.data.batching import mean_loss
    from tl_steering.data.windows import token_source
    from tl_steering.hooks import parallel_blocks
    from tl_steering.suite import PLAN_CHOICE_STRATEGIES
    from tl_steering.suite.settings import PEER_SCORES

    model, tokens, s = suite_inputs
    tokens = token_source(tokens, None)[0]
    cal, held = tokens[:2], tokens[2:]
    pc = suite.plan_choice
    p = pc.plan
    assert p.strategies == list(PLAN_CHOICE_STRATEGIES + PEER_SCORES) == s.plan_choice_strategies
    assert p.requested == "best" and p.strategy in p.strategies and p.refit == "linear"
    assert p.options["refit_crossfit"] and p.linears.shape[0] == p.k
    assert p.k == suite.plan.k == 1 and (p.n_calibration, p.n_held_out) == (2, 2) and p.k_values == [0, 1]
    assert p.options["fisher_samples"] == pc.fisher_samples == s.plan_choice_fisher_samples > 0
    # chosen by calibration dCE among the compared strategies
    cal_at_k = p.at_k("calibration")
    assert p.calibration_delta_ce == min(cal_at_k.values()) == cal_at_k[p.strategy]
    # the held-out dCE re-measured by running the plan's hooks (with its fitted gates and biases) on held-out windows
    clean_held = mean_loss(model, held, [], s.batch_size)
    direct = mean_loss(model, held, p.hooks(model), s.batch_size) - clean_held
    assert math.isfinite(p.held_out_delta_ce)
    assert direct == pytest.approx(p.held_out_delta_ce, abs=1e-9, rel=0)
    # every compared plan uncorrected on the held-out windows (the report's plan table)
    assert set(p.held_out_curves_uncorrected) == set(p.strategies)
    for strat in p.strategies:
        layers = p.plan_of(strat)
        plain = mean_loss(model, held, parallel_blocks(model, layers), s.batch_size) - clean_held
        assert float(p.held_out_curves_uncorrected[strat][-1]) == pytest.approx(plain, abs=1e-9, rel=0), strat
    assert p.held_out_delta_ce_uncorrected == float(p.held_out_curves_uncorrected[p.strategy][-1])
    # the lowest-C plan, uncorrected, on the same held-out windows, and the ratio
    assert pc.lowest_c_layers == suite.plan.layers
    low = mean_loss(model, held, parallel_blocks(model, suite.plan.layers), s.batch_size) - clean_held
    assert pc.lowest_c_held_out_delta_ce == pytest.approx(low, abs=1e-9, rel=0)
    assert pc.ratio_to_lowest_c == pytest.approx(p.held_out_delta_ce / low, rel=1e-12)
    # the executor ran the chosen plan with its corrections folded in: its loss over all windows is the hooks'
    ex = suite.executor_choice
    assert ex.status == "ok" and ex.layers == p.layers and ex.strategy == p.strategy and ex.correction == "linear"
    assert math.isfinite(ex.measured_speedup) and ex.t_forward_sequential_s == suite.executor.t_forward_sequential_s
    assert ex.delta_ce == pytest.approx(mean_loss(model, tokens, p.hooks(model), s.batch_size)
                                        - suite.checks.clean_loss, abs=1e-4)
    assert_no_hooks(model)


def test_plan_choice_off_and_bad_settings():
    """An empty strategy list turns the stage off (no plan_choice, no executor_choice); unknown names raise."""
    model = ts.tiny_model("gpt2", backend="bridge", seed=0, n_layers=2)
    tokens = torch.randint(0, 100, (2, 8))
    s = SuiteSettings(stages=["checks", "defect", "plan_choice", "parallel"], plan_k=1, defect_evaluate=False,
                      defect_brackets=False, defect_timing=False, defect_n_random=0, parallel_repeats=1,
                      plan_choice_strategies=[])
    res = run_suite(model, tokens, s, progress=False)
    assert res.plan_choice is None and res.executor_choice is None and res.executor.status == "ok"
    s.plan_choice_strategies, s.plan_choice_fisher_samples = ["C", "attribution_2nd"], 0  # 2nd order dropped
    res = run_suite(model, tokens, s, progress=False)
    assert res.plan_choice.plan.strategies == ["C"] and res.executor_choice is not None
    for bad in (dict(plan_choice_strategies=["nope"]), dict(plan_choice_refit="quadratic"),
                dict(plan_choice_fisher_samples=-1)):
        with pytest.raises(ts.errors.InputError, match="plan_choice"):
            run_suite(model, tokens, SuiteSettings(stages=["plan_choice"], **bad), progress=False)


@pytest.mark.parametrize("suffix", [".json", ".safetensors"])
def test_suite_result_round_trips_exactly(suite, tmp_path, suffix):
    path = suite.save(tmp_path / f"suite{suffix}")
    loaded = SuiteResult.load(path)
    assert isinstance(loaded, SuiteResult)
    if suffix == ".json":  # the chosen plan's corrections in the safetensors sidecar, not in the JSON
        assert json.loads(path.read_text())["plan_choice"]["plan"]["linears"]["__tensor_ref__"]
        assert (tmp_path / "suite.tensors.safetensors").exists()
    assert loaded.to_dict() == suite.to_dict()  # every field, tensors with dtype, shape and values
    assert torch.equal(loaded.defect.score, suite.defect.score)
    assert loaded.defect.score.dtype == suite.defect.score.dtype
    assert loaded.settings == suite.settings and loaded.plan == suite.plan
    assert loaded.critical.results[0].n_points == suite.critical.results[0].n_points


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
    assert "The counts are a sample of flow: what the dynamics reach" in text
    # and the pooled Morse index histogram with the sentence naming the sample (finder, starts, token directions)
    assert "<table class='critical-index'>" in text and "<th>Morse index</th>" in text
    assert f"finder flow, {s_starts(loaded)} starts per layer" in text
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
    assert "block_influence" in table and "k = 1: linear" in table
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
    assert ex.rounds == 7 and len(ex.timing_sequential_s) == len(ex.timing_control_s) == len(ex.timing_parallel_s) == 7
    assert ex.timing_shape == [1, 16]  # --quick times one window
    assert ex.speedup_interval[0] <= ex.measured_speedup <= ex.speedup_interval[1]
    assert loaded.executor_choice.timing_sequential_s == ex.timing_sequential_s  # timed in the same rounds
    assert "A/A control" in text and "alternating rounds" in text


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


def test_one_map_covers_published_and_pinned_names():
    from tl_steering.reference import pinned_values

    assert sorted(PUBLISHED) == sorted(r["id"] for r in published_numbers())
    assert sorted(PINNED) == sorted(pinned_values()["values"])
    assert all(PINNED[k].tol == v["tol"] for k, v in pinned_values()["values"].items())


def test_stages_subset_and_bad_settings():
    model = ts.tiny_model("gpt2", backend="bridge", seed=0, n_layers=2)
    tokens = torch.randint(0, 100, (2, 8))
    res = run_suite(model, tokens, SuiteSettings(stages=["deficit"], n_bootstrap=0), progress=False)
    assert res.deficit is not None and res.ablation is None and set(res.timings) == {"deficit"}
    assert res.deficit.provenance.corpus.startswith("user tokens")
    with pytest.raises(ts.errors.InputError, match="defect"):
        run_suite(model, tokens, SuiteSettings(stages=["gates"]), progress=False)
    with pytest.raises(ts.errors.InputError, match="unknown stages"):
        run_suite(model, tokens, SuiteSettings(stages=["nope"]), progress=False)


def test_cli_parses_the_readme_command():
    args = build_parser().parse_args(
        ["report", "--model", "smollm2-135m", "--text", "pydoc", "--out", "r", "--quick"]
    )
    assert args.quick and args.model == "smollm2-135m" and args.windows is None
    check_report_args(args)  # valid: no error, nothing created
    assert not Path("r").exists()


def _bad_args(tmp_path: Path) -> dict[str, list[str]]:
    afile = tmp_path / "a_file"
    afile.write_text("x")
    return {
        "windows": ["--windows", "1"],
        "length": ["--length", "4"],
        "text": ["--text", str(tmp_path / "missing.txt")],
        "device": ["--device", "bogus"],
        "cuda": ["--device", "cuda:7"],
        "out": ["--out", str(afile)],
        "backend": ["--backend", "nope"],
        "windows_type": ["--windows", "four"],
    }


def test_cli_checks_arguments_before_loading(tmp_path):
    """Each bad argument is an InputError from the pure checks (no model, no directory)."""
    parser = build_parser()
    for name, extra in _bad_args(tmp_path).items():
        if name in ("backend", "windows_type"):
            continue  # argparse's own checks (exit code 2 in the subprocess test)
        out = tmp_path / f"out_{name}"
        argv = ["report", "--out", str(out), *extra] if name != "out" else ["report", *extra]
        with pytest.raises(ts.errors.InputError):
            check_report_args(parser.parse_args(argv))
        assert not out.exists()


@pytest.mark.parametrize("case", ["windows", "text", "device", "backend"])
def test_cli_user_error_fails_fast_in_one_line(tmp_path, case):
    """``python -m tl_steering report <bad>``: exit code 2, one line on stderr, nothing written, in under 5 s.

    The time bound is on the child's CPU time (user + system), which is the wall time on an idle machine and
    does not grow when other processes share the cores; the wall time is in the message.
    """
    import resource

    out = tmp_path / "report_out"
    argv = [sys.executable, "-m", "tl_steering", "report", "--out", str(out), *_bad_args(tmp_path)[case]]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists() and not (tmp_path / "figures").exists()
    assert cpu < 5.0, f"{case}: the error took {cpu:.1f} s of CPU ({wall:.1f} s wall)"


def test_render_subcommand_rerenders_a_saved_run(rendered, tmp_path):
    page, _ = rendered
    from tl_steering.cli import main

    assert main(["render", str(page.parent / "results.json"), "--out", str(tmp_path / "again")]) == 0
    again = (tmp_path / "again" / "index.html").read_text()
    assert again.count('class="plotly-graph-div"') == page.read_text().count('class="plotly-graph-div"')
    assert main(["render", str(tmp_path / "none.json")]) == 2


def test_results_json_is_the_suite(rendered):
    page, _ = rendered
    doc = json.loads((page.parent / "results.json").read_text())
    assert doc["__kind__"] == "suite" and SuiteResult.kind == "suite"
