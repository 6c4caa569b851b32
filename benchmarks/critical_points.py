"""Critical points of every SmolLM2-135M layer's FFN field at the default radius (docs/critical_points.md).

Prints, per layer: starts, converged starts (relative residual <= 1e-10), distinct equilibria, label counts,
rotational points / pairs, Morse index histogram, seconds, and the "mostly saddles" verdict with its exact
Clopper-Pearson interval; then the pooled verdict. ``--forwards``: each layer's call is also timed in plain forwards
(one forward of 8 x 128 pydoc tokens in this process), the CPU and wall seconds of the call over the median of 3
plain forwards run before it and 3 after it (interleaved, so a shared machine's load changes both alike).

    .venv-tl4/bin/python benchmarks/critical_points.py [--layers 0 5 10] [--n-starts 16] [--threads 2] [--forwards]
"""

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

import _common  # noqa: F401 - puts this checkout first on sys.path
import tl_steering as ts
from tl_steering.critical import CriticalPointsResult


def in_forwards(model: Any, call: Callable[[], Any], what: str) -> Any:
    """``call()``, printing its CPU and wall seconds over the median of 3 plain forwards (8 x 128 pydoc tokens)
    run before it and 3 after it in this process."""
    tokens = ts.text_tokens(model, n_windows=8, length=128)

    def clocks() -> tuple[float, float]:
        return time.process_time(), time.perf_counter()

    def plain() -> list[float]:
        c0, w0 = clocks()
        with torch.no_grad():
            model(tokens)
        c1, w1 = clocks()
        return [c1 - c0, w1 - w0]

    before = [plain() for _ in range(3)]
    c0, w0 = clocks()
    out = call()
    c1, w1 = clocks()
    runs = before + [plain() for _ in range(3)]
    med = [sorted(x[k] for x in runs)[len(runs) // 2] for k in (0, 1)]
    print(f"{what}: {(c1 - c0) / med[0]:.1f} plain forwards of CPU, {(w1 - w0) / med[1]:.1f} of wall (plain forward "
          f"{med[0]:.2f} CPU s, {med[1]:.2f} s; the call {c1 - c0:.1f} CPU s)", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--backend", default="bridge")
    p.add_argument("--layers", type=int, nargs="*", default=None)
    p.add_argument("--n-starts", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-iter", type=int, default=None, help="LM iterations per start (default: the finder's)")
    p.add_argument("--json", default=None, help="write the CriticalPointsResult here (.json / .safetensors)")
    p.add_argument("--forwards", action="store_true", help="also each layer's CPU and wall time in plain forwards")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    model = ts.load_model(a.model, backend=a.backend)
    print(f"loaded {a.model} ({a.backend}) in {time.perf_counter() - t0:.0f} s; threads={a.threads}", flush=True)
    tokens = ts.text_tokens(model, n_windows=4, length=64)
    layers = a.layers if a.layers else list(range(ts.adapt(model).n_layers))
    print("layer | starts | converged | distinct | attr rep saddle degen | rot pts/pairs | Morse index hist | "
          "s/layer | saddle frac [95% CI] verdict", flush=True)
    results = []
    for layer in layers:
        extra = {} if a.max_iter is None else {"max_iter": a.max_iter}
        run = lambda: ts.critical_points(model, [layer], tokens=tokens, n_starts=a.n_starts,  # noqa: E731
                                         options=extra or None)
        r = in_forwards(model, run, f"layer {layer}") if a.forwards else run()
        results.append(r)
        e = r.results[0]
        c = e.counts()
        v = r.claim().parts["per_layer"][layer]
        print(f"{layer:5d} | {e.n_starts:6d} | {e.n_converged:9d} | {e.n_points:8d} | {c['attractor']:4d} "
              f"{c['repeller']:3d} {c['saddle']:6d} {c['degenerate']:5d} | {c['rotational']:3d}/"
              f"{sum(e.rotational_pairs()):<5d} | {json.dumps(e.morse_histogram())} | {float(r.seconds[0]):7.1f} | "
              f"{v['fraction']:.2f} [{v['ci_low']:.2f}, {v['ci_high']:.2f}] {v['verdict']}  "
              f"{e.options['start_status']}", flush=True)
    merged = CriticalPointsResult(
        provenance=results[0].provenance, layers=[x.layers[0] for x in results], field="ffn",
        counts=torch.cat([x.counts for x in results]), rotational=torch.cat([x.rotational for x in results]),
        rotational_pairs=torch.cat([x.rotational_pairs for x in results]),
        n_points=torch.cat([x.n_points for x in results]), n_converged=torch.cat([x.n_converged for x in results]),
        n_starts=torch.cat([x.n_starts for x in results]), radius=torch.cat([x.radius for x in results]),
        seconds=torch.cat([x.seconds for x in results]), results=[x.results[0] for x in results])
    pooled = merged.claim().parts["pooled"]
    conv = merged.converged_fraction()
    print(f"pooled: {pooled['saddles']} saddles of {pooled['n']} equilibria = {pooled['fraction']:.3f} "
          f"[{pooled['ci_low']:.3f}, {pooled['ci_high']:.3f}] -> {pooled['verdict']}")
    print(f"layers with converged fraction >= 1/2: {int((conv >= 0.5).sum())}/{len(layers)}; "
          f"with >= 3 distinct points: {int((merged.n_points >= 3).sum())}/{len(layers)}; "
          f"Morse histogram {json.dumps(merged.morse_histogram())}; "
          f"seconds/layer mean {float(merged.seconds.mean()):.1f} max {float(merged.seconds.max()):.1f}")
    if a.json:
        merged.save(a.json)


if __name__ == "__main__":
    main()
