"""The census of a layer's equilibria on real models: can "mostly saddles" be decided? (docs/critical_points.md
section 11).

Per layer: ``critical_census(model, layer)`` (random starts, power iteration of F and -F, then the landscape
phase), the attractors and repellers found with their Chao1 estimate and upper bound, the saddles found (a lower
bound) with their Morse indices, the lower bound on the share of saddles and the verdict; every point re-verified
on a fresh float64 field. ``--json`` keeps the points; ``--forwards`` also times each layer's census in plain forwards
(as ``critical_points.py --forwards``).

    python benchmarks/critical_census.py --models smollm2-135m --layers 15 25 --n-starts 64 --solves 256
"""

import argparse
import json
import time

import torch

import _common  # noqa: F401 - puts this checkout first on sys.path
import tl_steering as ts
from tl_steering.critical import critical_census, critical_field, relative_residual

from critical_points import in_forwards  # noqa: E402 - benchmarks/ is the script's directory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m"])
    p.add_argument("--layers", nargs="*", type=int, default=None, help="default: every layer")
    p.add_argument("--n-starts", type=int, default=64)
    p.add_argument("--solves", type=int, default=256, help="landscape solves per layer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--forwards", action="store_true", help="also each layer's CPU and wall time in plain forwards")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    out: dict = {}
    for name in a.models:
        model = ts.load_model(name)
        layers = a.layers if a.layers else list(range(model.cfg.n_layers))
        print(f"\n{name}: {len(layers)} layers, {a.n_starts} random starts, {a.solves} landscape solves")
        print("layer | points | attractors found / Chao1 / high | repellers found / Chao1 / high | saddles found | "
              "saddle Morse indices | share of saddles >= | verdict | landscape rows / converged / exhausted | "
              "rebuilt residual | s")
        for layer in layers:
            t0 = time.perf_counter()
            run = lambda: critical_census(model, layer, n_starts=a.n_starts, seed=a.seed,  # noqa: E731
                                          landscape_solves=a.solves)
            c = in_forwards(model, run, f"{name} layer {layer}") if a.forwards else run()
            secs = time.perf_counter() - t0
            r = c.equilibria
            worst = 0.0
            if r.n_points:
                with torch.no_grad():
                    worst = float(relative_residual(r.points, critical_field(model, layer)(r.points)).max())
            idx = sorted(k for k, lab in zip(r.index, r.labels) if lab == "saddle")
            o = r.options
            at, rp = c.attractors, c.repellers
            print(f"{layer} | {r.n_points} | {int(at['observed'])} / {at['estimate']:.1f} / {at['ci_high']:.1f} | "
                  f"{int(rp['observed'])} / {rp['estimate']:.1f} / {rp['ci_high']:.1f} | {c.saddles} | {idx} | "
                  f"{c.share_low:.2f} | {c.verdict} | {o.get('landscape_rows', 0)} / {o.get('landscape_converged', 0)}"
                  f" / {o.get('landscape_exhausted')} | {worst:.1e} | {secs:.0f}", flush=True)
            out.setdefault(name, {})[str(layer)] = {
                **c.summary(), "saddle_index": idx, "seconds": secs, "rebuilt_residual_max": worst,
                "coords": r.points.tolist(), "index": r.index, "labels": r.labels, "lambdas": r.lambdas.tolist(),
                "attractors": at, "repellers": rp,
                **{k: o.get(k) for k in ("landscape_rows", "landscape_converged", "landscape_exhausted")}}
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(out, f)
        del model


if __name__ == "__main__":
    main()
