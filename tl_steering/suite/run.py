"""The suite runner: the ONE code path that runs every protocol of the paper on a model (docs/suite.md). Each
stage of :data:`~tl_steering.suite.settings.STAGES` is a plain function that fills its own fields of the
:class:`~tl_steering.suite.result.SuiteResult`; under a process group :mod:`.schedule` places the stages."""

import dataclasses
import datetime as _dt
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._util import progress as _progress
from ..backends import adapt, tl_version
from ..backends.adapter import shared_clean_forwards
from ..data.batching import mean_loss, token_losses, token_mean
from ..data.windows import TokenWindows, token_source
from ..errors import InputError, ModelNotSupportedError, ParallelBlockError
from ..data.sharding import World, broadcast_from_rank0, check_agreement, world
from .schedule import Exchange, StageView, assign_stages
from .._util.timing import alternating_seconds, timed
from .result import (Checks, DistributedRun, Environment, ExecutorTiming, ModelSummary, PlanChoice, PlanLosses,
                     SpeedupEstimate, StageTiming, SuiteResult)
from .checkpoint import resume, run_key
from .progress import Progress, Tick, TqdmProgress
from .settings import STAGES, SuiteSettings
from ..parallel.strategies import PLANNER
from ..backends.ownership import exclusive


# ----------------------------------------------------------------------------------------------------------
# the stages: each fills its fields of `res` from (model, tokens, settings, what earlier stages filled)


class _Ctx:
    """What every stage reads: the model, the tokens and their corpus label, the settings, the seed and the
    process group (:class:`~tl_steering.data.sharding.World`; one process when none is initialized)."""

    def __init__(self, model: Any, tokens: Tensor, corpus: str | None, s: SuiteSettings, seed: int, w: World):
        self.model, self.tokens, self.corpus, self.s, self.seed, self.w = model, tokens, corpus, s, seed, w
        self.ad = adapt(model)

    def common(self) -> dict[str, Any]:
        """The keyword arguments every sharded protocol takes from the suite."""
        return {"seed": self.seed, "batch_size": self.s.batch_size, "corpus": self.corpus, "world": self.w}

    def mean_loss(self, hooks: Any = ()) -> float:
        """Mean CE over the tokens with ``hooks``, the windows split over the ranks."""
        return mean_loss(self.model, self.tokens, list(hooks), self.s.batch_size, world=self.w)


def stage_checks(c: _Ctx, res: SuiteResult, tick: Tick) -> None:
    """Clean mean CE over the tokens and the residual identity on the first window."""
    clean = c.mean_loss()
    tick("clean loss")
    _, cache = c.ad.run_with_cache(c.tokens[:1], c.ad.identity_names())
    identity = c.ad.check_residual_identity(cache)
    del cache
    res.checks = Checks(clean_loss=clean, max_residual_identity_error=max(identity.values()))
    tick("identity")


def stage_deficit(c: _Ctx, res: SuiteResult, tick: Tick) -> None:
    from ..protocols.deficit import angular_deficit

    res.deficit = angular_deficit(c.model, c.tokens, n_bootstrap=c.s.n_bootstrap, **c.common())


def stage_ablation(c: _Ctx, res: SuiteResult, tick: Tick) -> None:
    from ..protocols.ablation import ffn_ablation

    res.ablation = ffn_ablation(c.model, c.tokens, keep=tuple(c.s.ablation_variants), scope="all",
                                include_random_tangent=True, n_bootstrap=c.s.n_bootstrap, **c.common())


def stage_diversity(c: _Ctx, res: SuiteResult, tick: Tick) -> None:
    from ..protocols.diversity import diversity

    res.diversity = diversity(c.model, c.tokens, ablations=tuple(c.s.diversity_ablations),
                              gains=tuple(c.s.diversity_gains), **c.common())


def stage_defect(c: _Ctx, res: SuiteResult, tick: Tick) -> None:
    """Defect scores (and the gold standard when asked), the plan and its loss, the speedup estimate."""
    from ..parallel.defect import parallel_defect

    s = c.s
    defect = parallel_defect(c.model, c.tokens, evaluate=s.defect_evaluate, k_values=s.defect_k_values,
                             n_random=s.defect_n_random, brackets=s.defect_brackets, timing=s.defect_timing,
                             timing_repeats=s.timing_repeats, timing_windows=s.parallel_timing_windows,
                             **c.common())
    res.defect = defect
    tick("scores")
    if s.defect_gold_layers is not None:
        res.defect_gold = parallel_defect(c.model, c.tokens, layers=s.defect_gold_layers, evaluate=True,
                                          k_values=s.defect_gold_k_values, n_random=0, timing=False, **c.common())
    # the plan: the k lowest-C layers (PLANNER.reference), or settings.plan_strategy's (kept in res.planner)
    k = min(s.plan_k, len(defect.candidates))
    if s.plan_strategy == PLANNER.reference:
        layers, strategy = defect.plan(k), PLANNER.reference
    else:
        from ..parallel import plan_parallel

        # every rank plans: the measured plans are split over the ranks, the scores come from rank 0
        res.planner = plan_parallel(c.model, _windows(c, c.tokens), k, strategy=s.plan_strategy, seed=c.seed,
                                    batch_size=s.batch_size, world=c.w,
                                    refit="none")  # the suite's plan runs uncorrected (its executor: layers only)
        layers, strategy = list(res.planner.layers), res.planner.strategy
    res.plan = _plan_losses(c, res, k, layers, strategy)
    if s.defect_timing:
        res.speedup = SpeedupEstimate(**defect.speedup_estimate(layers))
    tick("plan")


def _windows(c: _Ctx, tokens: Any) -> Any:
    """``tokens`` with the run's corpus label (the planner reads provenance from a ``TokenWindows``)."""
    return TokenWindows(tokens, c.corpus) if c.corpus is not None else tokens


def _clean_loss(c: _Ctx, res: SuiteResult) -> float:
    """The clean mean CE: from the checks stage when it ran, else one clean pass over the tokens."""
    return res.checks.clean_loss if res.checks is not None else c.mean_loss()


def _plan_losses(c: _Ctx, res: SuiteResult, k: int, layers: list[int], strategy: str) -> PlanLosses:
    """dCE with the plan and with the k highest-C layers made parallel (the surrogate hooks of docs/defect.md).

    Taken from the defect curves when they hold k, else measured (two hooked forwards over the tokens)."""
    from ..hooks import parallel_blocks

    defect = res.defect
    high = sorted(sorted(defect.candidates, key=lambda lay: -float(defect.score[defect.layers.index(lay)]))[:k])
    out = PlanLosses(k=k, layers=list(layers), strategy=strategy, n_candidates=len(defect.candidates),
                     highest_layers=high)
    if strategy == PLANNER.reference and defect.evaluated and k in defect.k_values:
        j = defect.k_values.index(k)
        out.delta_ce_lowest = float(defect.curves["lowest"][j])
        out.delta_ce_highest = float(defect.curves["highest"][j])
        out.source = "defect curves (evaluate=True)"
        return out
    clean = _clean_loss(c, res)
    out.delta_ce_lowest = c.mean_loss(parallel_blocks(c.model, layers)) - clean
    out.delta_ce_highest = c.mean_loss(parallel_blocks(c.model, high)) - clean
    out.source = "measured by the suite (parallel_blocks hooks)"
    return out


def stage_plan_choice(c: _Ctx, res: SuiteResult, tick: Tick) -> None:
    """A cheap comparison of planner strategies (``settings.plan_choice_strategies``, one-shot scores by default)
    with the closed-form correction ``settings.plan_choice_refit``, chosen by calibration dCE on the first half of
    the windows, reported on the second half, beside the lowest-C plan (uncorrected) on the same held-out windows."""
    from ..parallel import plan_parallel
    from ..parallel.gold import PlanLoss

    s = c.s
    fisher = s.plan_choice_fisher_samples
    names = [n for n in s.plan_choice_strategies if fisher or n != "attribution_2nd"]
    if not names:
        return
    n = int(c.tokens.shape[0])
    if n < 2:
        tick("skipped: one window, none to hold out")
        return
    cut = n - n // 2  # plan_parallel's own split: the first ceil(n/2) windows calibrate, the rest are held out
    cal, held = c.tokens[:cut], c.tokens[cut:]
    ad = c.ad
    n_cand = sum(1 for lay in range(ad.n_layers) if not ad.is_parallel(lay))
    k = min(s.plan_k, n_cand)
    ks = s.plan_choice_k_values if s.plan_choice_k_values is not None else sorted({0, k})
    plan = plan_parallel(c.model, _windows(c, cal), k, strategy=names, held_out=held, seed=c.seed,
                         batch_size=s.batch_size, fisher_samples=fisher, refit=s.plan_choice_refit, k_values=ks)
    tick(f"chosen: {plan.strategy}")
    out = PlanChoice(plan=plan, fisher_samples=plan.options.get("fisher_samples", fisher))
    if res.defect is not None:  # the paper's k lowest-C layers (the suite's plan unless plan_strategy names another)
        low = list(res.plan.layers) if res.plan is not None and res.plan.strategy == PLANNER.reference else \
            list(res.defect.plan(min(k, len(res.defect.candidates))))
        d = PlanLoss(c.model, held, s.batch_size).delta(low)  # in a report: the gold standard's rows of that plan
        out.lowest_c_layers, out.lowest_c_held_out_delta_ce = low, d
        out.ratio_to_lowest_c = plan.held_out_delta_ce / d if d != 0 else math.nan
    res.plan_choice = out
    tick("lowest-C on held-out")


def stage_parallel(c: _Ctx, res: SuiteResult, tick: Tick) -> None:
    """The plans run by the real parallel executor: loss over the tokens, and whole-forward time against the
    original in alternating rounds beside an A/A control (docs/suite.md, "Verdicts"). ``executor``: the lowest-C
    plan (uncorrected); ``executor_choice``: the ``plan_choice`` stage's chosen plan with its fitted corrections
    folded into the fused weights (``parallelize(..., gates=, biases=, linears=)``); the copies share the rounds."""
    plan = res.plan.layers if res.plan is not None else []
    strategy = res.plan.strategy if res.plan is not None else PLANNER.reference
    runs = [_executor_copy(c, list(plan), strategy)]
    pc = res.plan_choice
    if pc is not None and pc.plan is not None:
        gates, biases = pc.plan.corrections()
        runs.append(_executor_copy(c, list(pc.plan.layers), pc.plan.strategy, gates, biases,
                                   correction=pc.plan.refit, linears=pc.plan.linear_maps()))
    tick("parallel copies")
    copies = [(info, par) for info, par in runs if par is not None]
    if copies:  # each model is timed on the timing batches in turn; a copy's loss reads its first pass over them
        parts = c.tokens.split(min(c.s.parallel_timing_windows, c.s.batch_size))
        models = [c.model] + [p for _, p in copies]
        calls, rows = [0] * len(models), [{} for _ in models]  # per model: part -> per-window CE sums
        full = [k for k, p in enumerate(parts) if len(p) == len(parts[0])]  # the timed batches: all of one shape

        def call(i: int, k: int | None = None) -> tuple[int, int, Tensor]:
            k, calls[i] = (full[calls[i] % len(full)], calls[i] + 1) if k is None else (k, calls[i])
            return i, k, models[i](parts[k], return_type="logits")

        def keep(out: tuple[int, int, Tensor]) -> None:  # copy i's CE sums of batch k, from its first pass over it
            if out[0] and out[1] not in rows[out[0]]:
                rows[out[0]][out[1]] = token_losses(out[2], parts[out[1]]).sum(-1).cpu()

        fns = [lambda i=i: call(i) for i in range(len(models))]
        fns.insert(1, fns[0])  # the A/A control: the original again
        times = alternating_seconds(fns, c.ad.device, warmup=1, rounds=c.s.parallel_repeats, after=keep)
        clean = _clean_loss(c, res)
        for i, ((info, par), t_par) in enumerate(zip(copies, times[2:]), 1):
            info.set_times(times[0], times[1], t_par)
            with torch.no_grad():
                for k in [k for k in range(len(parts)) if k not in rows[i]]:  # no timed call reached them: untimed
                    keep(call(i, k))
            info.loss = token_mean(torch.cat([rows[i][k] for k in range(len(parts))]), c.tokens)
            info.delta_ce = info.loss - clean
    res.executor = runs[0][0]
    res.executor_choice = runs[1][0] if len(runs) > 1 else None
    tick("timed")


def _executor_copy(c: _Ctx, plan: list[int], strategy: str, gates: dict | None = None, biases: dict | None = None,
                   correction: str = "none", linears: dict | None = None) -> tuple[ExecutorTiming, Any]:
    """One plan made parallel by :func:`tl_steering.parallel.parallelize`: its (unfilled) timing record and the
    parallel copy (None when the plan is empty or the model is not supported; the record says why)."""
    from ..parallel.apply import parallelize

    ad, s = c.ad, c.s
    what = f"the {strategy} plan" + (f" with the {correction} correction" if correction != "none" else "")
    info = ExecutorTiming(
        label=f"measured on this machine: {what}, whole forward, fused parallel blocks "
        f"(tl_steering.parallel.parallelize), {s.parallel_repeats} alternating rounds with an A/A control",
        strategy=strategy,
        correction=correction,
        layers=list(plan),
        timing_shape=list(c.tokens[: min(s.parallel_timing_windows, s.batch_size)].shape),
        device=str(ad.device))
    if not plan:
        info.status, info.reason = "skipped", "the plan is empty (no sequential layer to parallelize)"
        return info, None
    try:
        par = parallelize(c.model, plan, gates=gates or None, biases=biases or None, linears=linears or None)
    except (ModelNotSupportedError, ParallelBlockError) as e:
        info.status, info.reason = "not supported", f"{type(e).__name__}: {e}"
        return info, None
    return info, par


def stage_gates(c: _Ctx, res: SuiteResult, tick: Tick) -> None:
    from ..protocols.gates import calibrate_gates

    plan = res.plan.layers if res.plan is not None else []
    res.gates = calibrate_gates(c.model, c.tokens, method=c.s.gate_method, plan=plan, seed=c.seed,
                                steps=c.s.gate_steps, batch_size=c.s.batch_size, corpus=c.corpus)


def stage_critical(c: _Ctx, res: SuiteResult, tick: Tick) -> None:
    """Critical points of the FFN field on ``critical_layers`` with the one finder (``critical_methods``); the layers
    split over the ranks when the schedule runs the stage on all of them."""
    from ..critical import critical_points

    s = c.s
    if not s.critical_layers:
        return
    tokens = c.tokens if s.critical_max_windows is None else c.tokens[: s.critical_max_windows]
    res.critical = critical_points(c.model, layers=list(s.critical_layers), field="ffn", tokens=tokens,
                                   n_starts=s.critical_n_starts, seed=c.seed, corpus=c.corpus, world=c.w)
    tick(f"{s.critical_methods[0]}: {int(res.critical.n_points.sum())} points")


def stage_prefix(c: _Ctx, res: SuiteResult, tick: Tick) -> None:
    from ..protocols.prefix import prefix_sensitivity

    res.prefix = prefix_sensitivity(c.model, c.tokens, layer=c.s.prefix_layer, position=c.s.prefix_positions,
                                    eps=c.s.prefix_eps, mode="noise", seed=c.seed, corpus=c.corpus)


#: stage name -> (function, number of progress ticks)
STAGE_FUNCTIONS: dict[str, tuple[Callable[[_Ctx, SuiteResult, Tick], None], int]] = {
    "checks": (stage_checks, 2), "deficit": (stage_deficit, 1), "ablation": (stage_ablation, 1),
    "diversity": (stage_diversity, 1), "defect": (stage_defect, 2), "plan_choice": (stage_plan_choice, 2),
    "parallel": (stage_parallel, 2), "gates": (stage_gates, 1), "critical": (stage_critical, 1),
    "prefix": (stage_prefix, 1)}


def _model_summary(ad: Any) -> ModelSummary:
    return ModelSummary(name=ad.info.name, revision=ad.info.revision, n_layers=ad.n_layers, d_model=ad.d_model,
                        backend=ad.backend, processing=ad.info.processing, dtype=str(ad.dtype).removeprefix("torch."),
                        device=str(ad.device), prepend_bos=ad.info.prepend_bos)


@exclusive
def run_suite(model: Any, tokens: Tensor | TokenWindows, settings: SuiteSettings, progress: bool | Progress = True,
              seed: int = 0, corpus: str | None = None, checkpoint: str | Path | None = None) -> SuiteResult:
    """Run every protocol of the paper (the stages in ``settings.stages``) on ``model`` over ``tokens``; the fields
    of stages not run are None (every argument: docs/suite.md)."""
    if not isinstance(settings, SuiteSettings):
        raise InputError(f"run_suite: settings must be a SuiteSettings, got {type(settings).__name__}")
    settings.check()
    tokens, corpus = token_source(tokens, corpus)
    ad = adapt(model)
    tokens = ad.validate_tokens(tokens)
    w = world()
    # what the numbers depend on; hashing every weight costs a pass over them, so only when it is compared
    key = run_key(model, ad.info.name, tokens, settings, seed) if w.active or checkpoint is not None else None
    if w.active:  # every rank must run the same model, tokens and settings (else: an error on every rank)
        check_agreement(key, w)
        if w.rank != 0 and isinstance(progress, bool):
            progress = False  # progress on rank 0 only
    prog: Progress = TqdmProgress(progress) if isinstance(progress, bool) else progress
    t_start = time.perf_counter()
    res = SuiteResult(provenance=ad.provenance(tokens, corpus=corpus, seed=seed, protocol="run_suite",
                                              stages=list(settings.stages)),
                      settings=settings, seed=seed, model=_model_summary(ad),
                      environment=Environment.here(tl_version()),
                      started=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    extra = res.provenance.extra if key is None else {**res.provenance.extra, "run_key": key}
    res.provenance = dataclasses.replace(res.provenance, world_size=w.size, extra=extra)
    ctx = _Ctx(model, tokens, corpus, settings, seed, w)
    ran = [name for name in STAGES if name in settings.stages]
    done: set[str] = set()
    if checkpoint is not None and Path(checkpoint).exists():
        res, done = resume(Path(checkpoint), key, res, ran)
    todo = [name for name in ran if name not in done]
    dims = (ad.n_layers, ad.d_model, int(ad.cfg.d_mlp), int(ad.cfg.d_vocab))
    plan = broadcast_from_rank0(lambda: assign_stages(todo, settings, *tokens.shape, w.size, dims), w)
    res.distributed = DistributedRun(world_size=w.size, backend=w.backend,
                                     sharded_stages=[n for n in todo if len(plan[n]) > 1],
                                     rank0_stages=[n for n in todo if plan[n] == (0,)] if w.active else [],
                                     stage_ranks={n: list(plan[n]) for n in todo} if w.active else {})
    ex = Exchange(w, plan)
    alone = _Ctx(model, tokens, corpus, settings, seed, World()) if w.active else ctx  # a stage one rank runs
    with shared_clean_forwards(model):  # one hook-free forward per token batch, shared by the stages
        for name in todo:
            if not ex.runs_here(name):  # another rank runs it: its fields arrive when a stage here reads them,
                getattr(prog, "elsewhere", lambda *_: None)(name, plan[name])  # or at the end (a Progress may
                continue  # have no elsewhere: TqdmProgress prints the stage's line)
            fn, total = STAGE_FUNCTIONS[name]
            with timed() as sw, _progress.reporting(lambda _: None, min_interval=math.inf) as fw, \
                    prog.stage(name, total=total) as tick:
                try:
                    fn(ctx if len(plan[name]) > 1 else alone, StageView(res, ex), tick)
                except BaseException as e:  # the ranks that wait for this stage raise it too
                    ex.publish(name, res, error=e)
                    raise
            res.timings[name] = StageTiming(wall_s=sw.wall_s, cpu_s=sw.cpu_s, forwards=fw.forwards, tokens=fw.tokens)
            ex.publish(name, res)
            if checkpoint is not None and w.rank == 0:
                res.save(checkpoint)
    ex.finish(res)
    if checkpoint is not None and w.rank == 0 and w.active:
        res.save(checkpoint)
    res.timings = {name: res.timings[name] for name in ran if name in res.timings}  # in STAGES order
    res.total_wall_s = time.perf_counter() - t_start
    return res


__all__ = ["STAGE_FUNCTIONS", "run_suite"]
