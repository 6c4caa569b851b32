"""Human labels of the summary keys the report shows (docs/suite.md, "Verdicts"): the page leads with the labelled
numbers; every raw key stays below, in a collapsed table. A key with no label here is shown only there."""

from typing import Any

#: raw summary key -> label (with its unit); the order of a section's labelled rows is this order
LABELS: dict[str, str] = {
    # deficit
    "deficit_mean": "mean angular deficit, 1 − mean cos(P_u a, P_u Δx) over layers",
    "deficit_mean_ci": "its 95% bootstrap CI (over sequences)",
    "deficit_mean_excluding_first": "mean angular deficit without layer 0",
    "deficit_min": "smallest layer deficit", "deficit_max": "largest layer deficit",
    "ffn_contribution_mean": "FFN's gain in one-step prediction, (e_A − e_AF) / e_A",
    "error_attention_mean": "one-step angular error with attention only, e_A (rad)",
    "error_parallel_mean": "one-step angular error with attention + FFN, e_AF (rad)",
    "untangented_deficit_mean": "deficit without the tangent projection, 1 − mean cos(a, Δx)",
    "angle_deficit_mean": "mean angle between attention and block update / π",
    "r2_attention_mean": "R² of the block's velocity explained by attention alone",
    "r2_parallel_mean": "R² of the block's velocity explained by attention + FFN",
    # ablation
    "clean_loss": "clean cross-entropy (nats per token)",
    "delta_loss_tangential": "ΔCE keeping only the tangential FFN writes (nats)",
    "delta_loss_radial": "ΔCE keeping only the radial FFN writes (nats)",
    "delta_loss_zero": "ΔCE with no FFN write at all (nats)",
    "delta_loss_random_tangent": "ΔCE with a random tangent direction of the same size (control, nats)",
    "ratio_to_zero_radial": "radial-only ΔCE / no-FFN ΔCE",
    "top1_agreement_tangential": "top-1 agreement with the clean model, tangential only",
    "top1_agreement_radial": "top-1 agreement with the clean model, radial only",
    # diversity
    "frac_layers_attention_concentrates": "share of layers where attention concentrates the directions",
    "frac_layers_ffn_diversifies": "share of layers where the FFN diversifies them",
    "final_pairwise_cosine": "final-layer mean pairwise cosine, clean (higher = more concentrated)",
    "final_pairwise_cosine_tangential": "final-layer mean pairwise cosine, tangential-only FFN",
    "final_pairwise_cosine_radial": "final-layer mean pairwise cosine, radial-only FFN",
    "pairwise_cosine_post_mean": "mean pairwise cosine after each block (mean over layers)",
    # defect and plan
    "C_min": "smallest defect C_l", "C_max": "largest defect C_l",
    "C_argmin_layer": "layer of smallest C_l", "C_argmax_layer": "layer of largest C_l",
    "spearman_C": "Spearman correlation of C_l with the single-layer ΔCE",
    "dCE_lowest_half": "ΔCE with the lowest-C half made parallel (nats)",
    "dCE_highest_half": "ΔCE with the highest-C half made parallel (nats)",
    "plan: strategy": "how the suite's plan was chosen (C: the paper's k lowest-C layers)",
    "plan: layers": "the plan: layers made parallel",
    "plan dCE": "the plan's ΔCE (nats)",
    "speedup estimate: speedup": "estimated speedup from sub-module median times (critical path, no interval)",
    "n_candidates": "sequential layers (candidates for the plan)", "k": "layers made parallel (k)",
    "calibration / held-out windows": "calibration / held-out windows",
    "chosen layers": "chosen plan: layers made parallel",
    "chosen strategy": "chosen plan: planner strategy",
    "correction": "chosen plan: correction",
    "calibration dCE": "chosen plan: ΔCE on the calibration windows (nats)",
    "held-out dCE": "chosen plan: ΔCE on the held-out windows (nats)",
    "held-out dCE without the correction": "chosen plan without its correction: held-out ΔCE (nats)",
    "lowest-C plan": "the paper's lowest-C plan: layers",
    "lowest-C plan held-out dCE (uncorrected)": "the paper's lowest-C plan, uncorrected: held-out ΔCE (nats)",
    "ratio to the lowest-C plan (held out)": "chosen / lowest-C held-out ΔCE",
    # gates
    "n_gates": "gates fitted (one per parallel FFN)",
    "delta_ce_base_heldout": "held-out ΔCE of the plan without gates (nats)",
    "delta_ce_gated_heldout": "held-out ΔCE of the plan with the gates (nats)",
    "recovered_fraction_heldout": "share of the plan's held-out ΔCE the gates recover (negative: worse)",
    "improvement_calib": "loss the gates remove on the calibration windows (nats)",
    "improvement_heldout": "loss the gates remove on the held-out windows (nats)",
    "gate_min": "smallest fitted gate", "gate_max": "largest fitted gate",
    # critical points
    "n_points": "distinct equilibria found", "saddle": "saddles", "attractor": "attractors", "repeller": "repellers",
    "equilibria": "distinct equilibria found", "saddles": "saddles", "attractors": "attractors",
    "repellers": "repellers", "saddle_share": "share of saddles",
    "mostly_saddles_in_found_set": "'mostly saddles' in the found set (exact 95% interval vs 1/2)",
    "rotational_eigenvalue_pairs": "rotational (complex) eigenvalue pairs",
    "rows_converged": "solver rows that converged", "starts_per_layer": "starts per layer",
    "solver_rows": "solver rows run (starts and the rows the finder adds)",
    # prefix
    "prefix_bitwise_equal": "earlier positions bit-identical",
    "prefix_max_angle": "largest angle change at an earlier position (rad)",
    "prefix_max_kl": "largest KL at an earlier position (nats)",
    "kl_at_perturbed": "KL at the perturbed position (nats)",
    "angle_final_at_perturbed": "last-layer angle change at the perturbed position (rad)",
    "kl_mean_later": "mean KL at later positions (nats)",
    "angle_final_mean_later": "mean last-layer angle change at later positions (rad)"}


#: raw key prefix -> label prefix (keys made per strategy, per variant, ...)
PREFIXES: dict[str, str] = {"held-out dCE, ": "held-out ΔCE (nats) of the plan of strategy "}


def labelled(summary: dict[str, Any]) -> dict[str, Any]:
    """``{label: value}`` of the keys of ``summary`` that have a label (a key ``"prefix: key"`` keeps its prefix),
    in :data:`LABELS` order, then the keys with a labelled prefix (:data:`PREFIXES`)."""
    out: dict[str, Any] = {}
    for key, label in LABELS.items():
        for raw, value in summary.items():
            head, _, tail = raw.rpartition(": ")
            if raw == key or (head and tail == key):
                out[f"{head}: {label}" if head else label] = value
    for prefix, label in PREFIXES.items():
        out.update({label + raw[len(prefix):]: v for raw, v in summary.items() if raw.startswith(prefix)})
    return out


__all__ = ["LABELS", "PREFIXES", "labelled"]
