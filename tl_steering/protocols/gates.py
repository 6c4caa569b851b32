"""Layer-wise FFN gate calibration (docs/gates.md): x^{l+1} = y + g_l Phi_l(y), i.e. ``hook_mlp_out *= g_l``."""

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from ..backends import ModelAdapter
from ..data.batching import iter_batches, mean_loss, token_losses, token_mean
from ..data.windows import model_tokens
from ..errors import InputError
from ..hooks import HookList, ffn_gate, parallel_blocks
from ..metrics import next_token_loss
from .._util.claims import Claim, fmt, pct
from ..results import Result, register, tensor_field
from ..stats import Moments
from ..validation import as_choice, as_int
from ..backends.ownership import exclusive


@register
@dataclasses.dataclass(kw_only=True)
class GateResult(Result):
    """Calibrated FFN gates and the losses around them (see :func:`calibrate_gates`); every field is defined in
    docs/gates.md ("Two fits", "Split and reported losses")."""

    method: str = "loss"
    layers: list[int] = dataclasses.field(default_factory=list)
    plan: list[int] = dataclasses.field(default_factory=list)
    gates: Float[Tensor, " n_layers"] = tensor_field(0)
    loss_clean_calib: float = math.nan
    loss_clean_heldout: float = math.nan
    loss_base_calib: float = math.nan
    loss_base_heldout: float = math.nan
    loss_gated_calib: float = math.nan
    loss_gated_heldout: float = math.nan
    history: Float[Tensor, " steps"] = tensor_field(0)
    scan_grid: Float[Tensor, " grid"] = tensor_field(0)
    scan_losses: Float[Tensor, "layer grid"] = tensor_field(0, 0)
    scan_best: Float[Tensor, " layer"] = tensor_field(0)
    scan_curvature: Float[Tensor, " layer"] = tensor_field(0)
    n_calib: int = 0
    n_heldout: int = 0

    kind = "gates"

    @property
    def improvement_calib(self) -> float:
        return self.loss_base_calib - self.loss_gated_calib

    @property
    def improvement_heldout(self) -> float:
        return self.loss_base_heldout - self.loss_gated_heldout

    @property
    def generalization_gap(self) -> float:
        """Calibration improvement minus held-out improvement (how much of the fitted gain does not transfer)."""
        return self.improvement_calib - self.improvement_heldout

    def summary(self) -> dict[str, Any]:
        dbase = self.loss_base_heldout - self.loss_clean_heldout
        dgated = self.loss_gated_heldout - self.loss_clean_heldout
        fitted = self.gates[self.layers] if self.layers else self.gates[:0]
        return {
            "method": self.method, "n_gates": len(self.layers),
            "gate_min": float(fitted.min()) if fitted.numel() else math.nan,
            "gate_max": float(fitted.max()) if fitted.numel() else math.nan,
            "loss_clean_heldout": self.loss_clean_heldout, "loss_base_heldout": self.loss_base_heldout,
            "loss_gated_heldout": self.loss_gated_heldout, "delta_ce_base_heldout": dbase,
            "delta_ce_gated_heldout": dgated,
            "recovered_fraction_heldout": (dbase - dgated) / dbase if dbase != 0 else math.nan,
            "improvement_calib": self.improvement_calib, "improvement_heldout": self.improvement_heldout,
            "generalization_gap": self.generalization_gap}

    def claim(self) -> Claim:
        """Our claim, not the paper's (docs/gates.md): the fitted gates recover part of the plan's loss held out;
        holds when the held-out recovered fraction is positive."""
        s = self.summary()
        base, gated, frac = s["delta_ce_base_heldout"], s["delta_ce_gated_heldout"], s["recovered_fraction_heldout"]
        move = f"ΔCE held out {base:+.3g} → {gated:+.3g}"
        if not s["n_gates"]:
            verdict, why = "not judged", "no gate was fitted (the plan is empty): not judged"
        elif not math.isfinite(frac):
            verdict, why = "not judged", ("the recovered fraction is not defined (the plan costs nothing held out): "
                                          "not judged")
        elif frac <= 0:
            fit = f" although they lower the calibration loss by {fmt(self.improvement_calib)} nats" \
                if self.improvement_calib > 0 else ""
            verdict, why = "does not hold", (f"the gates do not recover the loss held out: they make it worse ({move}, "
                                             f"recovered fraction {frac:.3g}){fit}")
        else:
            verdict, why = "holds", f"the gates recover {pct(frac)} of the plan's loss held out ({move})"
        return Claim("one scalar gate per parallel FFN, fitted on calibration windows, should recover part of the "
                     "plan's loss", verdict, why, value=frac, by="ours")

    def plot(self, title: str | None = None):
        """Gate per layer (bars; fitted layers coloured) with the reference g = 1 (plotly Figure)."""
        import plotly.graph_objects as go

        fitted = set(self.layers)
        colors = ["#1f77b4" if i in fitted else "#c7c7c7" for i in range(len(self.gates))]
        fig = go.Figure(go.Bar(x=list(range(len(self.gates))), y=self.gates.tolist(), marker_color=colors,
                               name="gate"))
        fig.add_hline(y=1.0, line={"color": "black", "dash": "dot"})
        s = self.summary()
        fig.update_layout(template="plotly_white", xaxis_title="layer", yaxis_title="g_l",
                          title=title or (f"FFN gates ({self.method}); held-out ΔCE {s['delta_ce_base_heldout']:+.4f}"
                                          f" → {s['delta_ce_gated_heldout']:+.4f}"))
        return fig


def _split(tokens: Tensor, held_out: float, held_out_tokens: Tensor | None, seed: int,
           ad: ModelAdapter) -> tuple[Tensor, Tensor]:
    if held_out_tokens is not None:
        return tokens, ad.validate_tokens(held_out_tokens)
    if isinstance(held_out, bool) or not isinstance(held_out, (int, float)) or not 0 < held_out < 1:
        raise InputError(f"held_out must be a fraction in (0, 1), got {held_out!r}")
    n = tokens.shape[0]
    if n < 2:
        raise InputError("need at least 2 sequences to hold some out; pass more tokens or held_out_tokens=")
    n_hold = min(n - 1, max(1, round(held_out * n)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(tokens.device)
    return tokens[perm[n_hold:]], tokens[perm[:n_hold]]


def _base(model: Any, base_hooks: Any, plan: list[int]) -> HookList:
    if base_hooks is None:
        return parallel_blocks(model, plan)
    if callable(base_hooks):
        base_hooks = base_hooks(model)
    try:
        out = list(base_hooks)
    except TypeError as e:
        raise InputError(f"base_hooks must be None, a fwd_hooks list or a callable model -> list; got "
                         f"{type(base_hooks).__name__}") from e
    for item in out:
        if not (isinstance(item, tuple) and len(item) == 2 and callable(item[1])):
            raise InputError(f"base_hooks entries must be (hook_name, fn) pairs, got {item!r}")
    return out


def _closed_form(ad: ModelAdapter, tokens: Tensor, base: HookList, plan: list[int], batch_size: int
                 ) -> tuple[dict[int, float], float]:
    """(the gates of ``plan``, the mean CE with ``base``: the fitting forwards are that loss's forwards)."""
    names = [ad.hook_name(layer, site) for layer in plan for site in ("resid_pre", "attn_out")]
    moments = {layer: Moments(ad.d_model, ad.device) for layer in plan}
    per_row = torch.zeros(tokens.shape[0], dtype=torch.float64)
    for rows, logits, cache in iter_batches(ad, tokens, names, batch_size, fwd_hooks=base):
        per_row[rows] = token_losses(logits, tokens[rows]).sum(-1).cpu()
        for layer in plan:
            x, a = (cache[ad.hook_name(layer, site)] for site in ("resid_pre", "attn_out"))
            phi = ad.ffn(layer)
            with torch.no_grad():
                moments[layer].add(phi(x + a), phi(x), (0,))  # Y the sequential write, P the parallel one
    return {layer: m.solve("gate")[0] for layer, m in moments.items()}, token_mean(per_row, tokens)


def _fit_by_loss(model: Any, ad: Any, calib: Tensor, base: HookList, sel: list[int], steps: int, lr: float,
                 batch_size: int) -> tuple[Tensor, Tensor]:
    """Adam on the calibration CE with the full-batch gradient: the gates of ``sel`` and the loss history."""
    theta = torch.ones(len(sel), dtype=torch.float32, device=ad.device, requires_grad=True)
    index = torch.tensor(sel, device=ad.device)
    opt = torch.optim.Adam([theta], lr=float(lr))
    n_pred = calib.shape[0] * (calib.shape[1] - 1)
    hist = []
    for _ in range(steps):
        grad = torch.zeros_like(theta)  # the full-batch gradient, set as theta.grad before the step
        total = 0.0
        for s in range(0, calib.shape[0], batch_size):
            chunk = calib[s:s + batch_size]
            with torch.enable_grad():
                full = torch.ones(ad.n_layers, dtype=torch.float32, device=ad.device).index_put((index,), theta)
                logits = ad.run_with_hooks(chunk, base + ffn_gate(model, full), return_type="logits", grad=True)
                lsum = next_token_loss(logits, chunk).sum()
                (g,) = torch.autograd.grad(lsum / n_pred, [theta])
            grad += g
            total += float(lsum.detach())
            del logits, lsum
        if not bool(torch.isfinite(grad).all()):
            raise InputError("the gate gradient became non-finite; lower lr")
        theta.grad = grad
        opt.step()
        hist.append(total / n_pred)
    return theta.detach().to(torch.float64).cpu(), torch.tensor(hist, dtype=torch.float64)


def _scan(model: Any, ad: Any, calib: Tensor, base: HookList, sel: list[int],
          scan_grid: Sequence[float] | Tensor | None, batch_size: int) -> dict[str, Tensor]:
    """The per-layer 1-D gate scans on the calibration split: grid, losses, best gate and quadratic curvature (the
    ``scan_*`` fields of :class:`GateResult`)."""
    grid = torch.as_tensor(scan_grid if scan_grid is not None else torch.linspace(0, 2, 9),
                           dtype=torch.float64).flatten()
    if grid.numel() < 3 or not bool(torch.isfinite(grid).all()):
        raise InputError("scan_grid needs at least 3 finite gate values")
    scan_losses = torch.tensor([[mean_loss(ad, calib, base + ffn_gate(model, {layer: g}), batch_size)
                                 for g in grid.tolist()] for layer in sel],
                               dtype=torch.float64).reshape(len(sel), grid.numel())
    vander = torch.stack([grid ** 2, grid, torch.ones_like(grid)], dim=1)
    coef = torch.linalg.lstsq(vander, scan_losses.T).solution  # [3, layer]
    return {"scan_grid": grid, "scan_losses": scan_losses, "scan_best": grid[scan_losses.argmin(dim=1)],
            "scan_curvature": 2.0 * coef[0]}


@exclusive
def calibrate_gates(model: Any, tokens: Tensor, method: Literal["loss", "closed_form"] = "loss",
                    base_hooks: HookList | Callable[[Any], HookList] | None = None,
                    layers: Sequence[int] | int | None = None, held_out: float = 0.25,
                    held_out_tokens: Tensor | None = None, steps: int = 200, lr: float = 0.05, scan: bool = False,
                    scan_grid: Sequence[float] | Tensor | None = None, seed: int = 0, corpus: str | None = None,
                    plan: Sequence[int] | None = None, batch_size: int = 8) -> GateResult:
    """Fit one scalar FFN gate per layer on top of ``base_hooks`` (docs/gates.md).

    Arguments: docs/gates.md, "Arguments of calibrate_gates"."""
    ad, tokens, corpus = model_tokens(model, tokens, corpus)
    method = as_choice(method, "method", ("loss", "closed_form"))
    seed = as_int(seed, "seed")
    batch_size = as_int(batch_size, "batch_size", minimum=1)
    plan_l = ad.layers(plan) if plan is not None else []
    if method == "closed_form" and not plan_l:
        raise InputError("method='closed_form' fits the parallel surrogate of the layers in plan=[...]; pass plan")
    if method == "loss":
        steps = as_int(steps, "steps", minimum=0)
        if not isinstance(lr, (int, float)) or not lr > 0:
            raise InputError(f"lr must be a positive float, got {lr!r}")
    sel = ad.layers(layers) if layers is not None else (plan_l if method == "closed_form" else ad.layers(None))
    calib, held = _split(tokens, held_out, held_out_tokens, seed, ad)
    base = _base(model, base_hooks, plan_l)

    def losses(name: str, hooks: HookList) -> dict[str, float]:
        return {f"loss_{name}_{split}": mean_loss(ad, toks, hooks, batch_size)
                for split, toks in (("calib", calib), ("heldout", held))}

    before = losses("clean", [])
    gates = torch.ones(ad.n_layers, dtype=torch.float64)
    history = torch.zeros(0, dtype=torch.float64)
    if method == "closed_form":  # the fit's forwards over calib give the base loss there
        fit, before["loss_base_calib"] = _closed_form(ad, calib, base, [lay for lay in plan_l if lay in sel],
                                                      batch_size)
        gates[list(fit)] = torch.tensor(list(fit.values()), dtype=torch.float64)
        before["loss_base_heldout"] = mean_loss(ad, held, base, batch_size)
    else:
        before.update(losses("base", base))
        if steps > 0:
            gates[sel], history = _fit_by_loss(model, ad, calib, base, sel, steps, float(lr), batch_size)
    after = losses("gated", base + ffn_gate(model, gates.tolist()))

    scanned = _scan(model, ad, calib, base, sel, scan_grid, batch_size) if scan else {}
    return GateResult(
        provenance=ad.provenance(tokens, corpus=corpus, seed=seed, protocol="calibrate_gates", method=method, layers=sel,
                                 plan=plan_l, steps=steps, lr=float(lr), held_out=held_out,
                                 n_base_hooks=len(base), scan=scan, batch_size=batch_size),
        method=method, layers=sel, plan=plan_l, gates=gates, **before, **after,
        history=history, n_calib=int(calib.shape[0]), n_heldout=int(held.shape[0]), **scanned)


__all__ = ["GateResult", "calibrate_gates"]
