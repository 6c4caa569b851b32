"""The "mostly saddles" claim over a sample without a bias toward stability: every layer's FFN field, equilibria
reached by the reflected finder from N token directions (docs/critical_points.md, section 8).

Per layer: starts (token directions of the FFN input, positions >= 1, seeded choice), rows (starts + repair +
landscape rows), converged rows, distinct equilibria, label counts, the Morse index histogram, dense Jacobians
evaluated (the cost unit: one Jacobian = d JVPs), seconds (contaminated on a shared machine), the saddle fraction
with its exact Clopper-Pearson interval; then the pooled verdict per model. Each point is re-verified on a float64
field rebuilt from the weights (a fresh ``critical_field``) and its residual printed.

    .venv-tl4/bin/python benchmarks/critical_unbiased.py [--models smollm2-135m gemma-3-270m] [--layers 0 5]
        [--n-starts 4] [--max-iter 100] [--no-landscape] [--threads 1] [--json out.json]

``--sample coverage`` instead runs the coverage check on the planted fields (d = 12 and d = 576): every planted
equilibrium (indices 0, 1, 2, 3, d/2, d-3, d-2, d-1, both signs) found or not, with its label and index.
"""

import argparse
import json
import time

import torch

import tl_steering as ts
from tl_steering.critical import clopper_pearson, critical_field, find_equilibria, saddle_verdict
from tl_steering.critical.fields import relative_residual
from tl_steering.critical.model import _activations, _token_starts
from tl_steering.critical.planted import planted_field


def coverage(dims: list[int], n_starts: dict[int, int], seeds: list[int], max_iter: int) -> None:
    for d in dims:
        for seed in seeds:
            p = planted_field(d, seed=seed)
            t0 = time.perf_counter()
            r = find_equilibria(p, d, n_starts=n_starts[d], seed=seed, method="reflected", max_iter=max_iter)
            found = []
            for x, k, lab in zip(p.points, p.index, p.labels):
                dist = (r.points - x).norm(dim=-1) if r.n_points else torch.ones(1)
                j = int(dist.argmin())
                ok = float(dist[j]) < 1e-8
                found.append((k, ok and r.index[j] == k and r.labels[j] == lab))
            hit = sum(ok for _, ok in found)
            miss = sorted(k for k, ok in found if not ok)
            print(f"coverage d={d} seed={seed}: {hit}/{len(found)} planted points found with index and label right"
                  f" (missing indices {miss}); {r.n_points} distinct points, rows {r.n_starts}, converged "
                  f"{r.n_converged}, jacobians {r.options.get('jacobians', 0) + r.options.get('landscape_jacobians', 0)}"
                  f", {time.perf_counter() - t0:.1f} s", flush=True)


def run_model(name: str, layers: list[int] | None, n_starts: int, max_iter: int, landscape: bool,
              out: dict) -> None:
    t0 = time.perf_counter()
    model = ts.load_model(name)
    ad = ts.adapt(model)
    tokens = ts.text_tokens(model, n_windows=4, length=64)
    layers = layers if layers else list(range(ad.n_layers))
    acts = _activations(ad, tokens, layers, "ffn")
    print(f"{name}: loaded in {time.perf_counter() - t0:.0f} s; {len(layers)} layers; {n_starts} token starts per "
          "layer", flush=True)
    print("layer | starts | rows | converged | distinct | attr rep saddle degen | rot | Morse index histogram | "
          "jacobians | s | saddle fraction [95% CP] verdict | max residual (rebuilt field)", flush=True)
    saddles = total = 0
    pooled_hist: dict[int, int] = {}
    for layer in layers:
        t1 = time.perf_counter()
        fld = critical_field(model, layer, tokens=tokens)
        starts = _token_starts(acts[layer], n_starts, seed=0)
        r = find_equilibria(fld, fld.dim, n_starts=starts.shape[0], starts=starts, method="reflected",
                            max_iter=max_iter, landscape=landscape)
        secs = time.perf_counter() - t1
        c = r.counts()
        v = saddle_verdict(c["saddle"], r.n_points)
        check = critical_field(model, layer, tokens=tokens)  # a fresh float64 copy of the block
        worst = 0.0
        if r.n_points:
            with torch.no_grad():
                worst = float(relative_residual(r.points, check(r.points)).max())
        jac = r.options.get("jacobians", 0) + r.options.get("landscape_jacobians", 0)
        hist = r.morse_histogram()
        for k, n in hist.items():
            pooled_hist[k] = pooled_hist.get(k, 0) + n
        saddles += c["saddle"]
        total += r.n_points
        frac = "-" if not r.n_points else f"{v['fraction']:.2f} [{v['ci_low']:.2f}, {v['ci_high']:.2f}] {v['verdict']}"
        print(f"{layer:5d} | {starts.shape[0]:6d} | {r.n_starts:4d} | {r.n_converged:9d} | {r.n_points:8d} | "
              f"{c['attractor']:4d} {c['repeller']:3d} {c['saddle']:6d} {c['degenerate']:5d} | {c['rotational']:3d} | "
              f"{json.dumps(hist)} | {jac:9d} | {secs:6.0f} | {frac} | {worst:.1e}", flush=True)
        out.setdefault(name, {})[str(layer)] = {
            "points": r.points.tolist(), "lambdas": r.lambdas.tolist(), "index": r.index, "labels": r.labels,
            "n_starts": starts.shape[0], "rows": r.n_starts, "converged": r.n_converged, "jacobians": jac,
            "seconds": secs, "start_status": r.options["start_status"], "rebuilt_residual_max": worst}
    low, high = clopper_pearson(saddles, total)
    v = saddle_verdict(saddles, total)
    print(f"{name} pooled over {len(layers)} layers: {saddles} saddles of {total} equilibria"
          + (f" = {saddles / total:.3f} [{low:.3f}, {high:.3f}] -> {v['verdict']}" if total else " -> no equilibria")
          + f"; Morse index histogram {json.dumps(dict(sorted(pooled_hist.items())))}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sample", choices=("models", "coverage"), default="models")
    p.add_argument("--models", nargs="*", default=["smollm2-135m", "gemma-3-270m"])
    p.add_argument("--layers", type=int, nargs="*", default=None)
    p.add_argument("--n-starts", type=int, default=4, help="token directions per layer")
    p.add_argument("--max-iter", type=int, default=100, help="reflected steps per row")
    p.add_argument("--no-landscape", action="store_true")
    p.add_argument("--seeds", type=int, nargs="*", default=[0])
    p.add_argument("--dims", type=int, nargs="*", default=[12, 576])
    p.add_argument("--starts-576", type=int, default=32, help="coverage: random starts at d = 576 (48 at d = 12)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="write the points, indices and labels per layer here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.sample == "coverage":
        coverage(a.dims, {12: 48, 576: a.starts_576}, a.seeds, a.max_iter)
        return
    out: dict = {}
    for name in a.models:
        run_model(name, a.layers, a.n_starts, a.max_iter, not a.no_landscape, out)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(out, fh)


if __name__ == "__main__":
    main()
