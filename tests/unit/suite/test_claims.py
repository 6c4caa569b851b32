"""The claims (tl_steering._util.claims.Claim; docs/suite.md "Claims"): every protocol result judges its own claim from its
numbers, the suite collects them, and the one band check (tl_steering.reference.band_check) judges a value against
a published number. Synthetic results: moving a number across a band, an interval across 1 or a recovered fraction
across 0 changes the verdict. No model runs here."""

import math

import pytest
import torch

from tl_steering.critical import CriticalPointsResult
from tl_steering.parallel.defect_result import DefectResult
from tl_steering.protocols.ablation import AblationResult
from tl_steering.protocols.deficit import DeficitResult
from tl_steering.protocols.diversity import DiversityResult
from tl_steering.protocols.gates import GateResult
from tl_steering.protocols.prefix import PrefixSensitivityResult, PrefixStatisticsResult
from tl_steering.reference import band_check, paper_statement, published_number
from tl_steering.report.comparison import comparison_rows
from tl_steering.report.labels import labelled
from tl_steering.report.page import summary_section
from tl_steering._util.claims import VERDICTS, Claim
from tl_steering.suite import SuiteResult
from tl_steering.suite.claims import parallel_claim, timing_claim
from tl_steering.suite.result import ExecutorTiming

#: every protocol's result class: each has claim() returning a Claim
PROTOCOL_RESULTS = [DeficitResult, AblationResult, DiversityResult, GateResult, PrefixSensitivityResult,
                    PrefixStatisticsResult, DefectResult, CriticalPointsResult]


@pytest.mark.parametrize("cls", PROTOCOL_RESULTS, ids=lambda c: c.__name__)
def test_every_protocol_result_has_a_claim(cls):
    """An empty result has nothing to judge: its claim says so."""
    c = cls().claim()
    assert isinstance(c, Claim) and c.verdict == "not judged" and c.ok is None
    assert c.statement and c.why and c.by in ("paper", "ours")


def test_the_suite_collects_its_sections_claims(suite):
    claims = suite.claims()
    assert list(claims) == ["deficit", "ablation", "diversity", "defect", "plan_choice", "parallel", "gates",
                            "critical", "prefix"]
    assert all(isinstance(c, Claim) and c.verdict in VERDICTS for c in claims.values())
    for key in ("deficit", "ablation", "diversity", "gates", "critical", "prefix"):
        assert claims[key] == getattr(suite, key).claim(), key  # the section's claim is the result's own
    assert claims["deficit"].value == suite.deficit.mean and claims["deficit"].interval == tuple(suite.deficit.mean_ci)


def test_a_claim_has_one_of_the_verdicts():
    with pytest.raises(Exception, match="verdict must be one of"):
        Claim("x", "maybe", "y")
    assert Claim("", "not judged", "it lacks a field").sentence() == "No verdict: it lacks a field."
    assert Claim("s", "holds", "w", by="ours").sentence() == "Ours, not the paper's claim [ours]: s; here w."


def test_statements_come_from_the_published_data():
    """The paper's facts (18 of GPT-2-large's 36 layers, 1.24x) are read from published.json, not written in code."""
    sp = published_number("parallel_gpt2_large_speedup")
    assert f"making {sp['k']} of GPT-2-large's {sp['n_layers']} layers parallel" in paper_statement("parallel")
    assert f"about {sp['value']:g}x" in paper_statement("parallel")
    assert "(ΔCE 0.07–1.72 nats over its models)" in paper_statement("ablation")
    assert "(mean deficit 0.41 on GPT-2, 0.63 on Llama-3-8B)" in paper_statement("deficit")
    with pytest.raises(Exception, match="no statement 'nope'"):
        paper_statement("nope")


def test_range_decides_where_the_paper_gives_one():
    """Tangential dCE 3.70 against the paper's range 0.07-1.72: outside it, though inside the 10x tolerance band,
    and the verdict says which one it used."""
    v = band_check(3.70, "ablation_tangential")
    assert (v.verdict, v.parts["against"], v.ok) == ("does not hold", "paper's range", False)
    assert v.why == "outside the paper's range 0.07–1.72, above it; inside the tolerance band 0.007–17.2"
    assert band_check(0.5, "ablation_tangential").verdict == "holds"
    assert band_check(1.72, "ablation_tangential").ok is True  # the ends belong to the range
    far = band_check(50.0, "ablation_tangential")
    assert not far.ok and "also outside the tolerance band 0.007–17.2" in far.why
    assert "below it" in band_check(0.01, "ablation_tangential").why
    assert band_check(3.70, "ablation_tangential", by_range=False).ok is True  # the regression band (tests/published)


def test_band_decides_for_one_number_or_a_threshold():
    v = band_check(0.45, "deficit_gpt2")
    assert (v.verdict, v.parts["against"]) == ("holds", "tolerance band")
    assert v.why == "inside the tolerance band 0.31–0.51 around the paper's 0.41"
    assert band_check(0.60, "deficit_gpt2").verdict == "does not hold"
    assert band_check(6.0, "parallel_gpt2_large_high_defect_degrades").why == "inside the tolerance band ≥ 5"
    assert band_check(4.9, "parallel_gpt2_large_high_defect_degrades").ok is False
    assert band_check(True, "diversity_tangential_preserves").verdict == "holds"
    assert band_check(False, "diversity_tangential_preserves").verdict == "does not hold"
    for nothing in (None, math.nan, "x"):
        assert band_check(nothing, "deficit_pythia").verdict == "not judged"
    assert band_check(0.5, "deficit_order_gpt2_llama").verdict == "not judged"  # no range, no band


def test_a_timing_estimate_without_interval_is_not_judged():
    suite = SuiteResult()
    rows = {r["id"]: r for r in comparison_rows(suite)}
    assert rows["parallel_gpt2_large_speedup"]["verdict"].verdict == "not judged"
    from tl_steering.report.comparison import _verdict

    v = _verdict(published_number("parallel_gpt2_large_speedup"), 1.296)
    assert v.verdict == "not judged" and v.ok is None
    assert v.why == ("not judged: one estimate from sub-module median times with no interval (inside the tolerance "
                     "band 1.15–1.35 around the paper's 1.24, for orientation only)")
    assert _verdict(published_number("parallel_gpt2_large_delta_ce"), 0.1).verdict == "holds"


def _ablation(tan: float, rad: float = 8.1, zero: float = 8.5) -> AblationResult:
    return AblationResult(delta_loss={"tangential": tan, "radial": rad, "zero": zero},
                          ratio_to_zero={"radial": rad / zero})


def _row(html: str, claim_start: str) -> str:
    return next(r for r in html.split("<tr") if claim_start in r)


@pytest.mark.parametrize(("tan", "inside"), [(3.70, False), (0.9, True)])
def test_summary_table_shows_the_band_and_the_range_verdict(tan, inside):
    suite = SuiteResult(ablation=_ablation(tan))
    rows = {r["id"]: r for r in comparison_rows(suite)}
    assert rows["ablation_tangential"]["paper_range"] == [0.07, 1.72]
    assert rows["ablation_tangential"]["band"] == [0.007, 17.2]
    row = _row(summary_section(suite), "only its tangential part")
    assert "0.007–17.2<br>" in row  # the tolerance band itself is on the page
    assert "0.07 - 1.72" in row  # the paper's range
    assert ("inside the paper&#x27;s range 0.07–1.72" in row) is inside
    assert ("outside the paper&#x27;s range 0.07–1.72" in row) is (not inside)
    assert "(against the paper&#x27;s range)" in row


def test_ablation_claim_follows_the_numbers():
    c = _ablation(3.70).claim()
    assert c.verdict == "partly holds" and c.value == 3.70
    assert "tangential-only costs +3.7 nats (outside the paper's range 0.07–1.72" in c.why
    assert "the ordering holds (tangential-only is cheaper) but the tangential part does not preserve" in c.why
    assert _ablation(0.9).claim().verdict == "holds" and "tangential-only costs 9x less" in _ablation(0.9).claim().why
    assert _ablation(9.0).claim().verdict == "does not hold"
    assert _ablation(math.nan).claim().why.endswith("not judged (a variant was not run)")


def test_deficit_claim_is_the_ffn_improving_the_prediction():
    d = DeficitResult(mean=0.45, mean_ci=[0.44, 0.46], ffn_contribution_mean=0.2)
    c = d.claim()
    assert (c.verdict, c.value, c.interval) == ("holds", 0.45, (0.44, 0.46))
    assert "between the paper's GPT-2 and Llama-3-8B values" in c.why and "improves" in c.why and "20%" in c.why
    assert DeficitResult(mean=0.2, ffn_contribution_mean=-0.1).claim().verdict == "does not hold"
    assert "below the paper's GPT-2 value" in DeficitResult(mean=0.2).claim().why


def _executor(par: list[float], seq: list[float], ctrl: list[float]) -> ExecutorTiming:
    ex = ExecutorTiming(layers=[1, 2], device="cpu")
    ex.set_times(seq, ctrl, par)
    return ex


def _timed(speedup: float, lo: float, hi: float, clo: float = 0.95, chi: float = 1.05, rounds: int = 7,
           coverage: float = math.nan) -> ExecutorTiming:
    return ExecutorTiming(measured_speedup=speedup, speedup_interval=[lo, hi], speedup_control=1.0,
                          speedup_control_interval=[clo, chi], rounds=rounds, speedup_coverage=coverage)


def test_timing_claim_within_noise_when_the_interval_holds_one():
    assert timing_claim(_timed(1.05, 0.9, 1.3)).parts["status"] == "within noise"
    assert timing_claim(_timed(1.2, 1.1, 1.4)).verdict == "holds"  # faster
    # above 1 but overlapping the A/A control's spread: the comparison's own noise could give it
    assert timing_claim(_timed(1.1, 1.02, 1.2, 0.9, 1.05)).verdict == "undecided"
    assert timing_claim(_timed(0.8, 0.7, 0.9)).parts["status"] == "slower"
    assert timing_claim(_timed(1.3, 1.3, 1.3, rounds=1)).verdict == "not judged"  # one round: no spread
    v = timing_claim(ExecutorTiming(measured_speedup=1.257))  # one median per model: no spread
    assert v.verdict == "not judged" and "no spread" in v.why
    t = timing_claim(_timed(1.05, 0.9, 1.3, coverage=0.984))
    assert t.why == ("1.05 [0.9, 1.3] (98% interval, median of 7 alternating rounds; A/A control 1 [0.95, 1.05]): "
                     "within noise")


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
    assert timing_claim(fast).parts["status"] == "faster"
    noisy = _executor([1.0, 0.8, 1.1, 0.9, 1.0, 1.3, 0.85, 1.0, 0.9], seq, ctrl)
    lo, hi = noisy.speedup_interval
    assert lo <= 1 <= hi and timing_claim(noisy).parts["status"] == "within noise"
    c = parallel_claim(SuiteResult(executor=noisy, executor_choice=fast))
    assert c.verdict == "undecided"  # the lowest-C plan's
    assert "the lowest-C plan's whole forward is within noise of the original" in c.why
    assert "the chosen plan's faster (speedup 1.25 [1.25, 1.25])" in c.why
    old = ExecutorTiming(measured_speedup=1.257, t_forward_sequential_s=1.0, t_forward_parallel_s=0.8)
    assert timing_claim(old).verdict == "not judged"  # a result from before the rounds
    assert timing_claim(ExecutorTiming(status="skipped", reason="empty plan")).why == "skipped: empty plan"


def _gates(base: float, gated: float, calib_gain: float = 0.01) -> GateResult:
    return GateResult(layers=[1, 2], plan=[1, 2], gates=torch.ones(4, dtype=torch.float64), loss_clean_heldout=3.0,
                      loss_base_heldout=3.0 + base, loss_gated_heldout=3.0 + gated, loss_base_calib=3.5,
                      loss_gated_calib=3.5 - calib_gain)


def test_gates_claim_says_when_the_loss_is_not_recovered():
    g = _gates(0.2, 0.213)
    assert g.summary()["recovered_fraction_heldout"] == pytest.approx(-0.065)
    c = g.claim()
    assert c.verdict == "does not hold" and c.by == "ours"
    assert "the gates do not recover the loss held out: they make it worse" in c.why
    assert "recovered fraction -0.065" in c.why and "+0.2 → +0.213" in c.why
    assert "although they lower the calibration loss by 0.01 nats" in c.why
    assert "the gates recover 50% of the plan's loss held out" in _gates(0.2, 0.1).claim().why
    assert _gates(0.0, 0.0).claim().verdict == "not judged"
    assert set(SuiteResult(gates=g).claims()) == {"gates"}  # only the stages that ran


def test_defect_claim_reads_the_curves_or_the_plan():
    """The ordering against the published threshold (5x); the plan's dCE against its band (0-0.2)."""
    from tl_steering.parallel.defect_result import ordering_claim
    from tl_steering.suite.result import PlanLosses

    assert ordering_claim(2, 4, 0.01, 0.2).verdict == "holds"
    assert ordering_claim(2, 4, 0.5, 5.0).verdict == "partly holds"  # ordering holds, cost outside the band
    weak = ordering_claim(2, 4, 0.01, 0.03)
    assert weak.verdict == "partly holds" and "below the 5x threshold [I]" in weak.why
    assert ordering_claim(2, 4, 0.05, 0.01).verdict == "does not hold"
    assert ordering_claim(2, 4, 0.0, 0.1).verdict == "holds"  # only the control costs
    assert ordering_claim(2, 4, 0.0, 0.0).verdict == "not judged"
    curves = {"k": torch.tensor([0, 2]), "lowest": torch.tensor([0.0, 0.01], dtype=torch.float64),
              "highest": torch.tensor([0.0, 0.2], dtype=torch.float64)}
    d = DefectResult(layers=[0, 1, 2, 3], scores={"C": torch.rand(4, dtype=torch.float64)}, evaluated=True,
                     k_values=[0, 2], curves=curves)
    assert d.claim() == ordering_claim(2, 4, 0.01, 0.2)  # k defaults to half the candidates
    assert d.claim(1).verdict == "not judged" and "no loss curves at k = 1" in d.claim(1).why
    suite = SuiteResult(defect=DefectResult(), plan=PlanLosses(k=2, n_candidates=4, delta_ce_lowest=0.01,
                                                               delta_ce_highest=0.2))
    assert suite.claims()["defect"] == ordering_claim(2, 4, 0.01, 0.2)
    assert "no plan was made" in SuiteResult(defect=DefectResult()).claims()["defect"].why


def test_diversity_and_prefix_claims():
    d = DiversityResult(layers=[0, 1, 2, 3], attention_effect={"pairwise_cosine": torch.tensor([0.1, 0.2, 0.1, -0.1])},
                        ffn_effect={"pairwise_cosine": torch.tensor([-0.1, 0.1, 0.1, 0.1])},
                        final_diversity={"pairwise_cosine": 0.5},
                        final_diversity_under_ablation={"tangential": {"pairwise_cosine": 0.52},
                                                        "radial": {"pairwise_cosine": 0.9}})
    c = d.claim()
    assert d.tangential_preserves() is True
    assert c.verdict == "holds" and "75% of the layers (most)" in c.why and "25% (at least a quarter)" in c.why
    d.final_diversity_under_ablation["tangential"]["pairwise_cosine"] = 0.95
    assert d.claim().verdict == "partly holds" and "2 of 3 parts hold" in d.claim().why
    p = PrefixSensitivityResult(prefix_bitwise_equal=False, prefix_max_angle=1e-8)
    assert p.claim().verdict == "holds" and "(rounding)" in p.claim().why
    assert PrefixSensitivityResult(prefix_max_angle=0.3).claim().verdict == "does not hold"


def test_labels_lead_raw_keys_follow():
    out = labelled({"error_parallel_mean": 0.3, "r2_attention_mean": 0.5, "unknown_key": 1,
                    "flow: n_points": 3, "held-out dCE, C": 0.2})
    assert out == {"R² of the block's velocity explained by attention alone": 0.5,
                   "one-step angular error with attention + FFN, e_AF (rad)": 0.3,
                   "flow: distinct equilibria found": 3, "held-out ΔCE (nats) of the plan of strategy C": 0.2}


def test_a_result_missing_a_number_says_so():
    """A claim that cannot read its numbers (an older or foreign result) says so on the page."""
    broken = SuiteResult(gates=GateResult())
    broken.gates.summary = lambda: {"n_gates": 2}  # what an older or foreign result could hold
    c = broken.claims()["gates"]
    assert c.verdict == "not judged"
    assert c.sentence().startswith("No verdict: this result lacks what the verdict reads (KeyError")
