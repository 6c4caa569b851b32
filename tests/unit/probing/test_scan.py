"""Corpus-scale scans (tl_steering.probing.scan): shards merge to the single-pass numbers, torchrun with 2 gloo
processes equals one process, a killed run resumes to the uninterrupted result, ranks that disagree fail."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tl_steering as ts
from tl_steering.data.corpus import stream_windows
from tl_steering.errors import InputError, ModelNotSupportedError
from tl_steering.probing.trace import ProbeResult
from tl_steering.probing import scan as scale
from tl_steering.probing.scan import check_agreement, scan
from tl_steering.suite.schedule import WINDOW_STAGES
from tl_steering._util.threads import single_threaded

LINE = "Residual streams move on a sphere while attention aggregates and the FFN steers.\n"
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    p = tmp_path_factory.mktemp("scan") / "c.txt"
    p.write_text("".join(f"{i} {LINE}" for i in range(4000)))
    return p


@pytest.fixture(scope="module")
def model():
    return ts.tiny_model("gpt2", backend="bridge")


EPS32 = torch.finfo(torch.float32).eps


def _close(a: ProbeResult, b: ProbeResult, same_batches: bool = True) -> None:
    """``a`` and ``b`` probed the same windows. With the same batch shapes (``same_batches``) every float32 activation
    is the same, and only the float64 sums' order differs: 1e-9 relative. With other batch shapes the float32 forward
    itself may round differently (a matmul kernel blocks the rows of a [3, ...] batch and a [22, ...] one differently
    under AVX2; AVX-512 happened to agree bit for bit): each per-token value then agrees to a few float32 roundings,
    128 eps32 relative, and a sum of n of them (the probe stores sums) to n times that in absolute terms."""
    assert a.n_tokens == b.n_tokens and a.n_sequences == b.n_sequences
    assert set(a.sums) == set(b.sums)
    for q in a.sums:
        assert torch.equal(a.counts[q], b.counts[q]) and torch.equal(a.masked[q], b.masked[q])
        if same_batches:
            torch.testing.assert_close(a.sums[q], b.sums[q], rtol=1e-9, atol=0.0)
            continue
        bound = 128 * EPS32 * (b.sums[q].abs() + b.counts[q].to(torch.float64))
        assert bool(((a.sums[q] - b.sums[q]).abs() <= bound).all()), (q, a.sums[q], b.sums[q])


def _run(args, env_extra=None, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, **kw)


def test_shards_merge_to_one_probe_over_the_same_windows(model, corpus, tmp_path):
    res = scan(model, str(corpus), n_windows=22, length=16, shard_windows=5, batch_size=3, out_dir=tmp_path)
    with ts.probe(model) as trace, torch.no_grad():
        for _, w in stream_windows(model, str(corpus), length=16, n_windows=22, batch_size=22):
            model(w.tokens, return_type=None)
    _close(res, trace.result(), same_batches=False)  # the scan's batches of 3 against one batch of 22
    assert res.n_sequences == 22 and res.n_tokens == 22 * 16
    assert res.provenance.corpus == "file:c.txt:22x16" and res.provenance.world_size == 1
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [f"shard-{j:06d}{s}" for j in range(5)
                                                                       for s in (".json", ".safetensors")]
    assert ProbeResult.load(tmp_path / "result.json").n_tokens == 22 * 16
    with pytest.raises(InputError, match="already holds a scan"):
        scan(model, str(corpus), n_windows=22, length=16, shard_windows=5, out_dir=tmp_path)
    with pytest.raises(InputError, match=r"differs in: n_windows"):
        scan(model, str(corpus), n_windows=23, length=16, shard_windows=5, out_dir=tmp_path, resume=True)
    short = tmp_path / "short.txt"
    short.write_text(LINE * 4)  # ~20 windows of 16 byte-level tokens
    with pytest.raises(InputError, match="ended before window"):
        scan(model, str(short), n_windows=1000, length=16, shard_windows=50)


@pytest.mark.one_line("tl3")  # process orchestration on the tiny model: the same on both lines
def test_torchrun_two_processes_equal_one(model, corpus, tmp_path):
    common = ["--model", "tiny-gpt2", "--source", str(corpus), "--windows", "30", "--length", "16",
              "--shard-windows", "4", "--batch-size", "4", "--no-progress"]
    one = _run([sys.executable, "-m", "tl_steering.probing.scan", *common, "--out", str(tmp_path / "one")], timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "-m", "tl_steering.probing.scan", *common, "--out", str(tmp_path / "two")], timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert json.loads(two.stdout.strip().splitlines()[-1])["world_size"] == 2
    a, b = ProbeResult.load(tmp_path / "one/result.json"), ProbeResult.load(tmp_path / "two/result.json")
    _close(a, b)
    assert a.provenance.world_size == 1 and b.provenance.world_size == 2
    assert b.provenance.extra["scan"]["dist_backend"] == "gloo"


@pytest.mark.one_line("tl3")  # process orchestration on the tiny model: the same on both lines
def test_a_killed_scan_resumes_to_the_uninterrupted_numbers(model, corpus, tmp_path):
    n, shard = 120, 2
    args = [sys.executable, "-m", "tl_steering.probing.scan", "--model", "tiny-gpt2", "--source", str(corpus),
            "--windows", str(n), "--length", "16", "--shard-windows", str(shard), "--batch-size", "2",
            "--no-progress", "--out", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    shards = tmp_path / "run" / "shards"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if shards.exists() and len(list(shards.glob("shard-*.json"))) >= 3:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(shards.glob("shard-*.json")))
    assert 3 <= done < n // shard, f"kill landed after {done} shards"
    assert not (tmp_path / "run" / "result.json").exists()
    resumed = _run(args + ["--resume"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    got = ProbeResult.load(tmp_path / "run" / "result.json")
    assert got.provenance.extra["scan"]["resumed_shards"] >= done - 1  # a half-written shard is never counted
    want = scan(model, str(corpus), n_windows=n, length=16, shard_windows=shard, batch_size=2)
    _close(got, want)


@pytest.mark.one_line("tl3")  # process orchestration on the tiny model: the same on both lines
def test_ranks_that_disagree_fail_on_every_rank(tmp_path):
    script = tmp_path / "disagree.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "from tl_steering.probing.scan import check_agreement, init_from_env, world\n"
        "from tl_steering.errors import InputError\n"
        "init_from_env()\n"
        "try:\n"
        "    check_agreement({'model': 'm', 'n_windows': 10 + world().rank})\n"
        "except InputError as e:\n"
        "    print('REFUSED', e)\n"
        "dist.destroy_process_group()\n")
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
               timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # both ranks print to one pipe, so their lines may interleave: count the marker, not the lines
    assert out.stdout.count("REFUSED") == 2, out.stdout
    assert "disagree on n_windows" in out.stdout and "rank 1=11" in out.stdout
    check_agreement({"anything": 1})  # one process: nothing to disagree with


# ----------------------------------------------------------------------------------------------------------
# the sharded report (docs/scale_out.md, "The sharded report")

_TIMED = ("seconds", "t_", "timing", "wall", "cpu_s", "started", "speedup", "measured", "threads")


def _floats(x):
    """Every float in a saved result's field (nested dicts and lists)."""
    if isinstance(x, dict):
        return [f for v in x.values() for f in _floats(v)]
    if isinstance(x, (list, tuple)):
        return [f for v in x for f in _floats(v)]
    if isinstance(x, torch.Tensor):
        return x.double().flatten().tolist()
    return [float(x)] if isinstance(x, float) else []


def _same(a, b, path="", rtol=1e-6, seen=None):
    """Every number of two saved results equal (relative ``rtol``), timings and run metadata left out."""
    seen = seen if seen is not None else [0]
    last = path.rsplit(".", 1)[-1]
    if any(t in last for t in _TIMED) or last in ("provenance", "distributed", "environment", "arguments"):
        return seen[0]
    if path.startswith(".critical") and last in ("residuals", "max_residual"):  # a verified point's relative residual is roundoff below the finder's tol: both must be
        from tl_steering.critical.options import DEFAULT_OPTIONS  # under it, not equal (thread counts sum apart)

        for x in (a, b):
            assert max(_floats(x), default=0.0) <= DEFAULT_OPTIONS.tol, path
        return seen[0]
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}", rtol, seen)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            _same(u, v, f"{path}[{i}]", rtol, seen)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=rtol, atol=0.0, equal_nan=True, msg=path)
        seen[0] += a.numel()
    elif isinstance(a, float):
        assert (a != a and b != b) or a == pytest.approx(b, rel=rtol, abs=0.0), f"{path}: {a} != {b}"
        seen[0] += 1
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
    return seen[0]


def _suite_inputs(name, windows, length, batch, stages, plan_strategy="C", quick=True, backend="bridge",
                  overrides=None, model=None):
    """Model, token windows and settings of the suite runs compared below (the same in both processes)."""
    import dataclasses

    from tl_steering.data.windows import text_windows
    from tl_steering.probing.scan import load_named
    from tl_steering.suite import default_settings

    model = load_named(name, backend, None) if model is None else model
    s = default_settings(ts.backends.adapt(model).n_layers, quick=quick, windows=windows, length=length)
    s = dataclasses.replace(s, batch_size=batch, stages=list(stages), n_bootstrap=100, timing_repeats=1,
                            parallel_repeats=1, critical_n_starts=2, plan_strategy=plan_strategy,
                            **(overrides or {}))
    return model, text_windows(model, source="pydoc", n_windows=windows, length=length, seed=0), s


_RANK = """
import sys, json, torch
from tests.unit.probing.test_scan import _suite_inputs
from tl_steering.probing.scan import init_from_env
from tl_steering.data.sharding import world
from tl_steering.suite import run_suite
init_from_env()
if len(sys.argv) > 3:  # a fixed placement: the ranks' code paths, whatever the cost model says
    import tl_steering.suite.run as run
    placed = json.loads(sys.argv[3])
    run.assign_stages = lambda names, *a: {n: tuple(placed[n]) for n in names}
model, tokens, s = _suite_inputs(*json.loads(sys.argv[1]))
res = run_suite(model, tokens, s, progress=False, seed=0)
if world().rank == 0:
    res.save(sys.argv[2])
torch.distributed.destroy_process_group()
"""


def _assert_stages_split(two, stages, former_rank0, want):
    """Both ranks ran stages, as placed (``want``: stage -> ranks), and the stages that once ran on rank 0 alone
    are no longer all there."""
    ranks = two.distributed.stage_ranks
    assert ranks == {n: list(want[n]) for n in stages}
    assert {r for rs in ranks.values() for r in rs} == {0, 1}, ranks
    assert any(ranks[n] != [0] for n in former_rank0), ranks
    assert two.distributed.rank0_stages == [n for n in stages if ranks[n] == [0]]
    assert two.distributed.sharded_stages == [n for n in stages if ranks[n] == [0, 1]]
    assert set(two.timings) == set(stages)  # every stage's timing reached rank 0, wherever it ran


def _two_ranks_vs_one(tmp_path, inputs, model=None, placed=None):
    """Run the suite on 2 gloo ranks (torchrun; ``placed``: stage -> ranks instead of the schedule's placement)
    and in this process; both results, the second from torchrun."""
    from tl_steering.suite import SuiteResult, run_suite

    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    two = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
                json.dumps(inputs), str(tmp_path / "two.json"), *([json.dumps(placed)] if placed else [])],
               env_extra={"PYTHONPATH": str(ROOT)}, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    m, tokens, s = _suite_inputs(*inputs, model=model)
    with single_threaded():  # the ranks' one thread (_run): float32 forwards sum alike only at equal thread counts
        one = run_suite(m, tokens, s, progress=False, seed=0)
    return one, SuiteResult.load(tmp_path / "two.json")


_ALL = ["checks", "deficit", "ablation", "diversity", "defect", "plan_choice", "parallel", "gates", "critical", "prefix"]


@pytest.mark.one_line("tl3")  # process orchestration on the tiny model: the same on both lines
@pytest.mark.parametrize("stages,batch", [(_ALL, 2), ([n for n in _ALL if n != "plan_choice"], 2),
                                          ([n for n in _ALL if n != "plan_choice"], 6)],
                         ids=["every-stage", "mixed", "mixed-one-batch"])
def test_suite_on_two_processes_equals_one_process(tmp_path, stages, batch):
    """run_suite under torchrun (2 gloo ranks; 6 windows in batches of 2; plan_strategy="best": every planner)
    gives the same numbers as one process: every field of every protocol, the bootstrap intervals, the plan.
    The placement is fixed here (on the tiny model the schedule puts its costly critical points alone on one
    rank; tests/unit/suite/test_schedule.py tests the schedule). Every stage: plan_choice and parallel on rank 0,
    the other stages on rank 1 (plan_choice waits for rank 1's defect at its end, parallel for checks, defect and
    plan_choice). Without plan_choice ("mixed"): the window stages split their batches over both ranks (rank 0
    runs batches 0 and 2, rank 1 batch 1) and the critical points their two layers (one a rank), the other stages
    run on one rank each. With one batch of 6 ("mixed-one-batch") rank 1 has no batch: the window stages run on rank
    0 alone inside the split, and the defect stage splits its layers instead (every rank runs the batch for its
    layers). Cost: ~80 s each on 2 loaded cores (mostly the ranks' start-up)."""
    extra: list = []
    if "plan_choice" in stages:
        placed = {n: [0] if n in ("plan_choice", "parallel") else [1] for n in stages}
    else:
        placed = {n: [0, 1] if n in (*WINDOW_STAGES, "critical") else [0] if n in ("parallel", "gates") else [1]
                  for n in stages}
        extra = [True, "bridge", {"critical_layers": [0, 1]}]
    one, two = _two_ranks_vs_one(tmp_path, ["tiny-gpt2", 6, 16, batch, stages, "best", *extra], placed=placed)
    assert (one.distributed.world_size, one.distributed.backend) == (1, "none")
    assert (two.distributed.world_size, two.distributed.backend) == (2, "gloo") and two.provenance.world_size == 2
    _assert_stages_split(two, stages, ["parallel", "gates", "critical", "prefix"], placed)
    ranks = two.distributed.stage_ranks
    if "plan_choice" in stages:  # a stage that reads another rank's stage (the late read of the defect plan)
        assert len(ranks["plan_choice"]) == len(ranks["defect"]) == 1 and ranks["plan_choice"] != ranks["defect"]
    else:  # window stages and the critical layers split over both ranks beside stages on one rank
        assert two.distributed.sharded_stages and any(len(r) == 1 for r in ranks.values()), ranks
        assert list(two.critical.layers) == [0, 1] and two.critical.n_points.sum() > 0
    assert two.planner is not None and list(two.planner.layers) == list(one.planner.layers)
    n = _same(one.to_dict(), two.to_dict())
    assert n > 500  # the comparison walked the protocols' tensors, not an empty dict
    ha, hb = one.summary(), two.summary()
    for k in ("clean_loss", "deficit_mean", "deficit_mean_ci", "ablation_delta_loss_tangential", "defect_C_min"):
        assert ha[k] == hb[k], k  # same batches, same forwards, same window order: bit for bit here


@pytest.mark.one_line("tl3")  # the lines balance within the budget; the backend is the fixture's
def test_suite_on_two_processes_equals_one_process_smollm2(smollm2, tmp_path):
    """The sharded stages on SmolLM2-135M (4 windows of 16 tokens, batches of 2: one per rank): clean loss,
    deficit, ablation and the defect scores equal the one-process numbers. The gold standard's plans split over
    the ranks are compared on the tiny model above (on SmolLM2 they cost ~170 bridge forwards, ~2 minutes here;
    run with ``defect_evaluate=True`` they agreed as well, see docs/scale_out.md). Cost: each rank loads SmolLM2
    from the weight cache, then ~20 forwards."""
    stages = ["checks", "deficit", "ablation", "defect"]
    backend = "hooked" if type(smollm2).__name__ == "HookedTransformer" else "bridge"  # the fixture's
    small = {"defect_evaluate": False, "defect_brackets": True, "defect_timing": False}
    one, two = _two_ranks_vs_one(tmp_path, ["smollm2-135m", 4, 16, 2, stages, "C", False, backend, small],
                                 smollm2)
    assert two.distributed.world_size == 2 and two.distributed.rank0_stages == []
    assert two.distributed.sharded_stages == stages  # one batch per rank: every stage splits its windows
    assert _same(one.to_dict(), two.to_dict()) > 500
    for k, v in one.summary().items():
        if isinstance(v, float) and "speedup" not in k and v == v:
            assert two.summary()[k] == pytest.approx(v, rel=1e-6, abs=0.0), k


@pytest.mark.one_line("tl4")  # the launcher and the ranks' agreement: the same on both lines (about 20 s)
def test_report_command_on_two_processes_equals_one_process(tmp_path):
    """``tl-steering report --nprocs 2`` end to end (it starts 2 gloo ranks itself): rank 0 alone writes
    results.json and index.html, with the one-process numbers."""
    from tl_steering.cli import run_report
    from tl_steering.suite import SuiteResult

    args = ["--model", "tiny-gpt2", "--quick", "--windows", "6", "--length", "16", "--batch-size", "2",
            "--no-progress"]
    two = _run([sys.executable, "-m", "tl_steering", "report", *args, "--nprocs", "2", "--out", str(tmp_path / "two")],
               timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert (tmp_path / "two" / "index.html").is_file() and two.stdout.count("report written") == 1
    with single_threaded():  # the ranks' one thread (OMP_NUM_THREADS=1 from _run): the same float32 sums
        run_report(model="tiny-gpt2", quick=True, windows=6, length=16, batch_size=2, out=tmp_path / "one",
                   progress=False)
    a = SuiteResult.load(tmp_path / "one" / "results.json")
    b = SuiteResult.load(tmp_path / "two" / "results.json")
    assert (b.distributed.world_size, b.distributed.backend) == (2, "gloo")
    assert _same(a.to_dict(), b.to_dict()) > 500


# ----------------------------------------------------------------------------------------------------------
# a report killed mid-run resumes (docs/suite.md, "Resuming")

_KILLED = """
import os, signal, sys, json
from tests.unit.probing.test_scan import _suite_inputs
from tl_steering.suite import run as suite_run
fn, total = suite_run.STAGE_FUNCTIONS[sys.argv[3]]
def kill(c, res, tick):
    os.kill(os.getpid(), signal.SIGKILL)  # as the machine would: no cleanup, no exception handler runs
suite_run.STAGE_FUNCTIONS[sys.argv[3]] = (kill, total)
model, tokens, s = _suite_inputs(*json.loads(sys.argv[1]))
suite_run.run_suite(model, tokens, s, progress=False, seed=0, checkpoint=sys.argv[2])
"""

_RESUME_INPUTS = ["tiny-gpt2", 6, 16, 2, ["checks", "deficit", "ablation", "diversity", "defect", "gates", "prefix"]]


@pytest.mark.one_line("tl3")  # process orchestration on the tiny model: the same on both lines
def test_a_killed_suite_resumes_to_the_uninterrupted_numbers(tmp_path, monkeypatch):
    """SIGKILL at the start of the diversity stage: the checkpoint holds checks, deficit and ablation; the resumed
    run runs only the other stages and every number equals an uninterrupted run's."""
    from tl_steering.suite import SuiteResult, run as suite_run

    cp = tmp_path / "checkpoint.json"
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    killed = _run([sys.executable, str(script), json.dumps(_RESUME_INPUTS), str(cp), "diversity"],
                  env_extra={"PYTHONPATH": str(ROOT)}, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    partial = SuiteResult.load(cp)
    assert list(partial.timings) == ["checks", "deficit", "ablation"] and partial.diversity is None
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp.json")]  # atomic writes: no leftovers

    calls = []
    for name, (fn, total) in list(suite_run.STAGE_FUNCTIONS.items()):
        def counted(c, res, tick, fn=fn, name=name):
            calls.append(name)
            fn(c, res, tick)
        monkeypatch.setitem(suite_run.STAGE_FUNCTIONS, name, (counted, total))
    model, tokens, s = _suite_inputs(*_RESUME_INPUTS)
    resumed = suite_run.run_suite(model, tokens, s, progress=False, seed=0, checkpoint=cp)
    assert calls == ["diversity", "defect", "gates", "prefix"]
    assert resumed.provenance.extra["resumed_stages"] == ["checks", "deficit", "ablation"]
    monkeypatch.undo()
    whole = suite_run.run_suite(model, tokens, s, progress=False, seed=0)
    assert _same(whole.to_dict(), resumed.to_dict()) > 300
    assert whole.summary()["deficit_mean_ci"] == resumed.summary()["deficit_mean_ci"]

    # a checkpoint of another run is refused, naming what differs
    with pytest.raises(InputError, match="differs in seed"):
        suite_run.run_suite(model, tokens, s, progress=False, seed=1, checkpoint=cp)


# ----------------------------------------------------------------------------------------------------------
# a model bigger than one device: accelerate's dispatch / offload (docs/scale_out.md, "Models bigger than one device")


def test_an_offloaded_model_scans_like_the_model_in_memory(corpus, tmp_path):
    """A tiny Llama whose odd layers accelerate offloads to disk (weights on the meta device, loaded by its hooks
    at each forward) wraps into a bridge with its placement kept; the probe scan, the deficit, the loss and the FFN
    ablation equal those of the same weights in memory, and a call that recomputes a sublayer outside the forward
    refuses the offloaded layer by name (TL 4.x; TL 3.9's bridge refuses disk offload, with a clear error). Moving
    such a model is refused."""
    import warnings

    from accelerate import dispatch_model

    from tl_steering.backends import adapt, tl_version, weights_fingerprint
    from tl_steering.backends.loading import tiny_hf_model
    from tl_steering.backends import wrap_hf

    hf, tok = tiny_hf_model("llama")
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    ref = wrap_hf(hf, tok, "bridge", "raw", None, label="inmemory")
    hf2, _ = tiny_hf_model("llama")
    hf2.load_state_dict(state)
    placement = {"model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu", "model.rotary_emb": "cpu"}
    placement.update({f"model.layers.{i}": "disk" if i % 2 else "cpu" for i in range(hf2.config.num_hidden_layers)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf2 = dispatch_model(hf2, device_map=placement, offload_dir=str(tmp_path / "offload"))
    with pytest.raises(InputError, match="dispatched over devices by accelerate"):
        wrap_hf(hf2, tok, "bridge", "raw", "cpu", label="offloaded")
    if tl_version().startswith("3."):  # TL 3.9's bridge refuses disk offload: a clear error
        with pytest.raises(ModelNotSupportedError, match="offloaded to disk"):
            wrap_hf(hf2, tok, "bridge", "raw", None, label="offloaded")
        return
    off = wrap_hf(hf2, tok, "bridge", "raw", None, label="offloaded")
    assert any(p.device.type == "meta" for p in off.parameters())  # really offloaded
    fp = weights_fingerprint(off)

    a = scan(ref, str(corpus), n_windows=6, length=16, shard_windows=3, batch_size=3, out_dir=tmp_path / "a")
    b = scan(off, str(corpus), n_windows=6, length=16, shard_windows=3, batch_size=3, out_dir=tmp_path / "b")
    _close(a, b)  # the same batches: the same float32 activations (accelerate only moves weights)
    t = torch.randint(1, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ts.angular_deficit(ref, t, n_bootstrap=0).deficit, ts.angular_deficit(off, t, n_bootstrap=0).deficit)
    assert float(adapt(ref).loss_per_token(t).mean()) == float(adapt(off).loss_per_token(t).mean())
    ab_ref = ts.ffn_ablation(ref, t, n_bootstrap=0, include_random_tangent=False).delta_loss
    ab_off = ts.ffn_ablation(off, t, n_bootstrap=0, include_random_tangent=False).delta_loss
    assert ab_ref == ab_off  # the ablation hooks act inside the forward, where accelerate loads the weights
    # a sublayer recomputed from the weights outside the forward: a clear refusal naming the offloaded layer
    with pytest.raises(ModelNotSupportedError, match="layer 1: its weights are offloaded by accelerate.*parallel_defect"):
        ts.parallel_defect(off, t)
    assert weights_fingerprint(off) == fp


def test_resume_keeps_the_metrics_of_the_shards_written_so_far(model, corpus, tmp_path):
    """A scan resumed after the probe gained a metric (metrics=None: "all" at the start) or after a shard's
    metrics were upgraded on load measures the remaining shards as the finished ones, so that they merge: the
    resumed result equals the uninterrupted scan with those metrics. Simulated by resuming with other metrics
    than the finished shards have: all metrics against shards of three, and a subset of theirs."""
    old = ["resid_norm", "diversity", "effective_rank"]
    kw = dict(n_windows=8, length=16, shard_windows=2, batch_size=2)
    want = scan(model, str(corpus), metrics=old, **kw)
    for asked in (None, ["diversity"]):
        out = tmp_path / f"run-{asked}"
        scan(model, str(corpus), metrics=old, out_dir=out, **kw)
        for f in sorted((out / "shards").glob("shard-*.json"))[2:]:
            f.unlink()  # killed after two shards
            f.with_suffix(".safetensors").unlink()
        (out / "result.json").unlink()
        manifest = json.loads((out / "scan.json").read_text())
        manifest["digest"] = scale._digest({**manifest["settings"], "metrics": asked})
        manifest["settings"]["metrics"] = asked
        (out / "scan.json").write_text(json.dumps(manifest))
        got = scan(model, str(corpus), metrics=asked, out_dir=out, resume=True, **kw)
        assert got.metrics == old and got.provenance.extra["scan"]["resumed_shards"] == 2
        _close(got, want)
