"""Quality and cost of the layer planners (tl_steering.plan_parallel) against the paper's lowest-C plan.

    python benchmarks/plan_quality.py [--model smollm2-135m] [--backend bridge|hooked] [--k 15]
                                      [--windows 8] [--length 128] [--shortlist 4] [--json out.json]

Windows: ``text_tokens(model, n_windows=W, length=N, seed=0)`` (pydoc); the first W/2 windows calibrate
(every plan is chosen on them), the other W/2 (disjoint chunks of the same text) are held out and only
reported. Prints:

1. Spearman rho of every per-layer score (C variants, attribution variants; computed on the calibration
   windows) with the measured single-layer dCE on the calibration AND on the held-out windows;
2. every strategy's plan at k: calibration dCE, held-out dCE, its own cost in passes over the calibration
   windows, and the ratio held-out dCE(best) / held-out dCE(C);
3. the loss-vs-k curves (held-out) of every strategy.

Timings (planner seconds) on a shared CPU are distorted by other processes; the pass counts are exact.
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tl_steering as ts  # noqa: E402
from tl_steering.parallel.plan import FULL_COMPARISON  # noqa: E402
from _common import cal_held, finish, plan_parser, start  # noqa: E402
from tl_steering.parallel.gold import PlanLoss, single_layer_delta, spearman  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = plan_parser(__doc__)
    ap.add_argument("--shortlist", type=int, default=4)
    ap.add_argument("--k-values", default=None, help="comma list (default: 0..k in steps of L//8, and k)")
    ap.add_argument("--strategies", default=None, help="comma list (default: plan_parallel's comparison)")
    ap.add_argument("--no-gold", action="store_true", help="skip the measured single-layer dCE (2 x L forwards)")
    ap.add_argument("--fisher-samples", type=int, default=8, help="sampled-label backwards of the 2nd-order scores")
    ap.add_argument("--no-plan", action="store_true", help="scores and their Spearman rho only")
    ap.add_argument("--gold-from", default=None,
                    help="a --json of an earlier run on the same model and windows: reuse its measured single-layer "
                         "dCE (deterministic) instead of 2 x L forwards")
    ap.add_argument("--refit", default="none", choices=("none", "gate", "affine", "linear"),
                    help="plan with the closed-form FFN correction re-fitted on the calibration windows for every "
                         "plan measured (tl_steering.parallel.refit; docs/parallel.md 'Refit')")
    ap.add_argument("--refit-order", default="sequential", choices=("sequential", "joint"))
    ap.add_argument("--json", default=None)
    args, t0, model, ad, cand = start(ap, argv)
    L = len(cand)
    k = args.k
    cal, held = cal_held(model, args.windows, args.length)
    print(f"# {args.model} ({args.backend}, TL {ts.tl_version()}, torch threads {torch.get_num_threads()}); "
          f"loaded in {time.time() - t0:.0f}s; calibration {tuple(cal.shape)}, held-out {tuple(held.shape)}, k={k}",
          flush=True)

    t1 = time.time()
    reuse = json.loads(Path(args.gold_from).read_text()) if args.gold_from else None
    sc = ts.parallel_scores(model, cal, gold=not args.no_gold and reuse is None, batch_size=args.batch_size,
                            fisher_samples=args.fisher_samples)
    t_scores = time.time() - t1
    cidx = [i for i, par in enumerate(sc.already_parallel) if not par]
    gold_held, rho_held = torch.full((len(sc.layers),), float("nan")), {}
    if reuse is not None:  # measured gold of an earlier run (same model, windows): deterministic
        sc.delta_ce = torch.tensor(reuse["delta_ce_calibration"], dtype=torch.float64)
        sc.evaluated = True
        sc.spearman = {name: spearman(v[cidx], sc.delta_ce[cidx]) for name, v in sc.scores.items()}
        gold_held = torch.tensor(reuse["delta_ce_held_out"], dtype=torch.float64)
        rho_held = {name: spearman(v[cidx], gold_held[cidx]) for name, v in sc.scores.items()}
        print(f"(single-layer dCE reused from {args.gold_from})")
    elif not args.no_gold:
        held_loss = PlanLoss(model, held, args.batch_size)
        gold_held = single_layer_delta(held_loss, sc.layers, sc.already_parallel)
        rho_held = {name: spearman(v[cidx], gold_held[cidx]) for name, v in sc.scores.items()}
    if sc.evaluated:
        print(f"\n## Scores vs measured single-layer dCE ({t_scores:.0f}s incl. {len(cidx)} gold forwards)")
        print("| score | Spearman vs dCE (calibration) | Spearman vs dCE (held-out) |\n|---|---|---|")
        for name in sc.scores:
            print(f"| {name} | {sc.spearman[name]:.3f} | {rho_held[name]:.3f} |")
        print("per-layer measured dCE (calibration):", [round(float(v), 4) for v in sc.delta_ce])
        print("per-layer measured dCE (held-out):", [round(float(v), 4) for v in gold_held])
    for name in sc.scores:
        print(f"per-layer {name} (calibration):", [float(f"{float(v):.4g}") for v in sc.scores[name]])
    print(f"score cost: {sc.cost}", flush=True)
    out = {"model": args.model, "backend": args.backend, "k": k, "calibration_shape": list(cal.shape),
           "held_out_shape": list(held.shape), "spearman_calibration": sc.spearman, "spearman_held_out": rho_held,
           "delta_ce_calibration": sc.delta_ce.tolist(), "delta_ce_held_out": gold_held.tolist(),
           "scores": {n: v.tolist() for n, v in sc.scores.items()}, "score_cost": sc.cost,
           "fisher_samples": args.fisher_samples, "seconds_scores": t_scores}
    if args.no_plan:
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"# total {time.time() - t0:.0f}s", flush=True)
        return out

    ks = [int(v) for v in args.k_values.split(",")] if args.k_values else None
    t1 = time.time()
    # the searching comparison (plan_parallel's default before issue 30; the default is now the one-shot one)
    strategies = args.strategies.split(",") if args.strategies else list(FULL_COMPARISON)
    plan = ts.plan_parallel(model, cal, k, held_out=held, k_values=ks, shortlist=args.shortlist,
                            strategies=strategies, batch_size=args.batch_size, scores=sc,
                            fisher_samples=args.fisher_samples, refit=args.refit, refit_order=args.refit_order)
    t_plan = time.time() - t1
    at_cal, at_held = plan.at_k("calibration"), plan.at_k("held_out")
    print(f"\n## Plans at k = {k} (chosen on calibration; {t_plan:.0f}s for the whole comparison)")
    print("| strategy | layers | ΔCE calibration | ΔCE held-out | cost (fwd / bwd passes) | seconds |\n"
          "|---|---|---|---|---|---|")
    for s in plan.strategies:
        c = plan.strategy_costs[s]
        mark = " **chosen**" if s == plan.strategy else ""
        print(f"| {s}{mark} | {plan.plan_of(s)} | {at_cal[s]:+.4f} | {at_held[s]:+.4f} | "
              f"{c['forward']:.0f} / {c['backward']:.0f} | {c['seconds']:.1f} |")
    ratio = plan.held_out_delta_ce / at_held["C"] if at_held.get("C") else float("nan")
    print(f"\nchosen: {plan.strategy} {plan.layers}; held-out ΔCE {plan.held_out_delta_ce:+.4f} vs C plan "
          f"{at_held.get('C', float('nan')):+.4f}: ratio {ratio:.3f} (target <= 0.5)")
    ratio_plain = float("nan")
    if args.refit != "none" and "C" in plan.plans:  # against the paper's plan WITHOUT the correction too
        c_plain = PlanLoss(model, held, args.batch_size)
        c_plain.memo[()] = plan.clean_loss_held_out
        c_unc = c_plain.delta(plan.plan_of("C"))
        ratio_plain = plan.held_out_delta_ce / c_unc
        print(f"refit={args.refit} ({args.refit_order}); chosen plan uncorrected: calibration "
              f"{plan.calibration_delta_ce_uncorrected:+.4f}, held-out {plan.held_out_delta_ce_uncorrected:+.4f}; "
              f"C plan uncorrected held-out {c_unc:+.4f}: ratio (corrected best / uncorrected C) {ratio_plain:.3f}")
        print("fitted gates of the chosen plan:", [round(g, 4) for g in plan.gates.tolist()],
              "bias norms:", [round(float(b.norm()), 3) for b in plan.biases])
    print(f"total planner cost: {plan.total_cost['forward']:.0f} forward + {plan.total_cost['backward']:.0f} "
          f"backward passes (calibration + held-out curve points), {plan.total_cost['seconds']:.0f}s")
    print("\n## Held-out ΔCE vs k\n| strategy | " + " | ".join(f"k={j}" for j in plan.k_values) + " |")
    print("|---|" + "---|" * len(plan.k_values))
    for s in plan.strategies:
        print(f"| {s} | " + " | ".join(f"{v:+.4f}" for v in plan.held_out_curves[s].tolist()) + " |")
    out.update({"refit": args.refit, "refit_order": args.refit_order, "ratio_best_over_C_uncorrected": ratio_plain,
                "held_out_uncorrected": plan.held_out_delta_ce_uncorrected,
                "gates": plan.gates.tolist(), "chosen": plan.strategy, "layers": plan.layers,
           "held_out_at_k": at_held, "calibration_at_k": at_cal, "ratio_best_over_C": ratio,
           "strategy_costs": plan.strategy_costs, "total_cost": plan.total_cost, "k_values": plan.k_values,
           "held_out_curves": {s: v.tolist() for s, v in plan.held_out_curves.items()},
           "plans": plan.plans, "seconds_plan": t_plan})
    return finish(out, args.json, t0)


if __name__ == "__main__":
    main()
