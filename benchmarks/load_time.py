"""Cold vs warm ``load_model`` time of an offline GGUF model, and bit-identity of the cached weights.

Each measurement is a fresh subprocess (``import tl_steering`` included, as a user or a test session pays it):

* ``cold``: an empty weight cache (a temporary ``TL_STEERING_CACHE``): dequantize the GGUF through transformers,
  write the cache entry, build the model;
* ``warm``: the same cache, now filled: hash the GGUF, verify the entry, read ``model.safetensors``, build.

Wall and process CPU time (all threads) are printed: on a shared machine CPU time is the steadier number.

Then one more subprocess dequantizes the GGUF in memory (the cold path's builder, no cache) and checks that every
tensor of the warm-loaded Hugging Face model is bitwise equal to it (tied weights included).

Run: ``.venv-tl4/bin/python benchmarks/load_time.py [--model smollm2-135m] [--backend bridge] [--repeats 3]``.
Prints one line per run and a summary; exits 1 if the weights differ. See docs/loading.md.

``--cli-errors``: instead, how long ``python -m tl_steering report`` takes to refuse a bad argument (wall and the
child's CPU time, per case; the goal is well under 5 s of CPU: the refusal comes before any model is loaded, which
tests/unit/test_cli.py asserts).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD_LOAD = """
import sys, time
t0, c0 = time.perf_counter(), time.process_time()
import tl_steering as ts
t1, c1 = time.perf_counter(), time.process_time()
ts.load_model(sys.argv[1], backend=sys.argv[2])
t2, c2 = time.perf_counter(), time.process_time()
print(f"RESULT {t1 - t0:.2f} {t2 - t1:.2f} {c1 - c0:.2f} {c2 - c1:.2f}")
"""

CHILD_IDENTITY = """
import sys, tempfile, torch
from pathlib import Path
from tl_steering.backends import loading as L
name = sys.argv[1]
path = L._gguf_path(name)
cold, _ = L._dequantize_gguf(name, path, "", Path(tempfile.mkdtemp()))
warm = L._offline_hf(name, torch.float32)[0].state_dict()
assert sorted(cold) == sorted(warm), (set(cold) ^ set(warm))
bad = [k for k in cold if cold[k].dtype != warm[k].dtype or cold[k].shape != warm[k].shape
       or not torch.equal(cold[k].reshape(-1).view(torch.uint8), warm[k].reshape(-1).view(torch.uint8))]
print(f"IDENTITY {len(cold)} tensors, {len(bad)} differ {bad[:5]}")
sys.exit(1 if bad else 0)
"""


def _run(code: str, args: list[str], env: dict[str, str]) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr[-3000:] if p.returncode else p.stdout, time.perf_counter() - t0


CLI_ERRORS = {"windows": ["--windows", "1"], "text": ["--text", "missing.txt"], "device": ["--device", "bogus"],
              "backend": ["--backend", "nope"]}


def cli_errors() -> int:
    """Wall and CPU seconds of the CLI's refusal of each bad argument (a fresh process each)."""
    import resource

    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for case, extra in CLI_ERRORS.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "tl_steering", "report", "--out", f"{tmp}/out", *extra],
                               cwd=tmp, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            worst = max(worst, cpu)
            print(f"{case:8s} exit {p.returncode}  wall {wall:5.2f} s  CPU {cpu:5.2f} s")
    print(f"summary: worst CPU {worst:.2f} s (goal < 5 s)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--backend", default="bridge")
    ap.add_argument("--repeats", type=int, default=3, help="warm loads (each a fresh process)")
    ap.add_argument("--cli-errors", action="store_true", help="time the CLI's refusal of bad arguments instead")
    args = ap.parse_args()
    if args.cli_errors:
        return cli_errors()
    env = dict(os.environ, TL_STEERING_CACHE=tempfile.mkdtemp(prefix="tlsteering-bench-cache-"))
    rows = []
    for i in range(1 + args.repeats):
        kind = "cold" if i == 0 else "warm"
        rc, out, wall = _run(CHILD_LOAD, [args.model, args.backend], env)
        if rc:
            print(out)
            return 1
        line = next(l for l in out.splitlines() if l.startswith("RESULT"))
        imp, load, imp_cpu, load_cpu = (float(x) for x in line.split()[1:])
        rows.append((kind, imp, load, wall, load_cpu))
        print(f"{kind}: import {imp:6.2f} s (CPU {imp_cpu:6.2f} s)  load_model {load:6.2f} s (CPU {load_cpu:6.2f} s)"
              f"  process {wall:6.2f} s", flush=True)
    warm = [r for r in rows if r[0] == "warm"]
    print(f"summary {args.model} ({args.backend}): cold load_model {rows[0][2]:.1f} s (import+load "
          f"{rows[0][1] + rows[0][2]:.1f} s); warm median load_model {statistics.median(r[2] for r in warm):.1f} s "
          f"(import+load {statistics.median(r[1] + r[2] for r in warm):.1f} s) over {len(warm)} processes; load_model "
          f"CPU time cold {rows[0][4]:.1f} s, warm median {statistics.median(r[4] for r in warm):.1f} s")
    rc, out, _ = _run(CHILD_IDENTITY, [args.model], env)
    print(next((l for l in out.splitlines() if l.startswith("IDENTITY")), out))
    return rc


if __name__ == "__main__":
    sys.exit(main())
