"""How well a parallel plan chosen on one set of calibration windows holds on other draws of held-out windows.

    OMP_NUM_THREADS=2 python benchmarks/plan_draws.py [--model smollm2-135m] [--k 15] [--draws 1,2,3]
        [--best affine,linear] [--best-strategies C,attribution_abs] [--plan NAME=5,6,7 ...] [--json out.json]

Calibration: the first W/2 of ``text_tokens(model, n_windows=W, length=N, seed=0)`` (the windows of
``benchmarks/plan_quality.py``). Every plan is chosen and every correction fitted on them. Each draw ``s`` is a
fresh ``text_tokens(..., seed=s)`` batch of W windows; a window that is also a calibration window is dropped, so
the draws are held out.

Plans:
* the lowest-C plan (the paper's, from ``parallel_scores`` on the calibration windows);
* the one-shot ``attribution_abs`` / ``attribution_2nd`` plans (same scores);
* with ``--best R1,R2``, ``plan_parallel(..., strategy="best", refit=R)``'s chosen plan per refit R (a few
  minutes each);
* any ``--plan NAME=LAYERS``.

Corrections, fitted on the calibration windows:
* ``none``: the plain parallel surrogate;
* ``affine``: the library's ``g_l Phi(x) + b_l`` (``parallel.refit.fit_corrections``, sequential);
* ``linear``: ``g_l Phi(x) + b_l + a W_l`` (``refit="linear"``): ``a`` the block's attention write, ``W_l`` a
  ``d x d`` ridge regression of the affine fit's residual on ``a``, fitted sequentially in one forward. The block
  stays parallel (the executor folds W_l into ``W_O -> W_O (I + W_l)``).

Prints held-out dCE per draw and the ratio to the lowest-C plan without correction on the same draw.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tl_steering as ts  # noqa: E402
from _common import cal_held, finish, plan_parser, start  # noqa: E402
from tl_steering.data.batching import mean_loss  # noqa: E402
from tl_steering.hooks import parallel_blocks  # noqa: E402
from tl_steering.parallel import strategies as st  # noqa: E402
from tl_steering.parallel.refit import fit_corrections  # noqa: E402

def main(argv: list[str] | None = None) -> dict:
    ap = plan_parser(__doc__)
    ap.add_argument("--draws", default="1,2,3", help="seeds of the held-out draws")
    ap.add_argument("--best", default="",
                    help="refits R: also plan_parallel(strategy='best', refit=R) (comma list)")
    ap.add_argument("--best-strategies", default="",
                    help="strategies compared by --best (default: the library's)")
    ap.add_argument("--plan", action="append", default=[], help="NAME=L1,L2,... (repeatable)")
    ap.add_argument("--json", default=None)
    args, t0, model, ad, cand = start(ap, argv)
    k = args.k
    cal, _ = cal_held(model, args.windows, args.length)
    bs = args.batch_size
    seen = {tuple(r.tolist()) for r in cal}
    draws = {}
    for s in (int(x) for x in args.draws.split(",") if x):
        toks = ts.text_tokens(model, n_windows=args.windows, length=args.length, seed=s)
        keep = [i for i, r in enumerate(toks) if tuple(r.tolist()) not in seen]
        draws[s] = toks[keep]
    print(f"# {args.model} ({args.backend}, TL {ts.tl_version()}, threads {torch.get_num_threads()}); k={k}; "
          f"calibration {tuple(cal.shape)}; draws "
          + ", ".join(f"seed {s}: {tuple(t.shape)}" for s, t in draws.items()),
          flush=True)
    sc = ts.parallel_scores(model, cal, batch_size=bs)
    plans = {"C": st.one_shot(cand, sc.score_of("C"), k)}
    for s in ("attribution_abs", "attribution_2nd"):
        plans[s] = st.one_shot(cand, sc.score_of(s), k)
    for refit in (r for r in args.best.split(",") if r):
        t1 = time.time()
        strategies = [x for x in args.best_strategies.split(",") if x] or None
        pp = ts.plan_parallel(model, cal, k, strategy=strategies or "best", refit=refit, k_values=[k], batch_size=bs)
        plans[f"best with {refit} ({pp.strategy}{' of ' + args.best_strategies if strategies else ''})"] = \
            list(pp.layers)
        print(f"plan_parallel best, refit {refit}: {pp.strategy} {list(pp.layers)}, calibration dCE "
              f"{pp.calibration_delta_ce:+.4f} ({time.time() - t1:.0f}s)", flush=True)
    for spec in args.plan:
        name, _, layers = spec.partition("=")
        plans[name] = sorted(int(x) for x in layers.split(","))
    clean = {s: mean_loss(ad, t, batch_size=bs) for s, t in draws.items()}
    rows = []
    with torch.no_grad():
        for name, plan in plans.items():
            g, b, _ = fit_corrections(model, cal, plan, refit="affine", batch_size=len(cal))
            w: dict = {}
            gl, bl, _ = fit_corrections(model, cal, plan, refit="linear", batch_size=len(cal), linears=w)
            for corr, hooks in (("none", parallel_blocks(model, plan)),
                                ("affine", parallel_blocks(model, plan, g, b)),
                                ("linear", parallel_blocks(model, plan, gl, bl, w))):
                dce = {s: mean_loss(ad, t, hooks, batch_size=bs) - clean[s] for s, t in draws.items()}
                rows.append({"plan": name, "layers": plan, "correction": corr, "held_out_dce": dce})
    c_none = next(r for r in rows if r["plan"] == "C" and r["correction"] == "none")["held_out_dce"]
    print("\n| plan | layers | correction | " + " | ".join(f"dCE seed {s} (ratio)" for s in draws) +
          " | mean ratio |\n|---|---|---|" + "---|" * (len(draws) + 1))
    for r in rows:
        ratios = {s: r["held_out_dce"][s] / c_none[s] for s in draws}
        r["ratio_vs_C_uncorrected"] = ratios
        cells = " | ".join(f"{r['held_out_dce'][s]:+.3f} ({ratios[s]:.2f})" for s in draws)
        print(f"| {r['plan']} | {','.join(map(str, r['layers']))} | {r['correction']} | {cells} | "
              f"{sum(ratios.values()) / len(ratios):.2f} |", flush=True)
    out = {"model": args.model, "backend": args.backend, "k": k,
           "calibration_shape": list(cal.shape), "draws": {s: list(t.shape) for s, t in draws.items()},
           "clean_ce": clean, "plans": plans, "rows": rows}
    return finish(out, args.json, t0)


if __name__ == "__main__":
    main()
