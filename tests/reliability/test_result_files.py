"""Result files (docs/protocols.md, "Saving and loading results"): every public call's result survives save -> load
bit for bit under the strict loader; the three formats of earlier versions still load; a save killed at any moment
never leaves a pair that loads as something it is not."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tl_steering as ts
from tl_steering.errors import ResultFileError
from tl_steering.results import Result
from tl_steering.suite import SuiteResult

from ._calls import PUBLIC_CALLS, tokens_for

OLD = Path(__file__).parent / "old_results"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model():
    return ts.tiny_model("gpt2", backend="bridge", seed=0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = torch.view_as_real(t.resolve_conj()) if t.is_complex() else t
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a, b) -> bool:
    """Bit for bit: tensors by dtype, shape and bytes, floats by repr (NaN, -0.0)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a),
                                                                                                          _bits(b))
    if isinstance(a, float):
        return isinstance(b, float) and repr(a) == repr(b) and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


# critical_points is left out: one call takes ~10 s on a tiny model (its own tests round-trip its results)
@pytest.mark.parametrize("name", [k for k in PUBLIC_CALLS if not k.startswith("hooks.")
                                  and k not in ("parallelize", "text_tokens", "critical_points")])
def test_result_round_trips_bit_for_bit(model, name, tmp_path):
    res = PUBLIC_CALLS[name](model, tokens_for(model))
    assert isinstance(res, Result), type(res)
    back = type(res).load(res.save(tmp_path / "r.json"))
    assert _same(res, back)


def old_suite():
    """The result the files in old_results/ hold: a SuiteResult with tensors inline, in the plan's corrections
    and nested (NaN and -0.0 among them), saved by the codec before the one format (commit 3352d5c) as
    ``suite.json`` + ``suite.tensors.safetensors`` (the plan's corrections in a sidecar, the rest inline),
    ``suite.safetensors`` (the whole result in one safetensors file) and ``deficit.json`` (every tensor inline)."""
    from tl_steering.protocols.deficit import DeficitResult
    from tl_steering.results import Provenance
    from tl_steering.suite.result import PlanChoice, SuiteResult

    g = torch.Generator().manual_seed(0)
    prov = Provenance(model="m", seed=1, package_version="0.1.0", torch_version="2", python_version="3",
                      created="2026-12-01T00:00:00Z")
    plan = ts.ParallelPlan(layers=[1, 3], k=2, strategy="C", refit="linear", provenance=prov,
                           gates=torch.tensor([0.5, -0.0], dtype=torch.float64),
                           biases=torch.randn(2, 4, generator=g, dtype=torch.float64),
                           linears=torch.randn(2, 4, 4, generator=g, dtype=torch.float64),
                           calibration_curves={"C": torch.tensor([0.0, float("nan"), 0.25], dtype=torch.float64)})
    deficit = DeficitResult(layers=[0, 1], parallel=[False, False], provenance=prov,
                            deficit=torch.tensor([0.125, float("nan")], dtype=torch.float64),
                            deficit_ci=torch.randn(2, 2, generator=g, dtype=torch.float64))
    return SuiteResult(deficit=deficit, plan_choice=PlanChoice(plan=plan, lowest_c_layers=[0, 1]), provenance=prov,
                       started="2026-12-01T00:00:00Z")


def test_files_of_earlier_versions_load(tmp_path):
    """The three earlier formats load bit for bit (``suite.json`` finds its sidecar among two safetensors files by
    its hash) and save again in the one format."""
    want = old_suite()
    sidecar, whole = SuiteResult.load(OLD / "suite.json"), Result.load(OLD / "suite.safetensors")
    assert "__tensor__" in (OLD / "suite.json").read_text()  # the inline tensors of that format
    for got in (sidecar, whole):
        assert _same(got.plan_choice.plan, want.plan_choice.plan) and _same(got.deficit, want.deficit)
        assert got.to_dict() == whole.to_dict() and got.started == want.started
    assert _same(Result.load(OLD / "deficit.json"), want.deficit)
    again = SuiteResult.load(sidecar.save(tmp_path / "suite.json"))
    assert _same(again, sidecar) and "__tensor__" not in (tmp_path / "suite.json").read_text()


SAVER = """
import sys, torch
from tl_steering.results import Provenance, Result
path, n = sys.argv[1], int(sys.argv[2])
i = 0
while True:
    i += 1
    big = torch.full((n,), float(i), dtype=torch.float64)
    Result(provenance=Provenance(model=str(i), extra={"check": big})).save(path)
    print(i, flush=True)
"""


def test_a_killed_save_never_leaves_a_pair_that_loads_wrong(tmp_path):
    """A process saving result i = 1, 2, ... (each a 16 MB tensor filled with i, its model named i) to the same
    path is killed (SIGKILL) at an arbitrary moment, three times: the pair then loads as one whole result (model
    i, tensor all i) or raises ResultFileError (new tensors beside the previous JSON); never a mix."""
    path = tmp_path / "r.json"
    for delay in (0.0, 0.13, 0.31):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(path), str(2 * 1024 * 1024)], cwd=ROOT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "1"  # one whole save done
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        try:
            back = Result.load(path)
        except ResultFileError as e:
            assert "SHA-256 differs" in str(e), e
            continue
        i = float(back.provenance.model)
        check = back.provenance.extra["check"]
        assert check.shape == (2 * 1024 * 1024,) and bool((check == i).all()), back.provenance.model
        assert json.loads(path.read_text())["provenance"]["model"] == back.provenance.model
