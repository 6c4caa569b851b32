"""Re-verify stored equilibria against float64 fields rebuilt from the weights (docs/critical_points.md section 10).

Reads a points file (default ``benchmarks/data/critical_homotopy_points.json.gz``, written from the JSON of
``benchmarks/critical_unbiased.py --json``), rebuilds each layer's FFN field with a fresh
``critical_field(model, layer)`` (a new float64 copy of the block, default radius), and for every stored point prints
the relative residual ||P_u F(u)|| / ||F(u)||, |λ - stored λ| / |λ|, and the Morse index and label recomputed from the
dense tangent spectrum (``classify_point``), against the stored ones; then the three parts of the claim over the
stored sample (``CriticalPointsResult.claim()``'s rules: docs section 4) and the Poincaré-Hopf lower bound per model.
Exit status 1 when a point's residual is above ``--tol`` or its index or label differs.

    python benchmarks/verify_points.py                       # both models, every layer stored
    python benchmarks/verify_points.py --models smollm2-135m --layers 0 15
"""

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one

import tl_steering as ts  # noqa: E402
from tl_steering.critical import classify_point, clopper_pearson, critical_field

DEFAULT = Path(__file__).parent / "data" / "critical_homotopy_points.json.gz"


def _load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _ci(k: int, n: int) -> str:
    if not n:
        return "-"
    lo, hi = clopper_pearson(k, n)
    return f"{k}/{n} = {k / n:.2f} [{lo:.2f}, {hi:.2f}]"


def verify(data: dict, models: list[str] | None, layers: list[int] | None, tol: float, threads: int) -> bool:
    torch.set_num_threads(threads)
    ok = True
    by_model: dict[str, list[tuple[str, str, dict]]] = {}
    for tag, sample in data["samples"].items():
        for model, per_layer in sample.items():
            for layer, rec in per_layer.items():
                if (models is None or model in models) and (layers is None or int(layer) in layers):
                    by_model.setdefault(model, []).append((tag, layer, rec))
    for name, recs in by_model.items():
        t0 = time.perf_counter()
        model = ts.load_model(name)
        print(f"\n{name} (loaded in {time.perf_counter() - t0:.0f} s)")
        print("sample | layer | radius | points | max rel. residual | max |Δλ|/|λ| | index same | label same | "
              "attractor / repeller / saddle | rotational | parity: missing at least")
        tot = {"attractor": 0, "repeller": 0, "saddle": 0, "degenerate": 0, "rotational": 0, "n": 0, "missing": 0}
        for tag, layer, rec in sorted(recs, key=lambda x: (x[0], int(x[1]))):
            pts = torch.tensor(rec["points"], dtype=torch.float64)
            if pts.numel() == 0:
                print(f"{tag} | {layer} | - | 0 | - | - | - | - | - | - | -")
                continue
            fld = critical_field(model, int(layer))
            res, dlam, same_i, same_l, labs, rot, idx = 0.0, 0.0, 0, 0, [], 0, []
            for u, lam, k, lab in zip(pts, rec["lambdas"], rec["index"], rec["labels"]):
                pc = classify_point(fld, u)
                res = max(res, pc.residual)
                dlam = max(dlam, abs(pc.lam - lam) / max(abs(lam), 1e-300))
                same_i += int(pc.index == k)
                same_l += int(pc.label == lab)
                labs.append(pc.label)
                rot += int(pc.rotational)
                idx.append(pc.index)
            n = len(labs)
            dim = pts.shape[1]
            nn = dim - 1
            missing = abs(sum((-1) ** (nn - k) for k in idx) - (1 + (-1) ** nn))
            bad = res > tol or same_i < n or same_l < n
            ok &= not bad
            counts = {x: labs.count(x) for x in ("attractor", "repeller", "saddle", "degenerate")}
            for x, v in counts.items():
                tot[x] += v
            tot["rotational"] += rot
            tot["n"] += n
            tot["missing"] += missing
            print(f"{tag} | {layer} | {fld.radius:.4g} | {n} | {res:.1e} | {dlam:.1e} | {same_i}/{n} | {same_l}/{n} | "
                  f"{counts['attractor']} / {counts['repeller']} / {counts['saddle']} | {rot} | {missing}"
                  + ("  <-- MISMATCH" if bad else ""), flush=True)
        print(f"{name}: {tot['n']} points; not attractors: {'fails' if tot['attractor'] else 'not contradicted'} "
              f"({tot['attractor']} attractors); rotational modes {_ci(tot['rotational'], tot['n'])}; saddles "
              f"{_ci(tot['saddle'], tot['n'])} (this sample; it does not decide 'mostly saddles', docs section 4); "
              f"Poincaré-Hopf: at least {tot['missing']} equilibria not found")
        del model
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", type=Path, default=DEFAULT)
    p.add_argument("--models", nargs="*", default=None)
    p.add_argument("--layers", nargs="*", type=int, default=None)
    p.add_argument("--tol", type=float, default=1e-10, help="largest relative residual accepted")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    data = _load(a.points)
    print(data.get("about", ""))
    sys.exit(0 if verify(data, a.models, a.layers, a.tol, a.threads) else 1)


if __name__ == "__main__":
    main()
