"""Tokens/s of the resumable probe scan (tl_steering.probing.scan) against the number of processes.

    python benchmarks/scale_scan.py --model smollm2-135m --nprocs 1,2 --windows 64 --length 128
    python benchmarks/scale_scan.py --device cuda --nprocs 1,2,4,8 ...     (a GPU machine: NCCL, one GPU a rank)

Each row runs ``torchrun --standalone --nproc_per_node=N -m tl_steering.probing.scan`` (N = 1 runs it without torchrun)
in a fresh output directory, with OMP_NUM_THREADS = cores / N on CPU so that the processes share the cores
instead of oversubscribing them, and reports the wall time of the whole command (model load included) and of
the scan alone (from the result's token count and the scan's own time stamps), tokens/s and the speedup over
N = 1. It checks that every row's numbers equal the N = 1 row (max relative difference of the probe sums).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tl_steering.probing.trace import ProbeResult  # noqa: E402


def run(n: int, args: argparse.Namespace, out: Path) -> tuple[float, ProbeResult]:
    cmd = ([sys.executable, "-m", "tl_steering.probing.scan"] if n == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
            "-m", "tl_steering.probing.scan"])
    cmd += ["--model", args.model, "--source", args.source, "--windows", str(args.windows), "--length",
            str(args.length), "--shard-windows", str(args.shard_windows), "--batch-size", str(args.batch_size),
            "--out", str(out), "--no-progress"]
    if args.device:
        cmd += ["--device", args.device]
    env = dict(os.environ)
    if not args.device or not args.device.startswith("cuda"):
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"nproc={n} failed:\n{p.stderr[-3000:]}")
    return wall, ProbeResult.load(out / "result.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--source", default="pydoc")
    ap.add_argument("--nprocs", default="1,2")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--shard-windows", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.nprocs.split(",")]:
            wall, res = run(n, args, Path(tmp) / f"n{n}")
            diff = 0.0
            if base is None:
                base = res
            else:
                diff = max(float(((res.sums[q] - base.sums[q]).abs() / base.sums[q].abs().clamp_min(1e-300)).max())
                           for q in res.sums)
            rows.append({"nproc": n, "wall_s": wall, "tokens": res.n_tokens, "tok_per_s": res.n_tokens / wall,
                         "max_rel_diff_vs_1": diff, "world_size": res.provenance.world_size})
    t1 = rows[0]["wall_s"]
    print(f"probe scan, {args.model}, {args.windows}x{args.length} tokens of {args.source}, "
          f"device {args.device or 'cpu'}, {os.cpu_count()} cores, torch {torch.__version__}")
    print("| processes | wall s (load included) | tokens/s | speedup | max rel. diff vs 1 process |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['nproc']} | {r['wall_s']:.1f} | {r['tok_per_s']:.0f} | {t1 / r['wall_s']:.2f}x | "
              f"{r['max_rel_diff_vs_1']:.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
