"""The census (docs/critical_points.md section 11): Chao1 bounds on the stable points, saddles found from below."""

import math

import numpy as np
import pytest
import torch

from tl_steering.critical.census import CensusResult, census
from tests.planted import planted_field
from tl_steering.errors import InputError
from tl_steering.stats import chao1

pytestmark = pytest.mark.one_line("tl4")  # pure torch, no TransformerLens: the same computation on both lines


def test_chao1_against_the_formulas_by_hand():
    # S_obs 5, n 8, f1 3, f2 1: unseen 3*2/(2*2) = 1.5; var = 1.5 + 3*25/16 + 9*1*4/(4*16) = 6.75;
    # K = exp(1.959964 * sqrt(log(1 + 6.75 / 2.25))) = exp(1.959964 * sqrt(log 4)) = 10.0507
    out = chao1([1, 1, 1, 2, 3])
    assert (out["observed"], out["draws"], out["f1"], out["f2"]) == (5, 8, 3, 1)
    assert out["estimate"] == pytest.approx(6.5, abs=1e-12)
    k = math.exp(1.959964 * math.sqrt(math.log(4.0)))
    assert out["ci_low"] == pytest.approx(5 + 1.5 / k, rel=1e-5) and out["ci_high"] == pytest.approx(5 + 1.5 * k, rel=1e-5)
    assert out["ci_high"] == pytest.approx(20.076, abs=1e-3)
    # no singleton: the estimate is what was seen, the bound S/(1-P) + z sqrt(S P/(1-P)), P = exp(-n/S)
    out = chao1([5, 5, 5])
    p = math.exp(-15 / 3)
    assert out["estimate"] == 3 and out["ci_low"] == 3
    assert out["ci_high"] == pytest.approx(3 / (1 - p) + 1.959964 * math.sqrt(3 * p / (1 - p)), rel=1e-6)
    assert chao1([])["estimate"] == 0 and chao1([0, 0])["observed"] == 0


def test_census_supports_mostly_saddles_on_the_planted_field():
    # 16 equilibria: 2 attractors, 2 repellers, 12 saddles (indices 1, 2, 3, 6, 9, 10)
    p = planted_field(12, seed=0)
    out = census(p, 12, n_starts=32, seed=0)
    assert isinstance(out, CensusResult) and out.equilibria.n_points == 16
    assert out.attractors["observed"] == 2 and out.repellers["observed"] == 2 and out.saddles == 12
    # every random start's power rows land on the attractors (F) and repellers (-F): 32 draws each, no singleton
    assert out.attractors["draws"] == 32 and out.repellers["draws"] == 32 and out.attractors["f1"] == 0
    assert out.non_saddles_high == pytest.approx(out.attractors["ci_high"] + out.repellers["ci_high"])
    assert 4.0 <= out.non_saddles_high < 4.01
    assert out.verdict == "supported" and out.share_low == pytest.approx(12 / (12 + out.non_saddles_high))
    assert out.summary()["verdict"] == "supported"
    # the claim: mostly saddles holds, but the 2 attractors contradict "not attractors"
    c = out.claim()
    assert c.verdict == "partly holds" and c.value == out.share_low and c.interval == (out.share_low, 1.0)
    assert "12 saddles found" in c.why and "2 attractors were found" in c.why


def test_census_of_a_run_with_token_starts_samples_the_basins_from_its_random_starts_only():
    """critical_points' runs start half their rows at token directions (a biased sample of the basins):
    census_of counts only the random starts' power rows; a point reached only from given starts is a singleton."""
    from tl_steering.critical import find_equilibria
    from tl_steering.critical.census import census_of

    p = planted_field(12, seed=0)
    given = torch.randn(16, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    run = find_equilibria(p, 12, n_starts=48, starts=given, seed=0)  # 16 given, 32 random starts
    out = census_of(run)
    assert out.attractors["draws"] == 32 and out.repellers["draws"] == 32  # the 16 given rows of each sign left out
    assert out.saddles == run.labels.count("saddle") == 12 and out.verdict == "supported"
    alone = census_of(find_equilibria(p, 12, n_starts=16, starts=given, seed=0))  # no random start at all
    assert alone.attractors["f1"] == alone.attractors["observed"] == 2 and alone.attractors["draws"] == 2
    assert census(p, 12, n_starts=32, seed=0).summary() == census_of(
        find_equilibria(p, 12, n_starts=32, seed=0, options={"landscape_solves": 256})).summary()
    with pytest.raises(InputError, match="census_of takes an EquilibriaResult"):
        census_of(out)
    with pytest.raises(InputError, match="level must be in"):
        census_of(run, level=1.5)


def test_census_does_not_decide_when_saddles_are_few():
    # S^2 with a symmetric linear field: 2 attractors, 2 repellers, 2 saddles: saddles are a third
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((3, 3)))
    a = torch.tensor(q @ np.diag([-1.0, 0.5, 2.0]) @ q.T)
    out = census(lambda u: u @ a.T, 3, n_starts=24, seed=0)
    assert out.saddles == 2 and out.attractors["observed"] == 2 and out.repellers["observed"] == 2
    assert out.verdict == "not decided" and out.share_low < 0.5
    assert out.claim().verdict == "undecided" and "not decided" in out.claim().why


def test_census_runs_the_one_finder_and_checks_its_arguments():
    p = planted_field(12, seed=0)
    out = census(p, 12, n_starts=4, seed=0, landscape_solves=8, options={"edge_pairs": 2})
    assert out.equilibria.method == "landscape" and out.equilibria.options["landscape_solves"] == 8
    assert out.equilibria.options["edge_pairs"] == 2 and out.equilibria.options["given_starts"] == 0
    with pytest.raises(InputError, match="unknown finder options"):
        census(p, 12, options={"method": "flow"})
    with pytest.raises(InputError, match="landscape_solves"):
        census(p, 12, landscape_solves=-1)
    with pytest.raises(InputError, match="level"):
        census(p, 12, level=1.5)


def test_census_result_saves_and_loads_in_a_fresh_process(tmp_path):
    import subprocess
    import sys

    p = planted_field(12, seed=0)
    out = census(p, 12, n_starts=8, seed=0, landscape_solves=64)
    path = out.save(tmp_path / "census.json")
    back = CensusResult.load(path)
    assert back.summary() == out.summary() and back.equilibria.labels == out.equilibria.labels
    assert torch.equal(back.equilibria.points, out.equilibria.points) and back.attractors == out.attractors
    # a fresh process finds the kind by importing the package (tl_steering.results.import_result_modules)
    code = ("import sys, tl_steering.results as r; x = r.Result.load(sys.argv[1]); "
            "print(type(x).__name__, x.verdict, x.saddles)")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["CensusResult", out.verdict, str(out.saddles)]
