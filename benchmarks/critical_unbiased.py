"""The one finder (flow + solution landscape, docs/critical_points.md section 9) per layer from N token directions,
and its coverage of planted fields. The homotopy and reflected finders this script once compared were measured to
lose and left the package (their measurements: docs/critical_points.md sections 8 and 10).

Per layer: starts (token directions of the FFN input, positions >= 1, seeded choice), rows (starts + repair +
landscape rows), converged rows, distinct equilibria, label counts, the Morse index histogram, dense Jacobians
evaluated (the cost unit: one Jacobian = d JVPs), seconds (contaminated on a shared machine), the saddle fraction
with its exact Clopper-Pearson interval; then the pooled verdict per model. Each point is re-verified on a float64
field rebuilt from the weights (a fresh ``critical_field``) and its residual printed.

    .venv-tl4/bin/python benchmarks/critical_unbiased.py [--models smollm2-135m gemma-3-270m] [--layers 0 5]
        [--n-starts 1] [--budget 16] [--threads 1] [--json out.json]

``--sample coverage`` instead runs the coverage check on the planted fields (d = 12 and d = 576; ``--quartic γ``
for the nonlinear variant): every planted equilibrium (indices 0, 1, 2, 3, d/2, d-3, d-2, d-1, both signs) found or
not by the one finder, with its label and index, and the found fraction
per index. ``--sample symmetric``: the same check on symmetric linear fields (``symmetric_field``: 2d points ±q_i,
every index 0..d-1; e.g. ``--dims 12 16 24 32 --seeds 0 1 2 3``), with the landscape phase's rows, deferred starts
and the row that found the last new point.
"""

import argparse
import json
import time

import torch

import _common  # noqa: F401 - puts this checkout first on sys.path (tests.planted)

import tl_steering as ts
from tl_steering.critical import clopper_pearson, critical_field, find_equilibria, saddle_verdict
from tl_steering.critical.fields import relative_residual
from tl_steering.critical.model import _activations, _token_starts
from tests.planted import planted_field, symmetric_field


def _last_new_row(r) -> int:
    """The landscape row (1-based) that found the last new point (0: none); rows are stored flow rows first."""
    first = r.n_starts - r.options.get("landscape_rows", 0)
    late = [i for i in r.start_index if i >= first]
    return max(late) - first + 1 if late else 0


def coverage(dims: list[int], n_starts: dict[int, int], seeds: list[int], quartic: float,
             symmetric: bool = False) -> None:
    for d in dims:
        for seed in seeds:
            p = symmetric_field(d, seed=seed) if symmetric else planted_field(d, seed=seed, quartic=quartic)
            t0 = time.perf_counter()
            r = find_equilibria(p, d, n_starts=n_starts[d], seed=seed, options={"landscape_solves": 256})
            found: dict[int, list[bool]] = {}
            for x, k, lab in zip(p.points, p.index, p.labels):
                dist = (r.points - x).norm(dim=-1) if r.n_points else torch.ones(1)
                j = int(dist.argmin())
                found.setdefault(k, []).append(float(dist[j]) < 1e-8 and r.index[j] == k and r.labels[j] == lab)
            hit = sum(sum(v) for v in found.values())
            per = ", ".join(f"{k}: {sum(v)}/{len(v)}" for k, v in sorted(found.items()))
            o = r.options
            extra = (f"; landscape rows {o.get('landscape_rows', 0)}, converged {o.get('landscape_converged', 0)}, "
                     f"new points {o.get('landscape_new_points', 0)}, last new point at row {_last_new_row(r)}, "
                     f"deferred {o.get('landscape_deferred', 0)} (run {o.get('landscape_deferred_run', 0)}), "
                     f"exhausted {o.get('landscape_exhausted', '-')}; flow shift {o.get('shift')}")
            jac = o.get("jacobians", 0)
            field = "symmetric" if symmetric else f"quartic={quartic:g}"
            print(f"coverage d={d} seed={seed} {field}: {hit}/{len(p.points)} planted points found with "
                  f"index and label right (per index {per}); {r.n_points} distinct points, rows {r.n_starts}, "
                  f"converged {r.n_converged}, jacobians {jac}{extra}, {time.perf_counter() - t0:.1f} s", flush=True)


def run_model(name: str, layers: list[int] | None, n_starts: int, out: dict, budget: int = 16) -> None:
    t0 = time.perf_counter()
    model = ts.load_model(name)
    ad = ts.adapt(model)
    tokens = ts.text_tokens(model, n_windows=4, length=64)
    layers = layers if layers else list(range(ad.n_layers))
    acts = _activations(ad, tokens, layers, "ffn")
    print(f"{name}: loaded in {time.perf_counter() - t0:.0f} s; {len(layers)} layers; {n_starts} token starts per "
          f"layer", flush=True)
    print("layer | starts | rows | converged | distinct | attr rep saddle degen | rot | Morse index histogram | "
          "jacobians | s | saddle fraction [95% CP] verdict | max residual (rebuilt field)", flush=True)
    saddles = total = 0
    pooled_hist: dict[int, int] = {}
    for layer in layers:
        t1 = time.perf_counter()
        fld = critical_field(model, layer, tokens=tokens)
        starts = _token_starts(acts[layer], n_starts, seed=0)
        # the finder's own starts: half token directions, half random
        r = find_equilibria(fld, fld.dim, n_starts=2 * starts.shape[0], starts=starts,
                            options={"landscape_solves": budget})
        secs = time.perf_counter() - t1
        c = r.counts()
        v = saddle_verdict(c["saddle"], r.n_points)
        check = critical_field(model, layer, tokens=tokens)  # a fresh float64 copy of the block
        worst = 0.0
        if r.n_points:
            with torch.no_grad():
                worst = float(relative_residual(r.points, check(r.points)).max())
        jac = int(r.options.get("jacobians", 0))
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
            "seconds": secs, "start_status": r.options["start_status"], "rebuilt_residual_max": worst,
            "start_kind": r.start_kind, "residuals": r.residuals.tolist()}
    low, high = clopper_pearson(saddles, total)
    v = saddle_verdict(saddles, total)
    print(f"{name} pooled over {len(layers)} layers: {saddles} saddles of {total} equilibria"
          + (f" = {saddles / total:.3f} [{low:.3f}, {high:.3f}] -> {v['verdict']}" if total else " -> no equilibria")
          + f"; Morse index histogram {json.dumps(dict(sorted(pooled_hist.items())))}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sample", choices=("models", "coverage", "symmetric"), default="models")
    p.add_argument("--models", nargs="*", default=["smollm2-135m", "gemma-3-270m"])
    p.add_argument("--layers", type=int, nargs="*", default=None)
    p.add_argument("--n-starts", type=int, default=1, help="token directions per layer")
    p.add_argument("--budget", type=int, default=16, help="landscape: solves per layer")
    p.add_argument("--quartic", type=float, default=0.0, help="coverage: γ of the nonlinear planted field")
    p.add_argument("--seeds", type=int, nargs="*", default=[0])
    p.add_argument("--dims", type=int, nargs="*", default=[12, 576])
    p.add_argument("--starts-576", type=int, default=16, help="coverage: random starts at d = 576")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="write the points, indices and labels per layer here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.sample in ("coverage", "symmetric"):
        starts = {d: 16 for d in a.dims if d != 576}
        coverage(a.dims, {**starts, 576: a.starts_576}, a.seeds, a.quartic, symmetric=a.sample == "symmetric")
        return
    out: dict = {}
    for name in a.models:
        run_model(name, a.layers, a.n_starts, out, a.budget)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(out, fh)


if __name__ == "__main__":
    main()
