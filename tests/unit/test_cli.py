"""The CLI (tl_steering/cli.py): argument checks that fail fast in one line with exit code 2 and write nothing,
and ``render`` of a saved run."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tl_steering as ts
from tl_steering.cli import build_parser, check_report_args
from tl_steering.report import figures


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
        "nprocs": ["--nprocs", "0"],
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


@pytest.mark.parametrize("argv, env, expected", [
    ([], {"OMP_NUM_THREADS": "2"}, (2, 1)),  # the offline model on 2 cores: 2 ranks of one thread
    ([], {"OMP_NUM_THREADS": "8"}, (2, 4)),
    ([], {"OMP_NUM_THREADS": "1"}, (1, 1)),  # one core for torch: one process
    (["--model", "tiny-gpt2"], {"OMP_NUM_THREADS": "2"}, (1, 2)),  # a test model: start-up would cost more
    (["--device", "cuda"], {"OMP_NUM_THREADS": "2"}, (1, 2)),
    (["--nprocs", "3"], {"OMP_NUM_THREADS": "6"}, (3, 2)),
    (["--nprocs", "2"], {"OMP_NUM_THREADS": "2", "WORLD_SIZE": "2"}, (1, 2)),  # a torchrun rank already
])
def test_report_ranks(monkeypatch, argv, env, expected):
    """``report --nprocs``: how many local ranks and torch threads each (docs/scale_out.md)."""
    from tl_steering.cli import local_ranks

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert local_ranks(build_parser().parse_args(["report", *argv])) == expected


def test_a_failed_rank_stops_the_others(monkeypatch):
    """``report --nprocs N`` starts its ranks itself: the first to fail stops the others at once (none waits for a
    collective that never comes) and its exit code is the command's; each rank sees torchrun's environment."""
    import subprocess
    import time

    from tl_steering.cli import _launch_ranks

    rank = "import os, sys, time; e = os.environ; time.sleep(120) if e['RANK'] == '0' else sys.exit(3 + int(e['WORLD_SIZE']) * (e['MASTER_ADDR'] == '127.0.0.1'))"
    real = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, env: real([sys.executable, "-c", rank], env=env))
    t0 = time.monotonic()
    assert _launch_ranks(["report"], 2, 1) == 5
    assert time.monotonic() - t0 < 60


def test_the_rank_launcher_imports_no_torch(tmp_path):
    """``report`` on local ranks: the parent process checks the arguments and decides the ranks without importing
    torch (each rank imports it; the parent's import was 1.6 s of serial start-up)."""
    code = ("import sys\nfrom tl_steering.cli import build_parser, check_report_args, local_ranks\n"
            "args = build_parser().parse_args(['report', '--quick', '--out', sys.argv[1]])\n"
            "check_report_args(args)\nlocal_ranks(args)\nprint('torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False"]


# Run as ``python -m tl_steering``, then report which heavy libraries the failed call imported.
_CHILD = (
    "import runpy, sys\n"
    "try:\n"
    "    runpy.run_module('tl_steering', run_name='__main__')\n"
    "finally:\n"
    "    print(sorted(m for m in ('transformer_lens', 'transformers') if m in sys.modules))\n"
)


@pytest.mark.parametrize("case", ["windows", "text", "device", "backend"])
def test_cli_user_error_fails_fast_in_one_line(tmp_path, case):
    """``python -m tl_steering report <bad>``: exit code 2, one line on stderr, nothing written, and neither
    TransformerLens nor transformers imported: the argument is refused before any model is loaded. (How long the
    refusal takes is a benchmark, benchmarks/load_time.py ``--cli-errors``, not an assert.)"""
    out = tmp_path / "report_out"
    argv = [sys.executable, "-c", _CHILD, "report", "--out", str(out), *_bad_args(tmp_path)[case]]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists() and not (tmp_path / "figures").exists()
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


def test_render_subcommand_rerenders_a_saved_run(rendered, tmp_path):
    page, _ = rendered
    from tl_steering.cli import main

    assert main(["render", str(page.parent / "results.json"), "--out", str(tmp_path / "again")]) == 0
    again = (tmp_path / "again" / "index.html").read_text()
    assert again.count('class="plotly-graph-div"') == page.read_text().count('class="plotly-graph-div"')
    assert main(["render", str(tmp_path / "none.json")]) == 2
