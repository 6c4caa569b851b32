"""The report's time, stage by stage, with its forward counts, and the probe's overhead, in one run (issue 17).

    python benchmarks/report_time.py [--model smollm2-135m] [--quick] [--before OLD/results.json] [--probe]
                                     [--out DIR] [--json out.json] [--nprocs 1,2 --rounds 2] [--plain]

1. Runs ``tl-steering report`` (this checkout's CLI, in a subprocess, so the model load and the page rendering are
   counted as a user sees them) and prints the whole command's wall time, the suite's total, and per stage the wall
   and CPU seconds, the forward passes and their tokens (``results.json`` ``timings``). ``--before`` puts the same
   columns of an earlier ``results.json`` beside them (a results file from before 2026-12-04 has no forward counts:
   shown as "-").
   ``--plain``: a plain 8 x 128 forward timed before and after (subprocesses), and the command's wall time in
   those forwards (a unit that follows the machine's load).
2. ``--probe``: runs ``benchmarks/probe_overhead.py --repeats 5 --model MODEL`` (a subprocess of its own) and
   prints its probe / plain-forward ratios.

3. ``--nprocs 1,2``: the same command on each number of processes in turn (its own ``--nprocs N``, one torch
   thread per process), ``--rounds`` times interleaved, and each N's
   median whole-command time over N = 1's; with the stage -> ranks placement of the last N-process run.

Measure on idle cores: every figure is a wall time.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _timings(path: Path) -> tuple[dict, float]:
    """``(timings by stage as dicts, total_wall_s)`` of a report's results.json (the saved SuiteResult)."""
    import dataclasses

    from tl_steering.suite import SuiteResult

    suite = SuiteResult.load(path)
    return {k: dataclasses.asdict(v) for k, v in suite.timings.items()}, float(suite.total_wall_s)


def _fmt(t: dict | None) -> str:
    if t is None:
        return "| | | |"
    fw = t.get("forwards", -1)
    tok = t.get("tokens", -1)
    return f"| {t['wall_s']:.1f} | {t['cpu_s']:.1f} | {fw if fw >= 0 else '-'} ({tok if tok >= 0 else '-'}) |"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default="pydoc")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--before", default=None, help="an earlier results.json to compare with")
    ap.add_argument("--probe", action="store_true", help="also run benchmarks/probe_overhead.py --repeats 5")
    ap.add_argument("--out", default=None, help="report directory (default: a temporary one)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--nprocs", default=None, help="e.g. 1,2: interleaved runs on 1 and 2 processes, their ratio")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--report-nprocs", default="auto", help="the report's own --nprocs (default auto: 2 local ranks "
                    "on a 2+ core CPU for the offline models)")
    ap.add_argument("--plain", action="store_true",
                    help="also time a plain 8 x 128 forward (median of 3, a subprocess) before and after the report, "
                         "and give the command's time in those forwards")
    args = ap.parse_args(argv)
    if args.nprocs:
        return _scaling(args, [int(n) for n in args.nprocs.split(",")])
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="tlsteering-report-time-"))
    cmd = [sys.executable, "-m", "tl_steering", "report", "--model", args.model, "--text", args.text,
           "--out", str(out), "--no-progress", "--nprocs", args.report_nprocs] + (["--quick"] if args.quick else [])
    plain = [_plain_forward(args.model, args.text)] if args.plain else []
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"report failed ({p.returncode}):\n{p.stderr[-3000:]}")
    if args.plain:
        plain.append(_plain_forward(args.model, args.text))
        unit = sum(plain) / 2
        print(f"# plain 8 x 128 forward: {plain[0]:.2f} s before, {plain[1]:.2f} s after: the command took "
              f"{wall / unit:.1f} plain forwards")
    now, total = _timings(out / "results.json")
    before, total_before = _timings(Path(args.before)) if args.before else ({}, float("nan"))
    print(f"# {' '.join(cmd[2:])}: {wall:.1f} s for the whole command, suite {total:.1f} s"
          + (f" (before: suite {total_before:.1f} s)" if args.before else ""))
    head = "| stage | wall s | CPU s | forwards (tokens) |"
    if args.before:
        head += " before: wall s | CPU s | forwards (tokens) |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name in list(now) + [n for n in before if n not in now]:
        line = f"| {name} " + _fmt(now.get(name))
        if args.before:
            line += _fmt(before.get(name))[1:]
        print(line)
    result = {"command_wall_s": wall, "suite_wall_s": total, "timings": now, "before": before or None,
              "plain_forward_s": plain or None}
    if args.probe:
        q = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probe_overhead.py"), "--repeats", "5",
                            "--model", args.model], cwd=ROOT, capture_output=True, text=True)
        print(f"\n# probe_overhead.py --repeats 5 --model {args.model}")
        print(q.stdout[-2500:] if q.returncode == 0 else f"failed:\n{q.stderr[-2000:]}")
        result["probe_stdout"] = q.stdout
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def _plain_forward(model: str, text: str) -> float:
    """Median wall seconds of 3 plain forwards of 8 x 128 tokens (after one warm-up), in a fresh subprocess."""
    code = ("import statistics, time, torch\n"
            "from tl_steering.probing.scan import load_named\nfrom tl_steering.data.windows import text_windows\n"
            f"m = load_named({model!r}, 'bridge', None)\n"
            f"t = text_windows(m, source={text!r}, n_windows=8, length=128, seed=0)\nt = getattr(t, 'tokens', t)\n"
            "ts = []\nwith torch.no_grad():\n    for _ in range(4):\n        t0 = time.perf_counter(); "
            "m(t, return_type='logits'); ts.append(time.perf_counter() - t0)\nprint(statistics.median(ts[1:]))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
    if p.returncode != 0:
        raise SystemExit(f"plain forward failed:\n{p.stderr[-2000:]}")
    return float(p.stdout.strip().splitlines()[-1])


def _scaling(args: argparse.Namespace, nprocs: list[int]) -> dict:
    """Whole-command wall time of the report on each number of processes, interleaved ``args.rounds`` times."""
    import statistics

    from tl_steering.suite import SuiteResult

    walls: dict[int, list[float]] = {n: [] for n in nprocs}
    placement: dict = {}
    for _ in range(args.rounds):
        for n in nprocs:
            out = Path(tempfile.mkdtemp(prefix=f"tlsteering-report-{n}p-"))
            # the command's own --nprocs N: N ranks of OMP_NUM_THREADS / N = one thread each
            env = {**os.environ, "OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}
            cmd = [sys.executable, "-m", "tl_steering", "report", "--model", args.model, "--text", args.text, "--out",
                   str(out), "--no-progress", "--nprocs", str(n)] + (["--quick"] if args.quick else [])
            t0 = time.perf_counter()
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
            walls[n].append(time.perf_counter() - t0)
            if p.returncode != 0:
                raise SystemExit(f"report on {n} processes failed ({p.returncode}):\n{p.stderr[-3000:]}")
            if n > 1:
                placement = SuiteResult.load(out / "results.json").distributed.stage_ranks
    base = statistics.median(walls[nprocs[0]])
    print("| processes | runs (s) | median s | ratio to " + f"{nprocs[0]} |\n|---|---|---|---|")
    for n in nprocs:
        med = statistics.median(walls[n])
        print(f"| {n} | {', '.join(f'{w:.0f}' for w in walls[n])} | {med:.1f} | {med / base:.2f} |")
    print(f"stage -> ranks ({nprocs[-1]} processes): {placement}")
    result = {"walls": walls, "placement": placement}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
