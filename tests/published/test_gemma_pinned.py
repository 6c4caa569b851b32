"""Pinned regression values measured by this package on Gemma-3-270M (tl_steering/reference/gemma3_pinned.json).

One module-scoped run of every pinned protocol on the session's Gemma model (the ``gemma`` fixture: bridge on
TL 4.x, HookedTransformer on TL 3.9) on 2 pydoc windows x 64 tokens (GEMMA_PINNED_SETTINGS), compared value by value
with the file's tolerance groups, and with the cross-backend acceptance of docs/gemma.md (BACKEND_TOLERANCES: rtol
1e-4 on geometry, 1e-4 nats on losses). The file is written from the TL 4.x bridge, so on TL 3.9 the second test is
the HookedTransformer-vs-bridge agreement on every pinned number; on TL 4.x it is run-to-run reproducibility.
Cost: one suite run of ~40 Gemma forwards of 2 x 64 tokens (see docs/gemma.md for the measured time); skips only
when the Gemma part packages are not installed. Regenerate: scripts/regenerate_pinned.py --model gemma-3-270m.
"""

import pytest

from tl_steering.reference import pinned_values
from tl_steering.reference.pinned import (
    BACKEND_TOLERANCES,
    GEMMA_PINNED_SETTINGS,
    compare,
    group_problems,
)
from tl_steering.suite.numbers import compute_pinned

pytestmark = [pytest.mark.published, pytest.mark.integration, pytest.mark.one_line("tl4")]

PINNED = pinned_values("gemma-3-270m")


@pytest.fixture(scope="module")
def measured(gemma):
    return compute_pinned(gemma, settings=GEMMA_PINNED_SETTINGS)


def test_settings_match_the_file():
    assert PINNED["settings"] == GEMMA_PINNED_SETTINGS
    assert PINNED["model"] == "gemma-3-270m"
    assert PINNED["generated_with"]["backend"] == "bridge"  # the cross-backend test below relies on it
    assert sorted(PINNED["values"]) == sorted(pinned_values()["values"])  # the same names as SmolLM2's


def test_every_pinned_value_is_computed(measured):
    assert sorted(measured) == sorted(PINNED["values"])


GROUPS = sorted({e["tol"] for e in PINNED["values"].values()})


@pytest.mark.parametrize("group", GROUPS)
def test_pinned_values(measured, group):
    """Every value of one tolerance group within |diff| <= abs + rel * |pinned|."""
    problems = group_problems(PINNED, measured, group)
    assert not problems, "\n".join(problems)


def test_backends_agree_on_every_pinned_number(measured):
    """The acceptance bound: rtol 1e-4 on geometry / ratios / gates / diversity, 1e-4 nats on losses."""
    problems = compare(PINNED, measured, tolerances=BACKEND_TOLERANCES)
    assert not problems, "\n".join(problems)


def test_claims_as_measured_on_gemma(measured):
    """docs/gemma.md's reading, asserted: the geometric claims hold, radial-only is NOT like removing the FFN (it is
    worse), and the half-depth plan is costly (more than 1 nat), unlike SmolLM2's."""
    v = {k: val for k, (val, _) in measured.items()}
    assert 0.3 < v["deficit.mean"] < 0.45 and v["deficit.ffn_contribution_mean"] > 0
    assert v["ablation.delta_loss.radial"] > 2 * v["ablation.delta_loss.tangential"]
    assert v["ablation.delta_loss.radial"] / v["ablation.delta_loss.zero"] > 2.0
    assert v["defect.plan_delta_ce"] > 1.0
