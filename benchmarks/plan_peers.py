"""Every planner strategy, ours and the field's, at equal k: held-out dCE uncorrected and corrected, passes used.

    OMP_NUM_THREADS=1 python benchmarks/plan_peers.py [--model smollm2-135m] [--k 15] [--ks 5,10,15]
        [--no-sleb] [--sleb-k 3] [--strategies C,attribution_abs,...] [--default-cost 4] [--json out.json]

Windows: ``text_tokens(model, n_windows=8, length=128, seed=0)`` (``--windows``, ``--length``); the first half
calibrates every plan AND every correction, the second half is held out and only reported (the windows of
``benchmarks/plan_quality.py`` and docs/parallel.md's refit tables).

1. one ``parallel_scores`` call on the calibration windows (C, the attribution scores with 8 sampled labels,
   the peers' ``block_influence``, ``angular_distance``, ``ffn_fusion``);
2. ``plan_parallel(..., strategy=[every strategy], refit="none", k_values=ks)``: every
   strategy's plan at every k, chosen the strategy's own way (uncorrected, as the peers publish them), with its
   held-out dCE uncorrected and its cost in passes;
3. every distinct plan with the linear correction (``refit="linear"``) fitted on all the calibration windows
   (``RefitLoss`` / ``FittedLoss``, the corrections ``plan_parallel`` stores): held-out dCE corrected;
4. the default call at the same k values, ``plan_parallel(model, cal, k, held_out=held, k_values=ks)`` (the
   one-shot comparison, cross-fitted linear correction): its choice at each k (the strategy of lowest
   out-of-fold calibration dCE) and that plan's corrected held-out dCE, its passes and seconds;
``--one-shot`` (for a model whose passes are dear, Gemma-3-270M's 262k-token vocabulary): instead of 1-4, ONE
call ``plan_parallel(model, cal, k, held_out=held, strategy=PLANNER.strategies + PEER_SCORES, k_values=ks)``: every one-shot plan's held-out dCE uncorrected and corrected, and the default call's
choice at each k (the one-shot strategy of lowest cross-fitted calibration dCE: a strategy's value does not depend
on the others compared); no search (measured, greedy, SLEB).

5. ``--default-cost W``: the default call on the first W windows alone (``plan_parallel(model, tokens[:W], k)``,
   half of them held out), its ``total_cost`` in passes and seconds.

Prints one markdown table (rows: strategies; per k: uncorrected / corrected held-out dCE) and the ratios the
issue-30 acceptance asks for. Seconds are wall time on whatever else the machine runs.
"""

import time

import torch

import tl_steering as ts
from _common import cal_held, finish, plan_parser, start
from tl_steering.parallel.strategies import PLANNER, STRATEGIES

ONE_SHOT_COMPARISON = PLANNER.strategies
from tl_steering.parallel.refit import FittedLoss, RefitLoss


def main(argv: list[str] | None = None) -> dict:
    ap = plan_parser(__doc__)
    ap.add_argument("--ks", default="", help="k values (default L//6, L//3, k)")
    ap.add_argument("--no-sleb", action="store_true", help="leave out SLEB (sum_{j<k} (L - j) forwards)")
    ap.add_argument("--sleb-k", type=int, default=None,
                    help="run SLEB only up to this k (its own call; the larger k show no SLEB plan)")
    ap.add_argument("--strategies", default="", help="the compared strategies (default: every strategy but sleb)")
    ap.add_argument("--default-cost", type=int, default=4, help="windows of the default-cost call (0: skip)")
    ap.add_argument("--one-shot", action="store_true", help="one call, the one-shot strategies only (see above)")
    ap.add_argument("--no-default", action="store_true",
                    help="leave out step 4, the default call at the same k (e.g. SLEB alone on a dear model)")
    ap.add_argument("--json", default=None)
    args, t0, model, ad, cand = start(ap, argv)
    k, bs = args.k, args.batch_size
    L = len(cand)
    ks = sorted({int(x) for x in args.ks.split(",") if x} or {L // 6, L // 3, k})
    cal, held = cal_held(model, args.windows, args.length)
    print(f"# {args.model}: L={L}, k={ks}, {cal.shape[0]} + {held.shape[0]} windows x {args.length}", flush=True)

    if args.one_shot:
        return one_shot(args, t0, model, cal, held, ks)
    t1 = time.time()
    scores = ts.parallel_scores(model, cal, batch_size=bs, fisher_samples=8)
    print(f"# scores {time.time() - t1:.0f}s", flush=True)
    base = [x for x in args.strategies.split(",") if x] or [n for n in STRATEGIES if n != "sleb"]
    sleb_apart = not args.no_sleb and args.sleb_k is not None and args.sleb_k < max(ks)
    names = base + ([] if args.no_sleb or sleb_apart else ["sleb"])
    t1 = time.time()
    plain = ts.plan_parallel(model, cal, max(ks), held_out=held, strategy=names, refit="none", k_values=ks,
                             batch_size=bs)
    print(f"# uncorrected comparison {time.time() - t1:.0f}s, {plain.total_cost}", flush=True)
    if sleb_apart:  # SLEB at the k values up to --sleb-k only; NaN (no plan) above
        t1 = time.time()
        sk = [kk for kk in ks if kk <= args.sleb_k]
        sl = ts.plan_parallel(model, cal, max(sk), held_out=held, strategy="sleb", refit="none", k_values=sk,
                              batch_size=bs)
        nan = float("nan")
        plain.strategies.append("sleb")
        names.append("sleb")
        plain.plans["sleb"] = [sl.plans["sleb"][sk.index(kk)] if kk in sk else [] for kk in ks]
        plain.held_out_curves["sleb"] = torch.tensor([float(sl.held_out_curves["sleb"][sk.index(kk)])
                                                      if kk in sk else nan for kk in ks], dtype=torch.float64)
        plain.strategy_costs["sleb"] = sl.strategy_costs["sleb"]
        print(f"# SLEB up to k={max(sk)} {time.time() - t1:.0f}s, {sl.strategy_costs['sleb']}", flush=True)

    t1 = time.time()
    src = RefitLoss(model, cal, bs, refit="linear", crossfit=False)
    fitted = FittedLoss(model, held, bs, source=src)
    sets = [p for s in names for p in plain.plans[s]]
    fitted.prefetch([[]] + sets)
    corrected = {s: [fitted.delta(p) if len(p) == kk else float("nan") for p, kk in zip(plain.plans[s], ks)]
                 for s in names}
    print(f"# corrected evaluation {time.time() - t1:.0f}s ({src.fit_passes} fits + {fitted.passes} held-out "
          "passes)", flush=True)

    t1 = time.time()
    default = None if args.no_default else ts.plan_parallel(model, cal, max(ks), held_out=held, k_values=ks,
                                                            batch_size=bs)
    t_default = time.time() - t1
    dflt = {}
    for j, kk in enumerate(default.k_values if default is not None else []):
        cal_c = {s: float(v[j]) for s, v in default.calibration_curves.items()}
        s = min(default.strategies, key=lambda n: (cal_c[n], default.strategies.index(n)))
        dflt[kk] = {"strategy": s, "layers": default.plans[s][j], "held_out": float(default.held_out_curves[s][j]),
                    "uncorrected": plain_held(plain, default.plans[s][j], model, held, bs)}
    if default is not None:
        print(f"# default call {t_default:.0f}s, {default.total_cost}", flush=True)

    rows = {}
    for s in names:
        cost = plain.strategy_costs[s]
        rows[s] = {"uncorrected": plain.held_out_curves[s].tolist(), "corrected": corrected[s],
                   "plans": plain.plans[s], "forward": cost["forward"], "backward": cost["backward"]}
    head = " | ".join(f"k={kk}: none / linear" for kk in plain.k_values)
    print(f"\n| strategy | {head} | passes to choose (fwd + bwd) |")
    print("|---|" + "---|" * (len(plain.k_values) + 1))
    for s, r in rows.items():
        cells = " | ".join(f"{u:+.3f} / {c:+.3f}" for u, c in zip(r["uncorrected"], r["corrected"]))
        print(f"| {s} | {cells} | {r['forward']:.0f} + {r['backward']:.0f} |")
    j = plain.k_values.index(k)
    if default is not None:
        cells = " | ".join(f"{dflt[kk]['uncorrected']:+.3f} / {dflt[kk]['held_out']:+.3f} ({dflt[kk]['strategy']})"
                           for kk in plain.k_values)
        print(f"| **default** (`plan_parallel(model, cal, k)`) | {cells} | {default.total_cost['forward']:.0f} + "
              f"{default.total_cost['backward']:.0f} (whole call, every k) |")
        low_c = rows["C"]["uncorrected"][j]
        ours = dflt[k]["held_out"]
        print(f"\n# k={k}: default {ours:+.4f} = {ours / low_c:.3f} x the lowest-C plan uncorrected ({low_c:+.4f})")
    peers = ["block_influence", "angular_distance", "ffn_fusion"] + ([] if args.no_sleb else ["sleb"])
    for p in (p for p in peers if p in rows):  # --strategies may leave the peers' scores out
        print(f"#   vs {p}: uncorrected {rows[p]['uncorrected'][j]:+.4f}, corrected {rows[p]['corrected'][j]:+.4f}")
    out = {"model": args.model, "ks": plain.k_values, "rows": rows, "default": dflt,
           "default_cost": default.total_cost if default is not None else None, "default_seconds": t_default,
           "one_shot": list(ONE_SHOT_COMPARISON)}
    if args.default_cost:
        toks = torch.cat([cal, held])[: args.default_cost]
        t1 = time.time()
        p = ts.plan_parallel(model, toks, k, batch_size=bs)
        out["default_small"] = {"windows": args.default_cost, "total_cost": p.total_cost,
                                "seconds": time.time() - t1, "strategy": p.strategy, "layers": p.layers}
        print(f"# default call on {args.default_cost} x {args.length}: {p.total_cost} ({time.time() - t1:.0f}s), "
              f"chose {p.strategy} {p.layers}", flush=True)
    return finish(out, args.json, t0)


def one_shot(args, t0, model, cal, held, ks) -> dict:
    from tl_steering.parallel.strategies import PEER_SCORES

    t1 = time.time()
    names = list(ONE_SHOT_COMPARISON) + list(PEER_SCORES)
    p = ts.plan_parallel(model, cal, max(ks), held_out=held, strategy=names, k_values=ks, batch_size=args.batch_size)
    print(f"# one call {time.time() - t1:.0f}s, {p.total_cost}", flush=True)
    head = " | ".join(f"k={kk}: none / linear" for kk in p.k_values)
    print(f"\n| strategy | {head} | passes to choose (fwd + bwd) |")
    print("|---|" + "---|" * (len(p.k_values) + 1))
    rows = {}
    for s in names:
        u, c = p.held_out_curves_uncorrected[s].tolist(), p.held_out_curves[s].tolist()
        rows[s] = {"uncorrected": u, "corrected": c, "plans": p.plans[s], **p.strategy_costs[s]}
        cells = " | ".join(f"{a:+.3f} / {b:+.3f}" for a, b in zip(u, c))
        print(f"| {s} | {cells} | {p.strategy_costs[s]['forward']:.0f} + {p.strategy_costs[s]['backward']:.0f} |")
    dflt = {}
    for j, kk in enumerate(p.k_values):
        s = min(ONE_SHOT_COMPARISON, key=lambda n: (float(p.calibration_curves[n][j]), ONE_SHOT_COMPARISON.index(n)))
        dflt[kk] = {"strategy": s, "layers": p.plans[s][j], "held_out": rows[s]["corrected"][j],
                    "uncorrected": rows[s]["uncorrected"][j]}
    cells = " | ".join(f"{dflt[kk]['uncorrected']:+.3f} / {dflt[kk]['held_out']:+.3f} ({dflt[kk]['strategy']})"
                       for kk in p.k_values)
    print(f"| **default** | {cells} | |")
    k = args.k
    j = p.k_values.index(k)
    low_c = rows["C"]["uncorrected"][j]
    print(f"\n# k={k}: default {dflt[k]['held_out']:+.4f} = {dflt[k]['held_out'] / low_c:.3f} x the lowest-C plan "
          f"uncorrected ({low_c:+.4f}); layers {dflt[k]['layers']}")
    out = {"model": args.model, "ks": p.k_values, "rows": rows, "default": dflt, "total_cost": p.total_cost,
           "calibration": {s: v.tolist() for s, v in p.calibration_curves.items()}}
    if args.json:
        finish(out, args.json, t0)
    if args.default_cost:
        toks = torch.cat([cal, held])[: args.default_cost]
        t1 = time.time()
        d = ts.plan_parallel(model, toks, k, batch_size=args.batch_size)
        out["default_small"] = {"windows": args.default_cost, "total_cost": d.total_cost,
                                "seconds": time.time() - t1, "strategy": d.strategy, "layers": d.layers}
        print(f"# default call on {args.default_cost} x {args.length}: {d.total_cost} ({time.time() - t1:.0f}s), "
              f"chose {d.strategy} {d.layers}", flush=True)
    return finish(out, args.json, t0)


def plain_held(plain, layers, model, held, bs) -> float:
    """Held-out dCE of ``layers`` without correction (from the uncorrected comparison when it measured them)."""
    from tl_steering.parallel.gold import PlanLoss

    for s in plain.strategies:
        for j, p in enumerate(plain.plans[s]):
            if list(p) == list(layers):
                return float(plain.held_out_curves[s][j])
    loss = PlanLoss(model, held, bs)
    return loss.delta(layers)


if __name__ == "__main__":
    main()
