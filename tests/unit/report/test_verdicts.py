"""The report's verdicts (tl_steering/report/verdicts.py, docs/suite.md "Verdicts") on synthetic SuiteResult values:
every verdict is computed from the numbers, so moving a number across a band, an interval across 1 or a recovered
fraction across 0 changes the sentence. No model runs here."""

import math

import pytest
import torch

from tl_steering.protocols.gates import GateResult
from tl_steering.protocols.ablation import AblationResult
from tl_steering.report.labels import labelled
from tl_steering.report.page import summary_section
from tl_steering.report.verdicts import (
    ablation_sentence,
    band_verdict,
    executor_verdict,
    gates_sentence,
    parallel_sentence,
    row_verdict,
    section_verdicts,
    timing_verdict,
)
from tl_steering.report.comparison import comparison_rows
from tl_steering.suite import SuiteResult
from tl_steering.suite.result import ExecutorTiming


def test_range_decides_where_the_paper_gives_one():
    """Tangential dCE 3.70 against the paper's range 0.07-1.72: outside it, though inside the 10x tolerance band,
    and the verdict says which one it used."""
    v = band_verdict(3.70, [0.07, 1.72], [0.007, 17.2])
    assert (v.status, v.reference, v.ok) == ("outside range", "paper's range", False)
    assert v.text == "outside the paper's range 0.07–1.72, above it; inside the tolerance band 0.007–17.2"
    assert band_verdict(0.5, [0.07, 1.72], [0.007, 17.2]).status == "inside range"
    assert band_verdict(1.72, [0.07, 1.72], [0.007, 17.2]).ok is True  # the ends belong to the range
    far = band_verdict(50.0, [0.07, 1.72], [0.007, 17.2])
    assert far.status == "outside range" and "also outside the tolerance band 0.007–17.2" in far.text
    assert "below it" in band_verdict(0.01, [0.07, 1.72], [0.007, 17.2]).text


def test_band_decides_for_one_number_or_a_threshold():
    v = band_verdict(0.45, None, [0.31, 0.51], 0.41)
    assert (v.status, v.reference) == ("inside band", "tolerance band")
    assert v.text == "inside the tolerance band 0.31–0.51 around the paper's 0.41"
    assert band_verdict(0.60, None, [0.31, 0.51], 0.41).status == "outside band"
    assert band_verdict(6.0, None, [5.0, None]).text == "inside the tolerance band ≥ 5"
    assert band_verdict(4.9, None, [5.0, None]).ok is False
    assert band_verdict(True).status == "holds" and band_verdict(False).status == "does not hold"
    for nothing in (None, math.nan, "x"):
        assert band_verdict(nothing, [0, 1], [0, 2]).status == "not judged"
    assert band_verdict(0.5).status == "not judged"  # no range, no band


def test_a_timing_estimate_without_interval_is_not_judged():
    row = {"id": "parallel_gpt2_large_speedup", "regress": True, "ours": 1.296, "paper_range": None,
           "band": [1.15, 1.35], "paper_number": 1.24}
    v = row_verdict(row)
    assert v.status == "not judged" and v.ok is None
    assert v.text == ("not judged: one estimate from sub-module median times with no interval (inside the tolerance "
                      "band 1.15–1.35 around the paper's 1.24, for orientation only)")
    assert row_verdict({**row, "id": "parallel_gpt2_large_delta_ce"}).status == "inside band"


def _ablation_suite(tan: float, rad: float = 8.1, zero: float = 8.5) -> SuiteResult:
    return SuiteResult(ablation=AblationResult(delta_loss={"tangential": tan, "radial": rad, "zero": zero},
                                               ratio_to_zero={"radial": rad / zero}))


def _row(html: str, claim_start: str) -> str:
    return next(r for r in html.split("<tr") if claim_start in r)


@pytest.mark.parametrize(("tan", "inside"), [(3.70, False), (0.9, True)])
def test_summary_table_shows_the_band_and_the_range_verdict(tan, inside):
    suite = _ablation_suite(tan)
    rows = {r["id"]: r for r in comparison_rows(suite)}
    assert rows["ablation_tangential"]["paper_range"] == [0.07, 1.72]
    assert rows["ablation_tangential"]["band"] == [0.007, 17.2]
    row = _row(summary_section(suite), "only its tangential part")
    assert "0.007–17.2<br>" in row  # the tolerance band itself is on the page
    assert "0.07 - 1.72" in row  # the paper's range
    assert ("inside the paper&#x27;s range 0.07–1.72" in row) is inside
    assert ("outside the paper&#x27;s range 0.07–1.72" in row) is (not inside)
    assert "(against the paper&#x27;s range)" in row
    assert "inside</span>" not in row  # the old bare "inside" mark is gone


def test_ablation_sentence_follows_the_numbers():
    out = ablation_sentence(_ablation_suite(3.70))
    assert "tangential-only costs +3.7 nats (outside the paper's range 0.07–1.72" in out
    assert "the ordering holds (tangential-only is cheaper) but the tangential part does not preserve" in out
    assert "the claim holds: tangential-only costs 9x less" in ablation_sentence(_ablation_suite(0.9))
    assert "the claim does not hold" in ablation_sentence(_ablation_suite(9.0))


def test_timing_verdict_within_noise_when_the_interval_holds_one():
    assert timing_verdict(1.05, [0.9, 1.3], 1.0, [0.95, 1.05], rounds=7).status == "within noise"
    assert timing_verdict(1.2, [1.1, 1.4], 1.0, [0.95, 1.05], rounds=7).status == "faster"
    # above 1 but overlapping the A/A control's spread: the comparison's own noise could give it
    assert timing_verdict(1.1, [1.02, 1.2], 1.0, [0.9, 1.05], rounds=7).status == "within noise"
    assert timing_verdict(0.8, [0.7, 0.9], 1.0, [0.95, 1.05], rounds=7).status == "slower"
    assert timing_verdict(1.3, [1.3, 1.3], rounds=1).status == "not judged"  # one round: no spread
    v = timing_verdict(1.257, [math.nan, math.nan], rounds=0)  # one median per model: no spread
    assert v.status == "not judged" and "no spread" in v.text
    t = timing_verdict(1.05, [0.9, 1.3], 1.0, [0.95, 1.05], rounds=7, coverage=0.984)
    assert t.text == ("1.05 [0.9, 1.3] (98% interval, median of 7 alternating rounds; A/A control 1 [0.95, 1.05]): "
                      "within noise")


def _executor(par: list[float], seq: list[float], ctrl: list[float]) -> ExecutorTiming:
    ex = ExecutorTiming(layers=[1, 2], device="cpu")
    ex.set_times(seq, ctrl, par)
    return ex


def test_executor_timing_from_alternating_rounds():
    """Median of the paired ratios and its order-statistic interval; 9 rounds: [x_(2), x_(8)] (96.1%)."""
    seq = [1.0, 1.1, 0.9, 1.0, 1.2, 1.0, 0.95, 1.05, 1.0]
    ctrl = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    fast = _executor([s / 1.25 for s in seq], seq, ctrl)
    assert fast.rounds == 9 and fast.measured_speedup == pytest.approx(1.25)
    assert fast.speedup_interval == pytest.approx([1.25, 1.25])
    assert fast.t_forward_sequential_s == 1.0 and fast.t_forward_parallel_s == pytest.approx(0.8)
    assert fast.speedup_control_interval == pytest.approx([0.95, 1.1])  # sorted seq/ctrl: the 2nd and 8th
    assert fast.speedup_coverage == pytest.approx(1 - 2 * 10 / 512)
    assert executor_verdict(fast).status == "faster"
    noisy = _executor([1.0, 0.8, 1.1, 0.9, 1.0, 1.3, 0.85, 1.0, 0.9], seq, ctrl)
    lo, hi = noisy.speedup_interval
    assert lo <= 1 <= hi and executor_verdict(noisy).status == "within noise"
    suite = SuiteResult(executor=noisy, executor_choice=fast)
    sentence = parallel_sentence(suite)
    assert "the lowest-C plan's whole forward is within noise of the original" in sentence
    assert "the chosen plan's faster (speedup 1.25 [1.25, 1.25])" in sentence
    old = ExecutorTiming(measured_speedup=1.257, t_forward_sequential_s=1.0, t_forward_parallel_s=0.8)
    assert executor_verdict(old).status == "not judged"  # a result from before the rounds


def _gates(base: float, gated: float, calib_gain: float = 0.01) -> SuiteResult:
    g = GateResult(layers=[1, 2], plan=[1, 2], gates=torch.ones(4, dtype=torch.float64), loss_clean_heldout=3.0,
                   loss_base_heldout=3.0 + base, loss_gated_heldout=3.0 + gated, loss_base_calib=3.5,
                   loss_gated_calib=3.5 - calib_gain)
    return SuiteResult(gates=g)


def test_gates_sentence_says_when_the_loss_is_not_recovered():
    suite = _gates(0.2, 0.213)
    assert suite.gates.summary()["recovered_fraction_heldout"] == pytest.approx(-0.065)
    out = gates_sentence(suite)
    assert "the gates do not recover the loss held out: they make it worse" in out
    assert "recovered fraction -0.065" in out and "+0.2 → +0.213" in out
    assert "although they lower the calibration loss by 0.01 nats" in out
    assert "the gates recover 50% of the plan's loss held out" in gates_sentence(_gates(0.2, 0.1))
    assert "not judged" in gates_sentence(_gates(0.0, 0.0))
    assert set(section_verdicts(suite)) == {"gates"}  # only the stages that ran


def test_labels_lead_raw_keys_follow():
    out = labelled({"error_parallel_mean": 0.3, "r2_attention_mean": 0.5, "unknown_key": 1,
                    "flow: n_points": 3, "held-out dCE, C": 0.2})
    assert out == {"R² of the block's velocity explained by attention alone": 0.5,
                   "one-step angular error with attention + FFN, e_AF (rad)": 0.3,
                   "flow: distinct equilibria found": 3, "held-out ΔCE (nats) of the plan of strategy C": 0.2}


def test_a_result_missing_a_number_says_so():
    """An ablation with no variants is not judged; a sentence that cannot read its numbers says so on the page."""
    assert "not judged (a variant was not run)" in ablation_sentence(SuiteResult(ablation=AblationResult()))
    broken = SuiteResult(gates=GateResult())
    broken.gates.summary = lambda: {"n_gates": 2}  # what an older or foreign result could hold
    out = section_verdicts(broken)["gates"]
    assert "not judged" in out or out.startswith("No verdict: this result lacks")
    broken.gates.summary = lambda: None
    assert section_verdicts(broken)["gates"].startswith("No verdict: this result lacks what the verdict reads")
