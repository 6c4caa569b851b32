"""Cost of a streaming probe on SmolLM2-135M (8 x 128 pydoc tokens by default), against a plain forward and the cache
route.

Three variants:

* ``plain``: ``model(tokens)`` under ``torch.no_grad()``;
* ``probe``: the same forward inside ``tl_steering.probe(model)`` with the default metrics (``--metrics all``: every
  metric) on every layer (hooks
  attached and removed inside each timed repeat);
* ``cache``: ``model.run_with_cache(tokens, names_filter=<the 5 residual/branch sites of every layer>)`` then
  the same metrics computed afterwards from the cache (``ProbeTrace.add_cache``: the probe's own arithmetic,
  so only the route differs).

Time: one subprocess runs the three variants interleaved, ``--repeats`` (>= 5) times after a warm-up each, each
timed run right after an untimed run of the same variant, the variants' order rotating over their 6 orders
(``--order fixed``: plain, probe, cache every repeat, no untimed runs; docs/probe.md "Cost" says why), and
reports the medians of wall and process-CPU seconds (CPU time is the steadier number on a shared machine) and the
median over repeats of each repeat's ratio to the plain forward run next to it (the load of a shared machine
changes between repeats more than within one). ``--profile``: also the CPU seconds per forward spent in each part
of the probe (its hooks' copies, the layer update, token quantities, per-sequence sums and eigenproblems, entry,
exit and result), from thread CPU time around those functions in one more interleaved run.
Memory: one subprocess (``sys.executable``) per variant; ``ru_maxrss`` of that subprocess (model loading
included, so a ceiling) and the peak RSS of one run above the RSS just before it (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``; where that is not allowed, a 2 ms RSS sampler), with glibc's mmap threshold fixed
at 128 KiB in those subprocesses so that freed buffers leave RSS (otherwise the warm-up run's pages stay resident
and every variant reads the same peak).

Run: ``.venv-tl4/bin/python benchmarks/probe_overhead.py [--repeats 5] [--backend bridge] [--threads N]
[--model smollm2-135m|gemma-3-270m] [--windows 8] [--length 128] [--metrics a,b] [--profile] [--no-memory]
[--steady-malloc] [--order rotate|fixed]``
(``--threads``: torch intra-op threads in every subprocess; default: torch's own default). The per-sequence spectra of the diversity metric cost O(length^3) per
sequence against the forward's O(length) (plus attention's O(length^2)), so the ratio grows with ``--length``.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one

VARIANTS = ("plain", "probe", "cache")


def _rss_kib(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _rss_kib("VmHWM") <= _rss_kib("VmRSS") + 1024


class _Sampler:
    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_kib())
            time.sleep(0.002)

    def __enter__(self) -> "_Sampler":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_kib())


def _setup(backend: str, threads: int | None = None, model_name: str = "smollm2-135m", windows: int = 8,
           length: int = 128, metrics: list[str] | None = None):
    import torch

    if threads:
        torch.set_num_threads(threads)

    import tl_steering as ts
    from tl_steering.backends import adapt
    from tl_steering.probing.trace import probe

    model = ts.load_model(model_name, backend=backend)
    tokens = ts.text_tokens(model, n_windows=windows, length=length)
    ad = adapt(model)
    names = {name for layer in ad.layers() for _, name in probe(model, metrics=metrics)._sites_of[layer]}

    def run(variant: str) -> None:
        with torch.no_grad():
            if variant == "plain":
                model(tokens)
            elif variant == "probe":
                with probe(model, metrics=metrics) as trace:
                    model(tokens)
                trace.result()
            else:
                _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
                probe(model, metrics=metrics).add_cache(cache).result()
                del cache

    info = {"threads": torch.get_num_threads(), "tokens": list(tokens.shape), "backend": backend,
            "model": model_name, "metrics": metrics}
    return run, info


def child_memory(variant: str, backend: str, threads: int | None = None, **shape) -> dict:
    """One variant in this process: warm-up, reset the RSS high-water mark, one more run."""
    import gc

    run, info = _setup(backend, threads, **shape)
    run(variant)
    gc.collect()
    base = _rss_kib()
    hwm = _reset_hwm()
    with _Sampler() as sampler:
        run(variant)
    peak = max(_rss_kib("VmHWM") if hwm else 0, sampler.peak)
    return {**info, "variant": variant, "run_peak_mib": (peak - base) / 1024,
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_method": "VmHWM" if hwm else "sampler"}


def child_timing(repeats: int, backend: str, threads: int | None = None, profile: bool = False,
                 fixed_order: bool = False, **shape) -> dict:
    """All variants in one process, interleaved, so that the load of a shared machine hits them alike; each timed
    run follows an untimed run of the same variant (a user's probed forwards follow each other: what ran before decides
    how many of a forward's large buffers glibc serves from pages it already holds, docs/probe.md "Cost"), and repeat
    i takes the variants in the i-th of their 6 orders; ``fixed_order``: plain, probe, cache every repeat, each timed
    run right after the previous variant's (the design before 2026-12-08). Wall and process-CPU seconds.
    ``profile``: then the CPU seconds per forward of the probe's parts (:func:`_probe_parts`)."""
    import itertools

    run, info = _setup(backend, threads, **shape)
    for v in VARIANTS:
        run(v)
    orders = [VARIANTS] if fixed_order else list(itertools.permutations(VARIANTS))
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    faults: dict[str, list[int]] = {v: [] for v in VARIANTS}
    for i in range(repeats):
        for v in orders[i % len(orders)]:
            if not fixed_order:
                run(v)
            t0, c0, f0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            run(v)
            wall[v].append(time.perf_counter() - t0)
            cpu[v].append(time.process_time() - c0)
            faults[v].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {**info, "wall": wall, "cpu": cpu, "faults": faults,
            "parts": _probe_parts(run, repeats) if profile else {}}


def _probe_parts(run, repeats: int) -> dict[str, float]:
    """Thread CPU seconds per probed forward inside the probe's parts (the calling thread's share where the kernels
    split over two threads), over ``repeats`` probed forwards interleaved with plain ones."""
    import functools

    import torch

    from tl_steering.probing import kernels, trace

    spent: dict[str, float] = {}
    parts = {"hooks: per-layer metrics (all below)": (trace.ProbeTrace, "_update"),
             "  one-pass kernel (dot products, direction sums)": (trace, "one_pass"),
             "  float64 copies (without the one-pass kernel)": (trace.ProbeTrace, "_buffer"),
             "  diversity sums of this thread's half (all below)": (trace, "diversity_sums"),
             "    Gram matrices (numpy dsyrk)": (kernels, "gram_sets"), "    eigvalsh": (torch.linalg, "eigvalsh"),
             "  the forward's layers in one batch (all below)": (trace.ProbeTrace, "_flush"),
             "    token quantities": (trace, "token_quantities"),
             "    diversity from its sums": (trace, "diversity"),
             "probe(): set-up": (trace.ProbeTrace, "__init__"), "entry (hook guard, hooks)": (trace.ProbeTrace, "__enter__"),
             "exit (hook restore)": (trace.ProbeTrace, "__exit__"), "result (provenance)": (trace.ProbeTrace, "result")}
    saved = []
    for label, (owner, name) in parts.items():
        fn = getattr(owner, name)

        def timed(*a, _fn=fn, _label=label, **k):
            c0 = time.thread_time()
            try:
                return _fn(*a, **k)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.thread_time() - c0

        saved.append((owner, name, fn))
        setattr(owner, name, functools.wraps(fn)(timed))
    try:
        for _ in range(repeats):
            run("plain")
            run("probe")
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return {label: spent.get(label, 0.0) / repeats for label in parts}


# glibc keeps freed heap pages resident and raises its mmap threshold after the first large free, so the RSS
# before a second run already holds the first run's peak and "peak above it" reads ~0 for every variant (seen on
# HookedTransformer: 300/300/302 MiB). A fixed threshold sends every buffer >= 128 KiB to its own mmap, returned
# to the OS on free: RSS then follows live memory. Memory children only (mmap per buffer costs time).
_EXACT_RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
# --steady-malloc (timing child): glibc keeps freed memory (no mmap per large buffer, no trim), so that no forward
# pays page faults for buffers the one before returned to the OS; which variant pays them otherwise depends on the
# heap's state (docs/probe.md, "Cost")
_STEADY_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
                      "MALLOC_TOP_PAD_": str(1 << 28)}


def _child(args: list[str], env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
                         cwd=Path(__file__).resolve().parents[1])
    line = [s for s in out.stdout.splitlines() if s.startswith("RESULT ")]
    if out.returncode != 0 or not line:
        sys.exit(f"{args} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[0][7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="bridge", choices=["bridge", "hooked"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "gemma-3-270m"],
                    help="an offline model (gemma-3-270m needs its GGUF packages, scripts/setup_env.sh)")
    ap.add_argument("--windows", type=int, default=8, help="sequences per forward (default 8)")
    ap.add_argument("--length", type=int, default=128, help="tokens per sequence (default 128)")
    ap.add_argument("--metrics", default="", help="comma-separated probe metrics, or 'all' (default: the probe's "
                    "default, DEFAULT_METRICS)")
    ap.add_argument("--profile", action="store_true", help="also the CPU seconds of the probe's parts per forward")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    ap.add_argument("--steady-malloc", action="store_true", help="time with glibc's mmap and trim thresholds at 1 GiB "
                    "(no page faults from buffers returned to the OS between forwards)")
    ap.add_argument("--order", default="rotate", choices=["rotate", "fixed"], help="rotate (default): each timed run "
                    "after an untimed one of the same variant, repeat i in the i-th of the 6 orders; fixed: plain, "
                    "probe, cache every repeat, no untimed runs (before 2026-12-08)")
    ap.add_argument("--child", choices=["timing", *VARIANTS], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 5:
        ap.error("use at least 5 repeats")
    shape = {"model_name": args.model, "windows": args.windows, "length": args.length,
             "metrics": (args.metrics if args.metrics == "all" else args.metrics.split(",")) if args.metrics else None}
    if args.child == "timing":
        print("RESULT " + json.dumps(child_timing(args.repeats, args.backend, args.threads, args.profile,
                                                         args.order == "fixed", **shape)),
              flush=True)
        return
    if args.child:
        print("RESULT " + json.dumps(child_memory(args.child, args.backend, args.threads, **shape)), flush=True)
        return
    common = ["--backend", args.backend, "--threads", str(args.threads), "--model", args.model,
              "--windows", str(args.windows), "--length", str(args.length), "--metrics", args.metrics]
    timing = _child(["--child", "timing", "--repeats", str(args.repeats), *common, "--order", args.order,
                     *(["--profile"] if args.profile else [])], _STEADY_MALLOC_ENV if args.steady_malloc else None)
    nan = {"run_peak_mib": float("nan"), "maxrss_mib": float("nan"), "peak_method": "not measured"}
    mem = {v: nan if args.no_memory else _child(["--child", v, *common], _EXACT_RSS_ENV) for v in VARIANTS}
    med = {k: {v: statistics.median(timing[k][v]) for v in VARIANTS} for k in ("wall", "cpu")}
    ratio = {k: {v: statistics.median(a / b for a, b in zip(timing[k][v], timing[k]["plain"])) for v in VARIANTS}
             for k in ("wall", "cpu")}
    print(f"{timing['model']} ({timing['backend']}), tokens {timing['tokens'][0]}x{timing['tokens'][1]}, torch threads "
          f"{timing['threads']}; medians of {args.repeats} interleaved repeats ({args.order} order) after 1 warm-up; "
          f"{'metrics ' + args.metrics if args.metrics else 'the default metrics'}, all layers")
    print(f"{'variant':<24}{'wall s':>8}{'x plain':>9}{'cpu s':>8}{'x plain':>9}{'wall min..max':>16}"
          f"{'run peak MiB':>14}{'maxrss MiB':>12}")
    labels = {"plain": "plain forward", "probe": "forward in probe", "cache": "run_with_cache + metrics"}
    for v in VARIANTS:
        w, c = med["wall"][v], med["cpu"][v]
        rng = f"{min(timing['wall'][v]):.2f}..{max(timing['wall'][v]):.2f}"
        print(f"{labels[v]:<24}{w:>8.2f}{w / med['wall']['plain']:>9.2f}{c:>8.2f}{c / med['cpu']['plain']:>9.2f}"
              f"{rng:>16}{mem[v]['run_peak_mib']:>14.0f}{mem[v]['maxrss_mib']:>12.0f}")
    print("median over repeats of the ratio to the plain forward of the same repeat, wall / CPU: "
          + ", ".join(f"{v} {ratio['wall'][v]:.3f} / {ratio['cpu'][v]:.3f}" for v in VARIANTS[1:]))
    print("minor page faults per forward (median): " + ", ".join(
        f"{v} {statistics.median(timing['faults'][v]):.0f}" for v in VARIANTS)
        + (" (--steady-malloc)" if args.steady_malloc else ""))
    if timing["parts"]:
        print(f"CPU s per probed forward by part (plain forward {med['cpu']['plain']:.3f} CPU s):")
        for label, sec in timing["parts"].items():
            print(f"  {label:<40}{sec:>8.3f}")
    print(f"(run peak: peak RSS of one run above the RSS before it, via {mem['plain']['peak_method']}, one "
          "subprocess per variant, glibc mmap threshold fixed at 128 KiB so that RSS follows live memory; "
          "maxrss: ru_maxrss of that subprocess, model loading included)")


if __name__ == "__main__":
    main()
