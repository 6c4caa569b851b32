"""Corpus-scale scans (tl_steering.scale): shards merge to the single-pass numbers, torchrun with 2 gloo
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
from tl_steering.corpus import stream_windows
from tl_steering.errors import InputError
from tl_steering.probing import ProbeResult
from tl_steering.scale import check_agreement, scan

LINE = "Residual streams move on a sphere while attention aggregates and the FFN steers.\n"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    p = tmp_path_factory.mktemp("scan") / "c.txt"
    p.write_text("".join(f"{i} {LINE}" for i in range(4000)))
    return p


@pytest.fixture(scope="module")
def model():
    return ts.tiny_model("gpt2", backend="bridge")


def _close(a: ProbeResult, b: ProbeResult, rtol: float = 1e-9) -> None:
    assert a.n_tokens == b.n_tokens and a.n_sequences == b.n_sequences
    assert set(a.sums) == set(b.sums)
    for q in a.sums:
        torch.testing.assert_close(a.sums[q], b.sums[q], rtol=rtol, atol=0.0)
        assert torch.equal(a.counts[q], b.counts[q]) and torch.equal(a.masked[q], b.masked[q])


def _run(args, env_extra=None, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, **kw)


def test_shards_merge_to_one_probe_over_the_same_windows(model, corpus, tmp_path):
    res = scan(model, str(corpus), n_windows=22, length=16, shard_windows=5, batch_size=3, out_dir=tmp_path)
    with ts.probe(model) as trace, torch.no_grad():
        for _, w in stream_windows(model, str(corpus), length=16, n_windows=22, batch_size=22):
            model(w.tokens, return_type=None)
    _close(res, trace.result())
    assert res.n_sequences == 22 and res.n_tokens == 22 * 16
    assert res.provenance.corpus == "file:c.txt:22x16" and res.provenance.world_size == 1
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [f"shard-{j:06d}.safetensors" for j in range(5)]
    assert ProbeResult.load(tmp_path / "result.json").n_tokens == 22 * 16
    with pytest.raises(InputError, match="already holds a scan"):
        scan(model, str(corpus), n_windows=22, length=16, shard_windows=5, out_dir=tmp_path)
    with pytest.raises(InputError, match=r"differs in: n_windows"):
        scan(model, str(corpus), n_windows=23, length=16, shard_windows=5, out_dir=tmp_path, resume=True)
    short = tmp_path / "short.txt"
    short.write_text(LINE * 4)  # ~20 windows of 16 byte-level tokens
    with pytest.raises(InputError, match="ended before window"):
        scan(model, str(short), n_windows=1000, length=16, shard_windows=50)


def test_torchrun_two_processes_equal_one(model, corpus, tmp_path):
    common = ["--model", "tiny-gpt2", "--source", str(corpus), "--windows", "30", "--length", "16",
              "--shard-windows", "4", "--batch-size", "4", "--no-progress"]
    one = _run([sys.executable, "-m", "tl_steering.scale", *common, "--out", str(tmp_path / "one")], timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "-m", "tl_steering.scale", *common, "--out", str(tmp_path / "two")], timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert json.loads(two.stdout.strip().splitlines()[-1])["world_size"] == 2
    a, b = ProbeResult.load(tmp_path / "one/result.json"), ProbeResult.load(tmp_path / "two/result.json")
    _close(a, b)
    assert a.provenance.world_size == 1 and b.provenance.world_size == 2
    assert b.provenance.extra["scan"]["dist_backend"] == "gloo"


def test_a_killed_scan_resumes_to_the_uninterrupted_numbers(model, corpus, tmp_path):
    n, shard = 120, 2
    args = [sys.executable, "-m", "tl_steering.scale", "--model", "tiny-gpt2", "--source", str(corpus),
            "--windows", str(n), "--length", "16", "--shard-windows", str(shard), "--batch-size", "2",
            "--no-progress", "--out", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    shards = tmp_path / "run" / "shards"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if shards.exists() and len(list(shards.glob("shard-*.safetensors"))) >= 3:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(shards.glob("shard-*.safetensors")))
    assert 3 <= done < n // shard, f"kill landed after {done} shards"
    assert not (tmp_path / "run" / "result.json").exists()
    resumed = _run(args + ["--resume"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    got = ProbeResult.load(tmp_path / "run" / "result.json")
    assert got.provenance.extra["scan"]["resumed_shards"] >= done - 1  # a half-written shard is never counted
    want = scan(model, str(corpus), n_windows=n, length=16, shard_windows=shard, batch_size=2)
    _close(got, want)


def test_ranks_that_disagree_fail_on_every_rank(tmp_path):
    script = tmp_path / "disagree.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "from tl_steering.scale import check_agreement, init_from_env, world\n"
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
