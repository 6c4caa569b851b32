"""Result classes of the critical-point analysis (see docs/critical_points.md)."""

import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from jaxtyping import Complex, Float, Int
from torch import Tensor

from .._util.claims import Claim, pct, plural
from ..errors import InputError
from ..reference import paper_statement
from ..results import Result, register
from ..stats import chao1, clopper_pearson, proportion_verdict
from .options import DEFAULT_FINDER, LABEL_TOL, ROT_RATIO
from .spectrum import LABELS


_COLORS = {"attractor": "#2ca02c", "repeller": "#d62728", "saddle": "#1f77b4", "degenerate": "#7f7f7f"}


def _empty(*shape: int, dtype: torch.dtype = torch.float64) -> Callable[[], Tensor]:
    return lambda: torch.zeros(*shape, dtype=dtype)


@register
@dataclasses.dataclass
class PointClassification(Result):
    """Tangent spectrum and label of one point (:func:`classify_point`; fields: docs/critical_points.md, "Result
    fields")."""

    point: Float[Tensor, " d_model"] = dataclasses.field(default_factory=_empty(0))
    lam: float = math.nan
    residual: float = math.nan
    eigenvalues: Complex[Tensor, " k"] = dataclasses.field(default_factory=_empty(0, dtype=torch.complex128))
    label: str = "degenerate"
    rotational: bool = False
    index: int = 0
    spectral_abscissa: float = math.nan
    near_zero: int = 0
    max_im_re: float = math.nan
    rotational_fraction: float = math.nan
    eigensolver: str = "dense"

    kind = "point_classification"

    def summary(self) -> dict[str, Any]:
        return {"label": self.label, "lambda": self.lam, "residual": self.residual, "index": self.index,
                "spectral_abscissa": self.spectral_abscissa, "rotational": self.rotational,
                "near_zero": self.near_zero, "max_im_re": self.max_im_re, "eigensolver": self.eigensolver}


@register
@dataclasses.dataclass
class EquilibriaResult(Result):
    """Distinct equilibria found on S^{d-1}, sorted by λ (descending), with their tangent spectra (fields:
    docs/critical_points.md, "Result fields")."""

    points: Float[Tensor, "n d_model"] = dataclasses.field(default_factory=_empty(0, 0))
    lambdas: Float[Tensor, " n"] = dataclasses.field(default_factory=_empty(0))
    residuals: Float[Tensor, " n"] = dataclasses.field(default_factory=_empty(0))
    eigenvalues: Complex[Tensor, "n k"] = dataclasses.field(default_factory=_empty(0, 0, dtype=torch.complex128))
    labels: list[str] = dataclasses.field(default_factory=list)
    rotational: list[bool] = dataclasses.field(default_factory=list)
    index: list[int] = dataclasses.field(default_factory=list)
    spectral_abscissa: Float[Tensor, " n"] = dataclasses.field(default_factory=_empty(0))
    near_zero: list[int] = dataclasses.field(default_factory=list)
    max_im_re: Float[Tensor, " n"] = dataclasses.field(default_factory=_empty(0))
    rotational_fraction: Float[Tensor, " n"] = dataclasses.field(default_factory=_empty(0))
    hits: list[int] = dataclasses.field(default_factory=list)
    start_index: list[int] = dataclasses.field(default_factory=list)
    start_kind: list[str] = dataclasses.field(default_factory=list)
    dim: int = 0
    n_starts: int = 0
    n_converged: int = 0
    method: str = DEFAULT_FINDER
    eigensolver: str = "dense"
    seconds: float = 0.0
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    kind = "equilibria"

    def __post_init__(self) -> None:
        n = int(self.points.shape[0])
        for name in ("lambdas", "residuals", "eigenvalues", "labels", "rotational", "index", "spectral_abscissa",
                     "near_zero", "max_im_re", "rotational_fraction", "hits", "start_index", "start_kind"):
            if len(value := getattr(self, name)) != n:
                raise InputError(f"EquilibriaResult.{name} has {len(value)} entries for {n} points; build it "
                                 "with find_equilibria")
        bad = set(self.labels) - set(LABELS)
        if bad:
            raise InputError(f"unknown labels {sorted(bad)}; expected some of {LABELS}")

    @property
    def n_points(self) -> int:
        return int(self.points.shape[0])

    def morse_histogram(self) -> dict[int, int]:
        """Number of points per Morse index (eigenvalues with Re > tol; a lower bound for ARPACK spectra)."""
        return dict(sorted(Counter(int(k) for k in self.index).items()))

    def rotational_pairs(self) -> list[int]:
        """Per point, the number of complex-conjugate pairs that are rotational (|Im| > rot_ratio·|Re|, Im > 0)."""
        out = []
        for k in range(self.n_points):
            ev = self.eigenvalues[k]
            ev = ev[torch.isfinite(ev.real) & torch.isfinite(ev.imag)]
            if ev.numel() == 0:
                out.append(0)
                continue
            tol = LABEL_TOL * float(ev.abs().max())
            rot = (ev.imag > torch.clamp(ROT_RATIO * ev.real.abs(), min=tol))
            out.append(int(rot.sum()))
        return out

    def counts(self) -> dict[str, int]:
        """Number of points per label, plus ``rotational`` (points with at least one rotational mode)."""
        out = {name: self.labels.count(name) for name in LABELS}
        out["rotational"] = int(sum(self.rotational))
        return out

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dim": self.dim, "n_starts": self.n_starts, "n_converged": self.n_converged,
                               "n_points": self.n_points, "method": self.method, "eigensolver": self.eigensolver,
                               "seconds": self.seconds, **self.counts()}
        if self.n_points:
            out["lambda_max"] = float(self.lambdas.max())
            out["lambda_min"] = float(self.lambdas.min())
            out["max_residual"] = float(self.residuals.max())
            out["median_spectral_abscissa"] = float(self.spectral_abscissa.median())
            out["mean_index"] = float(np.mean(self.index))
        return out

    def parity(self) -> dict[str, Any]:
        """Poincaré-Hopf check of the found set (docs/critical_points.md section 4): ``missing_at_least``, a lower
        bound on equilibria not found, None where the check does not apply (a degenerate point, ARPACK spectra)."""
        n = self.dim - 1
        euler = 1 + (-1) ** n if self.dim else 0
        total = sum((-1) ** (n - int(k)) for k in self.index)
        valid = self.eigensolver == "dense" and "degenerate" not in self.labels and self.dim > 0
        return {"index_sum": int(total), "euler_characteristic": int(euler),
                "missing_at_least": abs(int(total) - int(euler)) if valid else None}

    def plot(self, title: str | None = None):
        """Tangent eigenvalues of every point in the complex plane, one colour per label (plotly Figure)."""
        import plotly.graph_objects as go

        fig = go.Figure()
        for label in LABELS:
            rows = [i for i, lab in enumerate(self.labels) if lab == label]
            if not rows:
                continue
            ev = self.eigenvalues[rows]
            pid = torch.tensor(rows).repeat_interleave(ev.shape[1])
            lam = self.lambdas[rows].repeat_interleave(ev.shape[1])
            ev = ev.reshape(-1)
            keep = torch.isfinite(ev.real) & torch.isfinite(ev.imag)
            fig.add_trace(go.Scatter(
                x=ev.real[keep].tolist(), y=ev.imag[keep].tolist(), mode="markers", name=label,
                marker={"color": _COLORS[label], "size": 6, "opacity": 0.7},
                text=[f"point {int(p)}, λ={float(v):.4g}" for p, v in zip(pid[keep], lam[keep])],
                hovertemplate="%{text}<br>Re=%{x:.4g}<br>Im=%{y:.4g}<extra>" + label + "</extra>"))
        fig.add_vline(x=0.0, line={"color": "black", "width": 1, "dash": "dot"})
        fig.update_layout(
            title=title or f"Tangent spectra of {self.n_points} equilibria (d={self.dim}, {self.eigensolver})",
            xaxis_title="Re(eig of Qᵀ DF Q − λI)", yaxis_title="Im", template="plotly_white")
        return fig

    def plot_counts(self, title: str | None = None):
        """Bar chart of :meth:`counts` (plotly Figure)."""
        import plotly.graph_objects as go

        counts = self.counts()
        fig = go.Figure(go.Bar(x=list(counts), y=list(counts.values()),
                               marker_color=["#2ca02c", "#d62728", "#1f77b4", "#7f7f7f", "#9467bd"]))
        fig.update_layout(title=title or f"Equilibria by type ({self.n_points} points, {self.n_starts} starts)",
                          yaxis_title="points", template="plotly_white")
        return fig


# ----------------------------------------------------------------------------------------------------------
# the "mostly saddles" claim


SAMPLE_NOTES = {
    DEFAULT_FINDER: "the flow finder's sample (attractors and repellers of the power iteration, boundary saddles of "
                    "edge tracking) plus the solution landscape: deflated Newton solves along the real tangent "
                    "eigenvectors of every point found reach its neighbours of any index, breadth first within a "
                    "solve budget; which points are reached depends on the flow's seeds and the budget, so the "
                    "fraction describes this sample",
    "polish": "the given points followed by Levenberg-Marquardt to the field"}


def sample_note(methods: Any) -> str:
    """What the label counts of results found by ``methods`` are a sample of (for the claim's reading)."""
    names = sorted(set(methods))
    return "; ".join(f"{m}: {SAMPLE_NOTES.get(m, 'custom finder')}" for m in names) or "no finder run"


#: why a finder's sample cannot decide "mostly saddles" for all equilibria of a field (docs section 4): none
#: samples the equilibria without a bias tied to their index
UNDECIDABLE_BY = {
    DEFAULT_FINDER: "the landscape walks out from the flow's points within a solve budget",
    "polish": "the points were given"}


def saddle_verdict(k: int, n: int, level: float = 0.95) -> dict[str, Any]:
    """The claim "most equilibria are saddles" for k saddles among n distinct equilibria: the exact interval against
    1/2, an interval on the found set (docs/critical_points.md section 4, "The fraction of a found set")."""
    return proportion_verdict(k, n, level, count_key="saddles")


def _abundance(res: EquilibriaResult, label: str) -> list[int]:
    """Per point of ``label``, the power-iteration rows of its sign from random starts (F for attractors, -F for
    repellers: the samples of that map's basins) that reached it; a point found only otherwise (the other sign's
    rows, token starts, the landscape) counts once, as a singleton (which raises the estimate)."""
    kinds, rows = res.options.get("row_kind", []), res.options.get("row_point", [])
    tag = "random/power+" if label == "attractor" else "random/power-"
    hits = [0] * res.n_points
    for kind, p in zip(kinds, rows):
        if p >= 0 and kind == tag:
            hits[p] += 1
    return [max(1, hits[i]) for i, lab in enumerate(res.labels) if lab == label]


@register
@dataclasses.dataclass
class CensusResult(Result):
    """The census of one field (:func:`~tl_steering.critical.census.census`, :func:`census_of`; fields:
    docs/critical_points.md section 11, "Result fields")."""

    equilibria: EquilibriaResult = dataclasses.field(default_factory=EquilibriaResult)
    attractors: dict[str, float] = dataclasses.field(default_factory=dict)
    repellers: dict[str, float] = dataclasses.field(default_factory=dict)
    saddles: int = 0
    degenerate: int = 0
    non_saddles_high: float = math.nan
    share_low: float = math.nan
    verdict: str = "no equilibria"
    level: float = 0.95
    assumptions: str = ""

    kind = "census"

    def summary(self) -> dict[str, Any]:
        return {"points": self.equilibria.n_points, "saddles_found": self.saddles,
                "attractors_found": int(self.attractors.get("observed", 0)),
                "attractors_estimate": self.attractors.get("estimate"), "attractors_high": self.attractors.get("ci_high"),
                "repellers_found": int(self.repellers.get("observed", 0)),
                "repellers_estimate": self.repellers.get("estimate"), "repellers_high": self.repellers.get("ci_high"),
                "degenerate": self.degenerate, "non_saddles_high": self.non_saddles_high,
                "share_low": self.share_low, "verdict": self.verdict, "level": self.level}

    def claim(self) -> Claim:
        """The paper's claim judged by the census: "mostly saddles" holds when the saddles found outnumber the upper
        bound on every other equilibrium; any attractor found contradicts "not attractors" (then "partly holds")."""
        n_attr = int(self.attractors.get("observed", 0))
        if self.equilibria.n_points == 0:
            return Claim(paper_statement("critical"), "not judged", "no equilibrium was found: not judged",
                         parts=self.summary())
        bound = (f"{self.saddles} saddles found, at most {self.non_saddles_high:.1f} attractors, repellers and "
                 f"degenerate points ({self.level:.0%} upper bound): saddles are at least {pct(self.share_low)}")
        if self.verdict != "supported":
            verdict, why = "undecided", f"'mostly saddles' is not decided: {bound}"
        else:
            verdict = "partly holds" if n_attr else "holds"
            why = f"'mostly saddles' holds: {bound}" + (f"; but {n_attr} attractors were found" if n_attr else "")
        return Claim(paper_statement("critical"), verdict, why, value=self.share_low, interval=(self.share_low, 1.0),
                     parts=self.summary())


ASSUMPTIONS = ("independent uniform starts sample the basins of the power map of F and -F with replacement; every "
               "attractor and repeller is a stable fixed point of that map (the shifted map where the plain one "
               "rotates) and has a basin; stable points whose basins the starts cannot sample are covered only "
               "statistically by the upper bound; the saddles are those found")


def check_level(level: Any) -> float:
    """``level`` as a float in (0, 1); else :class:`InputError` naming it."""
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0.0 < float(level) < 1.0:
        raise InputError(f"level must be in (0, 1), got {level!r}")
    return float(level)


def census_of(res: EquilibriaResult, level: float = 0.95) -> CensusResult:
    """The census's bounds and verdict from one run of the finder (:func:`census`'s, or ``critical_points``' with
    its budget: only the power rows from random starts sample the basins): non-saddles at most H = Chao1 upper
    bound of the attractors + that of the repellers + the degenerate points, "supported" when saddles found > H."""
    if not isinstance(res, EquilibriaResult):
        raise InputError(f"census_of takes an EquilibriaResult (cp.result(layer)), got {type(res).__name__}")
    level = check_level(level)
    att, rep = chao1(_abundance(res, "attractor"), level), chao1(_abundance(res, "repeller"), level)
    saddles, degenerate = res.labels.count("saddle"), res.labels.count("degenerate")
    high = att["ci_high"] + rep["ci_high"] + degenerate
    share = saddles / (saddles + high) if saddles + high > 0 else math.nan
    verdict = "no equilibria" if res.n_points == 0 else "supported" if saddles > high else "not decided"
    return CensusResult(provenance=res.provenance, equilibria=res, attractors=att, repellers=rep, saddles=saddles,
                        degenerate=degenerate, non_saddles_high=high, share_low=share, verdict=verdict,
                        level=level, assumptions=ASSUMPTIONS)


#: what the claim keeps of each layer's census
CENSUS_KEYS = ("saddles_found", "non_saddles_high", "share_low", "verdict")


@register
@dataclasses.dataclass(kw_only=True)
class CriticalPointsResult(Result):
    """Critical points of one field for one or several layers (:func:`tl_steering.critical_points`; fields:
    docs/critical_points.md, "Result fields")."""

    layers: list[int] = dataclasses.field(default_factory=list)
    field: str = "ffn"
    labels: list[str] = dataclasses.field(default_factory=lambda: list(LABELS))
    counts: Int[Tensor, "layer label"] = dataclasses.field(default_factory=_empty(0, 4, dtype=torch.int64))
    rotational: Int[Tensor, " layer"] = dataclasses.field(default_factory=_empty(0, dtype=torch.int64))
    rotational_pairs: Int[Tensor, " layer"] = dataclasses.field(default_factory=_empty(0, dtype=torch.int64))
    n_points: Int[Tensor, " layer"] = dataclasses.field(default_factory=_empty(0, dtype=torch.int64))
    n_converged: Int[Tensor, " layer"] = dataclasses.field(default_factory=_empty(0, dtype=torch.int64))
    n_starts: Int[Tensor, " layer"] = dataclasses.field(default_factory=_empty(0, dtype=torch.int64))
    radius: Float[Tensor, " layer"] = dataclasses.field(default_factory=_empty(0))
    seconds: Float[Tensor, " layer"] = dataclasses.field(default_factory=_empty(0))
    results: list[EquilibriaResult] = dataclasses.field(default_factory=list)

    kind = "critical_points"

    def __post_init__(self) -> None:
        n = len(self.layers)
        for name in ("counts", "rotational", "rotational_pairs", "n_points", "n_converged", "n_starts", "radius",
                     "seconds", "results"):
            if len(getattr(self, name)) != n:
                raise InputError(f"CriticalPointsResult.{name} has {len(getattr(self, name))} entries for {n} "
                                 "layers; build it with critical_points")

    def result(self, layer: int) -> EquilibriaResult:
        """The :class:`EquilibriaResult` of one layer."""
        if layer not in self.layers:
            raise InputError(f"layer {layer} was not analysed; layers: {self.layers}")
        return self.results[self.layers.index(layer)]

    def totals(self) -> dict[str, int]:
        out = {lab: int(self.counts[:, k].sum()) for k, lab in enumerate(self.labels)}
        out["rotational"] = int(self.rotational.sum())
        return out

    def saddle_fraction(self) -> float:
        """Saddles / all distinct equilibria, pooled over layers (NaN when none was found)."""
        total = int(self.counts.sum())
        return self.totals()["saddle"] / total if total else math.nan

    def converged_fraction(self) -> Float[Tensor, " layer"]:
        """Converged starts / starts, per layer."""
        return self.n_converged.to(torch.float64) / self.n_starts.clamp_min(1).to(torch.float64)

    def morse_histogram(self) -> dict[int, int]:
        """Points per Morse index, pooled over layers."""
        return dict(sorted(sum((Counter(r.morse_histogram()) for r in self.results), Counter()).items()))

    def sample(self) -> dict[str, Any]:
        """What the points are a sample of: finder(s), starts per layer (token directions / random), rows run,
        converged rows, distinct points, and the sentence that says what the label counts can be read as."""
        methods = sorted({r.method for r in self.results})
        token = [int(r.options.get("n_token_starts", r.options.get("given_starts", 0))) for r in self.results]
        starts = [int(r.options.get("n_starts", r.n_starts)) for r in self.results]
        return {"methods": methods, "layers": len(self.layers), "starts_per_layer": sorted(set(starts)),
                "token_starts_per_layer": sorted(set(token)), "rows": int(self.n_starts.sum()),
                "converged_rows": int(self.n_converged.sum()), "points": int(self.n_points.sum()),
                "note": sample_note(methods)}

    def parity(self) -> dict[str, Any]:
        """:meth:`EquilibriaResult.parity` per layer and the pooled lower bound on equilibria not found (None where
        a layer's check does not apply)."""
        per = {int(layer): r.parity() for layer, r in zip(self.layers, self.results)}
        miss = [p["missing_at_least"] for p in per.values()]
        return {"per_layer": per, "missing_at_least": None if None in miss else int(sum(miss))}

    def claim(self, level: float = 0.95) -> Claim:
        """The paper's claim in its three parts (docs/critical_points.md section 4, the ``parts`` keys in its table):
        does not hold once one verified attractor is found, else undecided ("mostly saddles" is decided by no
        finder's sample; the census, ``critical_census``, is what can decide it)."""
        s, a = self.labels.index("saddle"), self.labels.index("attractor")
        per_layer = {int(layer): saddle_verdict(int(self.counts[i, s]), int(self.counts[i].sum()), level)
                     for i, layer in enumerate(self.layers)}
        n, n_attr = int(self.n_points.sum()), int(self.counts[:, a].sum())
        p = saddle_verdict(int(self.counts[:, s].sum()), int(self.counts.sum()), level)
        methods = sorted({r.method for r in self.results})
        with_attr = [int(layer) for i, layer in enumerate(self.layers) if int(self.counts[i, a]) > 0]
        rm = proportion_verdict(int(self.rotational.sum()), n, level, count_key="rotational")
        why_undecided = "; ".join(f"{m}: {UNDECIDABLE_BY.get(m, 'a custom finder')}" for m in methods)
        parity, miss = self.parity(), self.parity()["missing_at_least"]
        census = {layer: {k: c.summary()[k] for k in CENSUS_KEYS} for layer, c in self.census(level).items()}
        held = [layer for layer, c in census.items() if c["verdict"] == "supported"]
        parts = {"per_layer": per_layer, "pooled": p, "sample": sample_note(methods), "census": census,
                 "mostly_saddles_decided": bool(held), "why_undecided": why_undecided,
                 "not_attractors": {"attractors": n_attr, "layers_with_attractor": with_attr,
                                    "n_layers": len(self.layers),
                                    "verdict": "fails" if n_attr else "not contradicted" if n else "no equilibria"},
                 "rotational_modes": rm, "parity": parity}
        if n == 0:
            return Claim(paper_statement("critical"), "not judged",
                         f"no equilibrium was found on layers {list(self.layers)}: not judged", parts=parts)
        attr = (f"'not attractors' fails: {plural(n_attr, 'verified attractor')} on {len(with_attr)} of "
                f"{plural(len(self.layers), 'layer')}" if n_attr else
                "'not attractors' is not contradicted: no attractor in this sample")
        par = f"; by the Poincaré-Hopf parity at least {miss} equilibri{'um' if miss == 1 else 'a'} went unfound" \
            if miss else ""
        ci = [f"{pct(v['fraction'])}, {level:.0%} CI [{pct(v['ci_low'])}, {pct(v['ci_high'])}]" for v in (rm, p)]
        return Claim(paper_statement("critical"), "does not hold" if n_attr else "undecided",
                     f"{attr}; rotational modes: {rm['rotational']} of {n} points ({ci[0]}: {rm['verdict']}); 'mostly "
                     f"saddles' is not decided by this sample: {p['saddles']} of {n} found are saddles ({ci[1]}), but "
                     f"{why_undecided}{par}; the census bound from its random starts (critical_census) "
                     + (f"supports it on layers {held}" if held else "decides it on no layer"),
                     value=p["fraction"], interval=(p["ci_low"], p["ci_high"]), parts=parts)

    def census(self, level: float = 0.95) -> dict[int, Any]:
        """Per layer, the census of this run (:func:`~tl_steering.critical.census.census_of`: bounds from the rows of
        its random starts; with few, the bound on the non-saddles is loose: ``critical_census`` runs 64)."""
        return {int(layer): census_of(r, level) for layer, r in zip(self.layers, self.results)}

    def summary(self) -> dict[str, Any]:
        """Headline numbers pooled over the layers, one type per key (docs/critical_points.md, "Summary keys"):
        counts are ints, shares and seconds floats (NaN where undefined), verdicts strings."""
        c = self.claim().parts
        pooled, missed = c["pooled"], c["parity"]["missing_at_least"]
        tot = self.totals()
        return {"field": self.field, "layers": len(self.layers), "equilibria": int(self.n_points.sum()),
                "attractors": tot["attractor"], "repellers": tot["repeller"], "saddles": tot["saddle"],
                "degenerate": tot["degenerate"], "with_rotational_mode": tot["rotational"],
                "rotational_eigenvalue_pairs": int(self.rotational_pairs.sum()),
                "saddle_share": float(self.saddle_fraction()),
                "saddle_share_ci_low": float(pooled["ci_low"]), "saddle_share_ci_high": float(pooled["ci_high"]),
                "mostly_saddles_in_found_set": str(pooled["verdict"]),
                "missed_at_least": math.nan if missed is None else float(missed),
                "starts_per_layer": max((int(r.options.get("n_starts", r.n_starts)) for r in self.results), default=0),
                "solver_rows": int(self.n_starts.sum()),
                "rows_converged": int(self.n_converged.sum()),
                "morse_histogram": self.morse_histogram(), "seconds": float(self.seconds.sum())}

    def plot(self, title: str | None = None):
        """Stacked bars of the label counts per layer (plotly Figure)."""
        import plotly.graph_objects as go

        fig = go.Figure()
        for k, lab in enumerate(self.labels):
            fig.add_trace(go.Bar(x=list(self.layers), y=self.counts[:, k].tolist(), name=lab,
                                 marker_color=_COLORS.get(lab)))
        fig.update_layout(barmode="stack", template="plotly_white", xaxis_title="layer",
                          yaxis_title="distinct equilibria",
                          title=title or f"Critical points of the {self.field} field per layer "
                                         f"(saddle fraction {self.saddle_fraction():.2f})")
        return fig
