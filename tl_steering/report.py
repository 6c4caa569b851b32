"""The main job: every protocol on one model, written as one self-contained HTML page, a results file and figures.

    tl-steering report --model smollm2-135m --text pydoc --out report [--quick]

Stages (each with its own progress bar on stderr): load the model and the token windows (clean loss, residual
identity), angular deficit (§4), radial/tangential ablation (§5), diversity (§6), sequential-to-parallel defect with
the single-layer gold standard, the low-C plan and the speedup estimate (§7), the parallel executor run on that plan
(a measured whole-forward time on this machine), FFN gates calibrated on the plan (§8), critical points of the FFN
field on a few layers (§9) and prefix sensitivity (§10).

Output directory:

* ``index.html``: one page that opens offline (plotly.js is inlined once, every figure is embedded): the paper's
  published numbers beside ours (each marked "same protocol, same model" / "same protocol, other model" / ...),
  one section per protocol with its headline numbers and figures, and the provenance of every number.
* ``results.json``: every result's ``to_dict()`` (tensors as tagged lists; ``Result.from_dict`` rebuilds them), the
  comparison table, the plan, the speedup estimate and measurement, settings, stage timings and provenance.
* ``figures/NAME.json`` (``plotly.io.from_json``) and ``figures/NAME.html`` (standalone; they share the
  ``figures/plotly.min.js`` written next to them).
"""

import dataclasses
import datetime as _dt
import html
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .backends import adapt, tl_version
from .data import text_tokens
from .errors import InputError, ModelNotSupportedError, ParallelBlockError
from .backends import load_model
from .results import Result, _encode

REPORT_FORMAT = "tl_steering.report"
REPORT_FORMAT_VERSION = 1

STAGES: tuple[str, ...] = (
    "load",
    "deficit",
    "ablation",
    "diversity",
    "defect",
    "parallel",
    "gates",
    "critical",
    "prefix",
    "write",
)

_PROTOCOL_MODULES = {
    "deficit": ("tl_steering.protocols.deficit", "angular_deficit"),
    "ablation": ("tl_steering.protocols.ablation", "ffn_ablation"),
    "diversity": ("tl_steering.protocols.diversity", "diversity"),
    "defect": ("tl_steering.protocols.defect", "parallel_defect"),
    "parallel": ("tl_steering.parallel", "parallelize"),
    "gates": ("tl_steering.gates", "calibrate_gates"),
    "critical": ("tl_steering.critical", "critical_points"),
    "prefix": ("tl_steering.prefix", "prefix_sensitivity"),
}


def _protocols() -> dict[str, Callable[..., Any]]:
    """Import every protocol the report runs; a missing one is an error, never a silent skip."""
    import importlib

    out: dict[str, Callable[..., Any]] = {}
    missing = []
    for stage, (module, name) in _PROTOCOL_MODULES.items():
        try:
            out[stage] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{module}.{name} ({type(e).__name__}: {e})")
    if missing:
        raise InputError(
            "the report runs every protocol, but these are not available in this tl_steering: "
            + "; ".join(missing)
            + ". Reinstall tl_steering (pip install -e .) or update it."
        )
    return out


# ----------------------------------------------------------------------------------------------------------
# settings


@dataclasses.dataclass
class ReportSettings:
    """Every knob of a report run (recorded in results.json and on the page).

    Defaults are sized for about 10 minutes on 2 CPU cores with SmolLM2-135M; ``quick`` for about 2 minutes.
    """

    quick: bool = False
    windows: int = 8
    length: int = 128
    n_bootstrap: int = 1000
    ablation_variants: list[str] = dataclasses.field(default_factory=lambda: ["tangential", "radial", "zero"])
    diversity_ablations: list[str] = dataclasses.field(default_factory=lambda: ["tangential", "radial"])
    diversity_gains: list[float] = dataclasses.field(default_factory=lambda: [0.5, 1.0, 1.5, 2.0])
    defect_k_values: list[int] | None = None
    defect_n_random: int = 3
    defect_brackets: bool = True
    timing_repeats: int = 5
    plan_k: int = 0
    parallel_repeats: int = 5
    gate_method: str = "closed_form"
    gate_steps: int = 0
    defect_evaluate: bool = True
    critical_layers: list[int] = dataclasses.field(default_factory=list)
    critical_n_starts: int = 8
    critical_methods: list[str] = dataclasses.field(default_factory=lambda: ["riemannian", "fixed_point"])
    prefix_layer: int = 0
    prefix_positions: list[int] = dataclasses.field(default_factory=list)
    prefix_eps: float = 1e-2
    batch_size: int = 8


def default_settings(
    n_layers: int, quick: bool = False, windows: int | None = None, length: int | None = None
) -> ReportSettings:
    """The report's settings for a model with ``n_layers`` blocks (all sized relative to the depth)."""
    windows = windows if windows is not None else (4 if quick else 8)
    length = length if length is not None else (64 if quick else 128)
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 2:
        raise InputError(
            f"--windows must be an int >= 2 (one window is held out for the gates), got {windows!r}"
        )
    if isinstance(length, bool) or not isinstance(length, int) or length < 16:
        raise InputError(f"--length must be an int >= 16, got {length!r}")
    L = n_layers
    half = L // 2
    if quick:
        ks = None  # no gold-standard curves in quick mode: the plan's loss comes from the parallel executor
        crit = [half]
        positions = [length // 4]
    else:
        ks = sorted({0, L // 4, half, (3 * L) // 4, L})
        crit = sorted({L // 4, half, (3 * L) // 4})
        positions = sorted({length // 8, length // 4, length // 2})
    return ReportSettings(
        quick=quick,
        windows=windows,
        length=length,
        n_bootstrap=200 if quick else 1000,
        ablation_variants=["tangential", "radial", "zero"],
        diversity_ablations=["tangential", "radial"],
        diversity_gains=[1.0, 2.0] if quick else [0.5, 1.0, 2.0],
        defect_k_values=ks,
        defect_n_random=0 if quick else 1,
        defect_brackets=not quick,
        defect_evaluate=not quick,
        timing_repeats=3,
        plan_k=half,
        parallel_repeats=3,
        gate_method="closed_form",
        gate_steps=0,
        critical_layers=crit,
        critical_n_starts=4 if quick else 8,
        critical_methods=["riemannian", "fixed_point"],
        prefix_layer=L // 2,
        prefix_positions=[p for p in positions if 0 < p < length],
        prefix_eps=1e-2,
        batch_size=8,
    )


# ----------------------------------------------------------------------------------------------------------
# stage bookkeeping


class _Stages:
    """One tqdm bar per stage, and wall/CPU time per stage."""

    def __init__(self, progress: bool):
        self.progress = progress
        self.timings: dict[str, dict[str, float]] = {}

    @contextmanager
    def stage(self, name: str, total: int = 1) -> Iterator[Callable[[str], None]]:
        from tqdm.auto import tqdm

        i = STAGES.index(name) + 1
        bar = tqdm(
            total=total,
            desc=f"[{i}/{len(STAGES)}] {name:<9}",
            unit="step",
            leave=True,
            file=sys.stderr,
            disable=not self.progress,
            dynamic_ncols=True,
        )
        t0, c0 = time.perf_counter(), time.process_time()

        def tick(note: str = "") -> None:
            if note:
                bar.set_postfix_str(note, refresh=False)
            bar.update(1)

        try:
            yield tick
            if bar.n < total:
                bar.update(total - bar.n)
        finally:
            self.timings[name] = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
            bar.set_postfix_str(f"{self.timings[name]['wall_s']:.1f}s", refresh=True)
            bar.close()


# ----------------------------------------------------------------------------------------------------------
# the run


def run_report(
    model: Any = "smollm2-135m",
    backend: str = "bridge",
    text: str = "pydoc",
    windows: int | None = None,
    length: int | None = None,
    out: str | Path = "report",
    device: str | None = None,
    seed: int = 0,
    quick: bool = False,
    progress: bool = True,
    settings: ReportSettings | None = None,
) -> Path:
    """Run every protocol on ``model`` and write ``out/index.html``, ``out/results.json`` and ``out/figures/``.

    Args:
        model: ``smollm2-135m`` (offline default), ``gemma-3-270m``, any TransformerLens model name, or an
            already loaded TransformerLens model (then ``backend`` and ``device`` are ignored).
        backend: ``"bridge"`` (TransformerBridge) or ``"hooked"`` (HookedTransformer, TL 3.9).
        text: ``"pydoc"`` (offline), a UTF-8 text file, or ``"hf:NAME[:CONFIG]:SPLIT"``.
        windows, length: token windows and tokens per window (default 8 x 128; ``quick``: 4 x 64).
        out: output directory (created).
        device: e.g. ``"cuda"``; default CPU.
        seed: seed of the windows, bootstraps, random controls and starts.
        quick: small settings (about 2 minutes on 2 CPU cores).
        progress: show a progress bar per stage on stderr.
        settings: explicit :class:`ReportSettings` (overrides ``windows``, ``length`` and ``quick``).

    Returns:
        The path of ``index.html``.
    """
    protocols = _protocols()
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "figures").mkdir(exist_ok=True)
    t_start = time.perf_counter()
    started = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    torch.manual_seed(seed)
    st = _Stages(progress)
    results: dict[str, Result] = {}
    extra: dict[str, Any] = {}

    with st.stage("load", total=3) as tick:
        m = load_model(model, backend=backend, device=device) if isinstance(model, str) else model
        ad = adapt(m)
        tick("model")
        s = settings or default_settings(ad.n_layers, quick=quick, windows=windows, length=length)
        tokens = text_tokens(m, source=text, n_windows=s.windows, length=s.length, seed=seed)
        tick("tokens")
        clean_loss = _mean_loss(m, tokens, [], s.batch_size)
        _, cache = ad.run_with_cache(tokens[:1], ad.identity_names())
        identity = ad.check_residual_identity(cache)
        del cache
        extra["clean_loss"] = clean_loss
        extra["max_residual_identity_error"] = max(identity.values())
        tick("checks")

    b = s.batch_size
    with st.stage("deficit"):
        results["deficit"] = protocols["deficit"](
            m, tokens, n_bootstrap=s.n_bootstrap, seed=seed, batch_size=b
        )
    with st.stage("ablation"):
        results["ablation"] = protocols["ablation"](
            m,
            tokens,
            keep=tuple(s.ablation_variants),
            scope="all",
            include_random_tangent=True,
            seed=seed,
            batch_size=b,
            n_bootstrap=s.n_bootstrap,
        )
    with st.stage("diversity"):
        results["diversity"] = protocols["diversity"](
            m,
            tokens,
            ablations=tuple(s.diversity_ablations),
            gains=tuple(s.diversity_gains),
            seed=seed,
            batch_size=b,
        )
    with st.stage("defect", total=2) as tick:
        defect = protocols["defect"](
            m,
            tokens,
            evaluate=s.defect_evaluate,
            k_values=s.defect_k_values,
            n_random=s.defect_n_random,
            brackets=s.defect_brackets,
            seed=seed,
            timing=True,
            batch_size=b,
            timing_repeats=s.timing_repeats,
        )
        results["defect"] = defect
        tick("scores")
        k = min(s.plan_k, len(defect.candidates))
        plan = defect.plan(k)
        extra["plan"] = {
            "k": k,
            "layers": plan,
            "variant": "C",
            "n_candidates": len(defect.candidates),
            **_plan_losses(m, tokens, defect, k, extra["clean_loss"], b),
        }
        extra["speedup_estimate"] = defect.speedup_estimate(plan)
        extra["plan_delta_ce"] = extra["plan"]["delta_ce_lowest"]
        tick("plan")
    with st.stage("parallel"):
        extra["parallel_executor"] = _measure_parallel(
            protocols["parallel"], m, tokens, plan, s, extra["clean_loss"]
        )
    with st.stage("gates"):
        results["gates"] = protocols["gates"](
            m, tokens, method=s.gate_method, plan=plan, seed=seed, steps=s.gate_steps, batch_size=b
        )
    with st.stage("critical", total=max(1, len(s.critical_layers) * len(s.critical_methods))) as tick:
        for method in s.critical_methods:
            key = "critical" if method == s.critical_methods[0] else f"critical_{method}"
            results[key] = _critical_summary(protocols["critical"], m, tokens, s, seed, tick, method)
    with st.stage("prefix"):
        results["prefix"] = protocols["prefix"](
            m,
            tokens,
            layer=s.prefix_layer,
            position=s.prefix_positions,
            eps=s.prefix_eps,
            mode="noise",
            seed=seed,
        )

    with st.stage("write", total=3) as tick:
        figures = _figures(results, ad.info.name)
        fig_files = _write_figures(figures, out_dir / "figures")
        tick("figures")
        provenance = results["deficit"].provenance
        comparison = comparison_rows(results, extra, ad.info.name)
        st.timings["write"] = {"wall_s": math.nan, "cpu_s": math.nan}  # filled below, once known
        meta = {
            "format": REPORT_FORMAT,
            "format_version": REPORT_FORMAT_VERSION,
            "started": started,
            "arguments": {
                "model": model if isinstance(model, str) else ad.info.name,
                "backend": backend,
                "text": text,
                "windows": windows,
                "length": length,
                "out": str(out),
                "device": device,
                "seed": seed,
                "quick": quick,
            },
            "command": " ".join(sys.argv) if sys.argv and "tl-steering" in Path(sys.argv[0]).name else None,
            "settings": dataclasses.asdict(s),
            "provenance": dataclasses.asdict(provenance),
            "environment": _environment(),
            "model": {
                "name": ad.info.name,
                "revision": ad.info.revision,
                "n_layers": ad.n_layers,
                "d_model": ad.d_model,
                "backend": ad.backend,
                "processing": ad.info.processing,
                "dtype": str(ad.dtype).removeprefix("torch."),
                "device": str(ad.device),
                "prepend_bos": ad.info.prepend_bos,
            },
        }
        total = time.perf_counter() - t_start
        doc = {
            **meta,
            "total_wall_s": total,
            "timings": st.timings,
            "headline": headline(results, extra),
            "comparison": comparison,
            **extra,
            "figures": fig_files,
            "results": {name: r.to_dict() for name, r in results.items()},
        }
        tick("results")
        page = render_html(doc, results, figures)
        (out_dir / "index.html").write_text(page, encoding="utf-8")
        tick("html")
    # the write stage's own time goes into results.json after it is known
    doc["timings"] = st.timings
    doc["total_wall_s"] = time.perf_counter() - t_start
    (out_dir / "results.json").write_text(
        json.dumps(_encode(doc), indent=1, allow_nan=False), encoding="utf-8"
    )
    return out_dir / "index.html"


def _mean_loss(model: Any, tokens: torch.Tensor, hooks: list, batch_size: int) -> float:
    """Mean next-token CE over every predicted position of ``tokens``, in batches, with ``hooks``."""
    ad = adapt(model)
    losses = [
        ad.loss_per_token(tokens[i : i + batch_size], hooks).reshape(-1)
        for i in range(0, tokens.shape[0], batch_size)
    ]
    return float(torch.cat(losses).mean())


def _plan_losses(
    model: Any, tokens: torch.Tensor, defect: Any, k: int, clean_loss: float, batch_size: int
) -> dict[str, Any]:
    """dCE with the k lowest-C and the k highest-C layers made parallel (the surrogate hooks of §7).

    Taken from the defect curves when they hold k, else measured here (two hooked forwards over the tokens).
    """
    from .hooks import parallel_blocks

    high = sorted(
        sorted(defect.candidates, key=lambda lay: -float(defect.score[defect.layers.index(lay)]))[:k]
    )
    out: dict[str, Any] = {"highest_layers": high}
    if defect.evaluated and k in defect.k_values:
        j = defect.k_values.index(k)
        out.update(
            delta_ce_lowest=float(defect.curves["lowest"][j]),
            delta_ce_highest=float(defect.curves["highest"][j]),
            source="defect curves (evaluate=True)",
        )
        return out
    for name, layers in (("lowest", defect.plan(k)), ("highest", high)):
        hooks = parallel_blocks(model, layers)
        out[f"delta_ce_{name}"] = _mean_loss(model, tokens, hooks, batch_size) - clean_loss
    out["source"] = "measured by the report (parallel_blocks hooks)"
    return out


def _measure_parallel(
    parallelize: Callable[..., Any],
    model: Any,
    tokens: torch.Tensor,
    plan: list[int],
    s: ReportSettings,
    clean_loss: float,
) -> dict[str, Any]:
    """Run the plan with the real parallel executor: loss and median whole-forward time against the original."""
    ad = adapt(model)
    sl = tokens[: s.batch_size]
    info: dict[str, Any] = {
        "label": "measured on this machine: whole forward, fused parallel blocks "
        "(tl_steering.parallel.parallelize), median wall time",
        "layers": list(plan),
        "timing_shape": list(sl.shape),
        "device": str(ad.device),
    }
    if not plan:
        info.update(status="skipped", reason="the plan is empty (no sequential layer to parallelize)")
        return info
    try:
        par = parallelize(model, plan)
    except (ModelNotSupportedError, ParallelBlockError) as e:
        info.update(status="not supported", reason=f"{type(e).__name__}: {e}")
        return info

    def median_time(mdl: Any) -> float:
        times = []
        with torch.no_grad():
            mdl(sl, return_type="logits")  # warm-up
            for _ in range(s.parallel_repeats):
                if ad.device.type == "cuda":
                    torch.cuda.synchronize(ad.device)
                t0 = time.perf_counter()
                mdl(sl, return_type="logits")
                if ad.device.type == "cuda":
                    torch.cuda.synchronize(ad.device)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    t_seq = median_time(model)
    t_par = median_time(par)
    par_loss = _mean_loss(par, tokens, [], s.batch_size)
    del par
    info.update(
        status="ok",
        t_forward_sequential_s=t_seq,
        t_forward_parallel_s=t_par,
        measured_speedup=t_seq / t_par if t_par > 0 else math.nan,
        loss=par_loss,
        delta_ce=par_loss - clean_loss,
    )
    return info


def _critical_summary(
    critical_points: Callable[..., Any],
    model: Any,
    tokens: torch.Tensor,
    s: ReportSettings,
    seed: int,
    tick: Callable[[str], None],
    method: str,
) -> Result:
    """critical_points per layer (one progress step each), gathered into a CriticalSummary.

    ``method="riemannian"`` is the unbiased finder (saddles as readily as attractors); ``"fixed_point"`` is the
    cheap nonlinear power iteration, biased toward points stable for the map (shown separately, labelled so).
    """
    from .critical import CriticalSummary
    from .equilibria import LABELS

    ad = adapt(model)
    layers = ad.layers(s.critical_layers)
    res = []
    for layer in layers:
        r = critical_points(
            model, layer, field="ffn", n_starts=s.critical_n_starts, tokens=tokens, seed=seed, method=method
        )
        res.append(r)
        tick(f"{method} layer {layer}: {r.n_points} points")
    counts = torch.tensor([[r.labels.count(lab) for lab in LABELS] for r in res], dtype=torch.int64)
    return CriticalSummary(
        provenance=ad.provenance(
            tokens,
            seed=seed,
            protocol="critical_points",
            layers=layers,
            field="ffn",
            radius="median",
            n_starts=s.critical_n_starts,
            method=method,
        ),
        layers=layers,
        field="ffn",
        counts=counts.reshape(len(layers), len(LABELS)),
        rotational=torch.tensor([int(sum(r.rotational)) for r in res], dtype=torch.int64),
        n_points=torch.tensor([r.n_points for r in res], dtype=torch.int64),
        n_converged=torch.tensor([r.n_converged for r in res], dtype=torch.int64),
        radius=torch.tensor([float(r.options["radius"]) for r in res], dtype=torch.float64),
        seconds=torch.tensor([float(r.seconds) for r in res], dtype=torch.float64),
        results=res,
    )


def _environment() -> dict[str, Any]:
    from . import __version__

    return {
        "tl_steering": __version__,
        "transformer_lens": tl_version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


# ----------------------------------------------------------------------------------------------------------
# numbers: headline and the comparison with the paper


def _f(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def headline(results: dict[str, Result], extra: dict[str, Any]) -> dict[str, Any]:
    """The scalars the page leads with (all also inside each result)."""
    d, a, v, c = results["deficit"], results["ablation"], results["diversity"], results["defect"]
    g, cr, p = results["gates"], results["critical"], results["prefix"]
    vs = v.summary()
    out = {
        "clean_loss": extra["clean_loss"],
        "max_residual_identity_error": extra["max_residual_identity_error"],
        "deficit_mean": d.mean,
        "deficit_mean_ci": list(d.mean_ci),
        "deficit_mean_excluding_first": d.mean_excluding_first,
        "ffn_contribution_mean": d.ffn_contribution_mean,
        **{f"ablation_delta_loss_{k}": val for k, val in a.delta_loss.items()},
        "ablation_ratio_to_zero_radial": a.ratio_to_zero.get("radial", math.nan),
        "diversity_frac_layers_attention_concentrates": vs["frac_layers_attention_concentrates"],
        "diversity_frac_layers_ffn_diversifies": vs["frac_layers_ffn_diversifies"],
        "defect_C_min": c.summary().get("C_min", math.nan),
        "defect_C_max": c.summary().get("C_max", math.nan),
        "defect_spearman_C": c.spearman.get("C", math.nan),
        "plan_k": extra["plan"]["k"],
        "plan_layers": extra["plan"]["layers"],
        "plan_delta_ce": extra["plan_delta_ce"],
        "speedup_estimate": extra["speedup_estimate"]["speedup"],
        "speedup_estimate_with_other": extra["speedup_estimate"]["speedup_with_other"],
        "parallel_measured_speedup": extra["parallel_executor"].get("measured_speedup", math.nan),
        "parallel_executor_delta_ce": extra["parallel_executor"].get("delta_ce", math.nan),
        "gates_delta_ce_base_heldout": g.summary()["delta_ce_base_heldout"],
        "gates_delta_ce_gated_heldout": g.summary()["delta_ce_gated_heldout"],
        "critical_n_points": int(cr.n_points.sum()),
        "critical_saddle_fraction": cr.saddle_fraction(),
        "critical_rotational_points": int(cr.rotational.sum()),
        "critical_converged_starts": int(cr.n_converged.sum()),
        "critical_fixed_point_counts": results["critical_fixed_point"].totals()
        if "critical_fixed_point" in results
        else None,
        "prefix_max_angle": p.prefix_max_angle,
        "prefix_bitwise_equal": p.prefix_bitwise_equal,
    }
    return out


def _same_model(paper_model: str, ours: str) -> bool:
    ours = ours.lower()
    names = [m.strip() for m in paper_model.split(",")]
    aliases = {
        "gpt2": ("gpt2",),
        "gpt2-large": ("gpt2-large",),
        "pythia": ("pythia",),
        "mistral-7b": ("mistral",),
        "llama-3-8b": ("llama-3-8b", "meta-llama-3-8b"),
    }
    for n in names:
        for alias in aliases.get(n, ()):
            if n == "gpt2" and ours in ("gpt2", "openai-community/gpt2"):
                return True
            if n != "gpt2" and alias in ours:
                return True
    return False


def _in_band(value: float, band: Sequence[float | None] | None) -> bool | None:
    if band is None or not math.isfinite(value):
        return None
    lo, hi = band
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def comparison_rows(
    results: dict[str, Result], extra: dict[str, Any], model_name: str
) -> list[dict[str, Any]]:
    """One row per published number (tl_steering/reference/published.json) with our value beside it."""
    from .reference import published_numbers

    d, a, v, cr = (results[k] for k in ("deficit", "ablation", "diversity", "critical"))
    vs = v.summary()
    k = extra["plan"]["k"]
    n_cand = extra["plan"]["n_candidates"]
    fin = v.final_diversity_under_ablation
    fin_clean = v.final_diversity.get("pairwise_cosine", math.nan)
    fin_t = fin.get("tangential", {}).get("pairwise_cosine", math.nan)
    fin_r = fin.get("radial", {}).get("pairwise_cosine", math.nan)
    lo_v, hi_v = extra["plan"]["delta_ce_lowest"], extra["plan"]["delta_ce_highest"]
    high_lo = hi_v / lo_v if lo_v > 0 else (math.inf if hi_v > 0 else math.nan)
    totals = cr.totals()
    n_eq, n_conv = int(cr.n_points.sum()), int(cr.n_converged.sum())
    n_starts = sum(int(r.n_starts) for r in cr.results)
    ours: dict[str, tuple[Any, str]] = {
        "deficit_gpt2": (
            d.mean,
            f"mean over {len(d.layers)} layers, 95% CI [{d.mean_ci[0]:.3f}, {d.mean_ci[1]:.3f}]",
        ),
        "deficit_llama3_8b": (d.mean, "as above"),
        "deficit_pythia": (d.mean, "as above"),
        "deficit_mistral": (d.mean, "as above"),
        "deficit_order_gpt2_llama": (None, "needs two models: tests/published runs it where both load"),
        "one_step_prediction_improves": (d.ffn_contribution_mean, "(e_A - e_AF) / e_A, mean over layers"),
        "ablation_tangential": (a.delta_loss.get("tangential", math.nan), "all layers at once"),
        "ablation_radial": (a.delta_loss.get("radial", math.nan), "all layers at once"),
        "ablation_radial_like_zero": (
            a.ratio_to_zero.get("radial", math.nan),
            f"dCE(zero FFN) = {a.delta_loss.get('zero', math.nan):.3f}",
        ),
        "parallel_gpt2_large_delta_ce": (extra["plan_delta_ce"], f"k = {k} lowest-C of {n_cand} layers"),
        "parallel_gpt2_large_high_defect_degrades": (high_lo, f"dCE(highest {k}) / dCE(lowest {k})"),
        "parallel_gpt2_large_speedup": (
            extra["speedup_estimate"]["speedup"],
            f"k = {k}; timed on {extra['speedup_estimate'].get('device', '?')} "
            "(the paper: GPU sub-module times)",
        ),
        "critical_mostly_saddles": (
            cr.saddle_fraction() if n_eq else None,
            f"Riemannian finder, layers {cr.layers}: {totals.get('saddle', 0)} saddles, {totals.get('attractor', 0)} "
            f"attractors, {totals.get('repeller', 0)} repellers of {n_eq} points ({n_conv} of {n_starts} starts "
            "converged)"
            if n_eq
            else f"no equilibrium found: {n_conv} of {n_starts} starts of the Riemannian "
            f"finder converged on layers {cr.layers}",
        ),
        "critical_rotational_modes": (
            totals.get("rotational", 0) if n_eq else None,
            "points with a rotational mode" if n_eq else "no equilibrium found",
        ),
        "diversity_attention_contracts": (vs["frac_layers_attention_concentrates"], "fraction of layers"),
        "diversity_ffn_restores": (vs["frac_layers_ffn_diversifies"], "fraction of layers"),
        "diversity_tangential_preserves": (
            (abs(fin_t - fin_clean) < abs(fin_r - fin_clean))
            if math.isfinite(fin_t + fin_r + fin_clean)
            else None,
            f"final pairwise cosine: clean {fin_clean:.3f}, tangential-only {fin_t:.3f}, radial-only {fin_r:.3f}",
        ),
        "eq19_radial_coefficient": (
            None,
            "our split uses u = normalize(FFN input) = resid_mid (sequential blocks)",
        ),
        "low_trust_auto_summaries": (None, "not compared: low trust"),
    }
    rows = []
    for pub in published_numbers():
        value, note = ours.get(pub["id"], (None, "not computed by the report"))
        if not pub["regress"]:
            relation = "not compared (definition)" if pub["spec_row"] == 9 else "not compared (low trust)"
        elif value is None:
            relation = "not comparable from one model"
        elif pub["model"] == "all":
            relation = "same protocol, other model (the paper's value spans its models)"
        elif _same_model(pub["model"], model_name):
            relation = "same protocol, same model"
        else:
            relation = "same protocol, other model"
        if pub["id"] == "parallel_gpt2_large_speedup" and relation.startswith("same protocol"):
            relation += "; CPU timing" if "cpu" in str(extra["speedup_estimate"].get("device", "")) else ""
        num = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if isinstance(value, bool):
            in_band = value
        elif pub["id"] == "deficit_order_gpt2_llama" or num is None:
            in_band = None
        else:
            in_band = _in_band(float(num), pub["band"])
        rows.append(
            {
                "id": pub["id"],
                "spec_row": pub["spec_row"],
                "claim": pub["description"],
                "paper_model": pub["model_label"],
                "paper_value": _paper_value(pub),
                "band": pub["band"],
                "certainty": pub["certainty"],
                "ours": value,
                "ours_note": note,
                "our_model": model_name,
                "relation": relation,
                "in_paper_band": in_band,
                "regress": pub["regress"],
            }
        )
    return rows


def _paper_value(pub: dict[str, Any]) -> str:
    if pub["value"] is not None:
        return f"{pub['value']:g}"
    if pub["range"] is not None:
        return f"{pub['range'][0]:g} - {pub['range'][1]:g}"
    return pub["tolerance"] if pub["regress"] else pub["metric"]


# ----------------------------------------------------------------------------------------------------------
# figures


def _figures(results: dict[str, Result], model_name: str) -> dict[str, Any]:
    """Every figure of the page, titled by us (user-supplied names escaped)."""
    mn = html.escape(model_name)
    d, a, v, c, g, cr, p = (
        results[k] for k in ("deficit", "ablation", "diversity", "defect", "gates", "critical", "prefix")
    )
    figs = {
        "deficit_layers": d.plot(title=f"Angular deficit per layer (mean {d.mean:.3f}; {mn})"),
        "deficit_positions": d.plot_positions(title=f"Angular deficit by layer and position bin ({mn})"),
        "ablation": a.plot(title=f"FFN component ablation, all layers (clean CE {a.clean_loss:.3f}; {mn})"),
        "diversity": v.plot(title=f"Direction diversity ({mn})"),
        "defect_scores": c.plot(title=f"Sequential-to-parallel defect C_l ({mn})"),
        "gates": g.plot(title=f"FFN gates on the low-C plan ({g.method}; {mn})"),
        "critical_counts": cr.plot(
            title=f"Critical points of the FFN field (saddle fraction {cr.saddle_fraction():.2f}; {mn})"
        ),
        "prefix": p.plot(title=f"Prefix sensitivity (noise at layer {p.perturb_layer}; {mn})"),
    }
    if c.evaluated:
        figs["defect_curves"] = c.plot_curves(title=f"Loss increase vs layers made parallel ({mn})")
    for key, label in (("critical", "Riemannian finder"), ("critical_fixed_point", "fixed-point finder")):
        summ = results.get(key)
        if summ is None:
            continue
        if key != "critical":
            figs[f"{key}_counts"] = summ.plot(
                title=f"Critical points of the FFN field, {label} (biased to stable points; {mn})"
            )
        best = max(range(len(summ.results)), key=lambda i: summ.results[i].n_points) if summ.results else None
        if best is not None and summ.results[best].n_points:
            r = summ.results[best]
            figs[f"{key}_spectra"] = r.plot(
                title=f"Tangent spectra at layer {summ.layers[best]}, {label} ({r.n_points} equilibria; {mn})"
            )
    return figs


def _write_figures(figures: dict[str, Any], fig_dir: Path) -> dict[str, dict[str, str]]:
    out = {}
    first = True
    for name, fig in figures.items():
        (fig_dir / f"{name}.json").write_text(fig.to_json(), encoding="utf-8")
        # the first standalone page copies plotly.min.js next to itself; the others reference it
        fig.write_html(
            str(fig_dir / f"{name}.html"),
            include_plotlyjs="directory" if first else "plotly.min.js",
            full_html=True,
        )
        first = False
        out[name] = {"json": f"figures/{name}.json", "html": f"figures/{name}.html"}
    return out


# ----------------------------------------------------------------------------------------------------------
# HTML

_CSS = """
body{font-family:-apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:0;color:#222;
background:#fafafa}
main{max-width:1280px;margin:0 auto;padding:1.5rem 2rem 4rem;background:#fff}
h1{font-size:1.7rem;margin-bottom:.2rem} h2{border-bottom:2px solid #1f77b4;padding-bottom:.2rem;margin-top:2.5rem}
h3{margin-top:1.5rem}
table{border-collapse:collapse;margin:.6rem 0;font-size:.88rem} th,td{border:1px solid #ddd;padding:.3rem .5rem;
vertical-align:top;text-align:left} th{background:#f0f4f8} td.num{text-align:right;font-variant-numeric:tabular-nums}
.muted{color:#777} .ok{color:#1a7f37;font-weight:600} .off{color:#b35900;font-weight:600}
.tag{display:inline-block;padding:0 .35rem;border-radius:.3rem;background:#eef;font-size:.8rem}
.lowtrust td{color:#999;background:#fcfcfc} nav a{margin-right:.9rem} .fig{margin:1rem 0 2rem}
.note{background:#f6f8fa;border-left:4px solid #1f77b4;padding:.5rem .8rem;margin:.8rem 0}
code{background:#f3f3f3;padding:0 .2rem;border-radius:.2rem}
"""


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt(x: Any) -> str:
    """A number or value as short text (escaped)."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if math.isnan(x):
            return "n/a"
        if math.isinf(x):
            return "∞" if x > 0 else "-∞"
        return _esc(f"{x:.4g}")
    if isinstance(x, (list, tuple)):
        if len(x) > 12:
            return _esc(", ".join(str(v) for v in x[:12]) + f", ... ({len(x)} items)")
        return ", ".join(_fmt(v) for v in x)
    if isinstance(x, dict):
        return _esc(json.dumps(_encode(x))[:300])
    return _esc(x)


def _kv_table(d: dict[str, Any]) -> str:
    rows = "".join(f"<tr><th>{_esc(k)}</th><td class='num'>{_fmt(v)}</td></tr>" for k, v in d.items())
    return f"<table>{rows}</table>"


def _figure_html(fig: Any, name: str) -> str:
    height = fig.layout.height or 480
    div = fig.to_html(
        full_html=False,
        include_plotlyjs=False,
        div_id=f"fig-{name}",
        default_width="100%",
        default_height=f"{int(height)}px",
        config={"displaylogo": False, "responsive": True},
    )
    return f"<div class='fig' id='figure-{_esc(name)}'>{div}</div>"


_SECTIONS = [
    (
        "deficit",
        "Angular deficit (protocol 1, MATH_SPEC §4)",
        "How well the attention-only update aligns with the real block update, on the tangent space at the block "
        "input: deficit<sub>l</sub> = 1 − mean cos(P<sub>u</sub>a, P<sub>u</sub>Δx) (position 0 excluded). A large "
        "deficit means the FFN drives much of the change of direction.",
        ["deficit_layers", "deficit_positions"],
    ),
    (
        "ablation",
        "Radial / tangential FFN ablation (protocol 2, §5)",
        "Every FFN write keeps only its tangential part (P<sub>u</sub>φ) or its radial part (⟨u,φ⟩u), u = the FFN "
        "input direction, all layers at once; ΔCE against the clean model.",
        ["ablation"],
    ),
    (
        "diversity",
        "Diversity under aggregation (protocol 3, §6)",
        "Mean pairwise cosine of the token directions before attention, after attention and after the FFN "
        "(higher = more concentrated), clean and under the ablations, and the effect of scaling attention writes.",
        ["diversity"],
    ),
    (
        "defect",
        "Sequential-to-parallel defect C<sub>l</sub> (protocol 4, §7)",
        "C<sub>l</sub> = RMS of d = Φ(x+a) − Φ(x) relative to the block update; the gold standard is the CE increase "
        "with layer l alone made parallel. Curves: the k lowest-C, highest-C, contiguous and random layers made "
        "parallel.",
        ["defect_scores", "defect_curves"],
    ),
    (
        "gates",
        "FFN gates on the low-C plan (§8)",
        "One scalar gate per FFN on top of the parallelized plan, fitted on a calibration split and evaluated on "
        "held-out windows.",
        ["gates"],
    ),
    (
        "critical",
        "Critical points of the FFN field (§9)",
        "Equilibria u* of F(u) = Φ(ρu) on the sphere (P<sub>u</sub>F(u) = 0), classified by the tangent spectrum "
        "of M = QᵀDF Q − λI: attractor, repeller, saddle, with rotational modes. First the Riemannian finder "
        "(minimises ½||P<sub>u</sub>F||²/||F||²: saddles are found as readily as attractors; the comparison with the "
        "paper uses it), then the cheap fixed-point iteration u ← sign(λ) normalize(F(u)), which only converges to "
        "points stable for that map (biased toward attractors: shown for orientation, never compared).",
        [
            "critical_counts",
            "critical_spectra",
            "critical_fixed_point_counts",
            "critical_fixed_point_spectra",
        ],
    ),
    (
        "prefix",
        "Prefix-indexed causal dynamics (§10)",
        "A small perturbation of the residual at position j spreads only forward: positions i &lt; j must be "
        "unchanged, later ones change with distance.",
        ["prefix"],
    ),
]


def render_html(doc: dict[str, Any], results: dict[str, Result], figures: dict[str, Any]) -> str:
    """The self-contained page (plotly.js inlined once in the head)."""
    from plotly.offline import get_plotlyjs

    model = doc["model"]
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>tl_steering report: {_esc(model['name'])}</title>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<style>{_CSS}</style>",
        f"<script type='text/javascript'>{get_plotlyjs()}</script>",
        "</head><body><main>",
        f"<h1>Feed-forward steering report: {_esc(model['name'])}</h1>",
        "<p class='muted'>tl_steering "
        + _esc(doc["environment"]["tl_steering"])
        + " · arXiv:2608.02071 (Mudarisov, Burtsev, State) · "
        + _esc(doc["provenance"]["corpus"])
        + " · "
        + f"{_esc(doc['started'])} · {doc['total_wall_s']:.0f} s"
        + (" · quick settings" if doc["settings"]["quick"] else "")
        + "</p>",
        "<nav><a href='#summary'>Summary vs paper</a>"
        + "".join(f"<a href='#{key}'>{_esc(key)}</a>" for key, *_ in _SECTIONS)
        + "<a href='#parallel'>parallel executor</a><a href='#provenance'>Provenance</a></nav>",
    ]
    parts.append(_summary_section(doc))
    for key, title, text, figs in _SECTIONS:
        parts.append(f"<h2 id='{key}'>{title}</h2><p>{text}</p>")
        summ = results[key].summary() if key in results else {}
        if key == "critical" and "critical_fixed_point" in results:
            fp = results["critical_fixed_point"].summary()
            summ = {
                **{f"Riemannian: {k}": v for k, v in summ.items()},
                **{f"fixed point: {k}": v for k, v in fp.items()},
            }
        if key == "defect":
            summ = {
                **summ,
                "plan (k lowest C)": doc["plan"]["layers"],
                "plan dCE": doc["plan_delta_ce"],
                **{
                    f"speedup estimate: {k}": v
                    for k, v in doc["speedup_estimate"].items()
                    if k in ("speedup", "speedup_with_other", "T_seq_s", "T_par_s", "label")
                },
            }
        parts.append(_kv_table(summ))
        for name in figs:
            if name in figures:
                parts.append(_figure_html(figures[name], name))
        if key == "defect":
            parts.append(_parallel_section(doc))
    parts.append(_provenance_section(doc))
    parts.append(
        "<p class='muted'>Figures are also in <code>figures/</code> (plotly JSON and standalone HTML); "
        "every number is in <code>results.json</code>.</p>"
    )
    parts.append("</main></body></html>")
    return "\n".join(parts)


def _summary_section(doc: dict[str, Any]) -> str:
    h = doc["headline"]
    model = _esc(doc["model"]["name"])
    rows = []
    for r in doc["comparison"]:
        band = r["in_paper_band"]
        mark = (
            "—"
            if band is None
            else ("<span class='ok'>inside</span>" if band else "<span class='off'>outside</span>")
        )
        cls = " class='lowtrust'" if not r["regress"] else ""
        rows.append(
            f"<tr{cls}><td>{_esc(r['claim'])}</td><td>{_esc(r['paper_model'])}</td>"
            f"<td class='num'>{_esc(r['paper_value'])}</td><td><span class='tag'>[{_esc(r['certainty'])}]</span></td>"
            f"<td class='num'>{_fmt(r['ours'])}</td><td>{_esc(r['ours_note'])}</td><td>{_esc(r['relation'])}</td>"
            f"<td>{mark}</td></tr>"
        )
    key = {
        "clean CE (nats)": h["clean_loss"],
        "angular deficit (mean)": h["deficit_mean"],
        "ΔCE tangential-only": h.get("ablation_delta_loss_tangential"),
        "ΔCE radial-only": h.get("ablation_delta_loss_radial"),
        "ΔCE zero FFN": h.get("ablation_delta_loss_zero"),
        f"plan: {h['plan_k']} lowest-C layers, ΔCE": h["plan_delta_ce"],
        "speedup estimate (sub-module times)": h["speedup_estimate"],
        "parallel executor: measured forward speedup": h["parallel_measured_speedup"],
        "critical points: saddle fraction": h["critical_saddle_fraction"],
        "prefix positions i < j unchanged bitwise": h["prefix_bitwise_equal"],
    }
    return (
        f"<h2 id='summary'>Summary: the paper's numbers beside ours ({model})</h2>"
        "<div class='note'>The paper reports GPT-2, GPT-2-large, Pythia, Mistral and Llama-3-8B; this run is on "
        f"<b>{model}</b>, so most rows are <i>the same protocol on another model</i>: they show where this model "
        "sits, not whether the package reproduces the paper (that is <code>pytest -m published</code>, on the "
        "paper's models). Certainty: [P] the paper says it, [S] only the summary we started from, [I] our "
        'inference. "Band" is the regression band of the paper\'s number (MATH_SPEC §12), shown for orientation.'
        "</div>"
        + _kv_table(key)
        + "<table><tr><th>claim</th><th>paper model</th><th>paper value</th><th>certainty</th><th>ours</th>"
        "<th>how ours was measured</th><th>relation</th><th>in the paper's band?</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def _parallel_section(doc: dict[str, Any]) -> str:
    pe = doc["parallel_executor"]
    return (
        "<h3 id='parallel'>The plan run by the parallel executor</h3><p>The low-C plan made parallel for real "
        "(<code>tl_steering.parallel.parallelize</code>, fused blocks) and timed as a whole forward on this "
        "machine; the estimate above is the critical-path model of the paper.</p>" + _kv_table(pe)
    )


def _provenance_section(doc: dict[str, Any]) -> str:
    timings = {
        k: f"{v['wall_s']:.1f} s wall, {v['cpu_s']:.1f} s CPU" if math.isfinite(v["wall_s"]) else "—"
        for k, v in doc["timings"].items()
    }
    args = {k: v for k, v in doc["arguments"].items()}
    return (
        "<h2 id='provenance'>Provenance</h2><h3>Model and data</h3>"
        + _kv_table(doc["model"])
        + _kv_table(doc["provenance"])
        + "<h3>Arguments and settings</h3>"
        + _kv_table(args)
        + _kv_table(doc["settings"])
        + "<h3>Environment</h3>"
        + _kv_table(doc["environment"])
        + "<h3>Stage timings</h3>"
        + _kv_table(timings)
    )


__all__ = [
    "REPORT_FORMAT",
    "ReportSettings",
    "STAGES",
    "comparison_rows",
    "default_settings",
    "headline",
    "render_html",
    "run_report",
]
