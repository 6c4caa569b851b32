"""Which rank runs which stage of a suite run on a process group (:func:`assign_stages`: one rank, or every rank
with the windows split), and how a stage's result reaches the other ranks (:class:`Exchange`); docs/scale_out.md,
"The sharded report"."""

import math
from collections.abc import Callable
from typing import Any

from ..data.sharding import World, p2p_group, recv_object, send_object
from .settings import STAGES, SuiteSettings

#: the fields of :class:`~tl_steering.suite.result.SuiteResult` each stage fills
STAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "checks": ("checks",), "deficit": ("deficit",), "ablation": ("ablation",), "diversity": ("diversity",),
    "defect": ("defect", "defect_gold", "planner", "plan", "speedup"), "plan_choice": ("plan_choice",),
    "parallel": ("executor", "executor_choice"), "gates": ("gates",), "prefix": ("prefix",),
    "critical": ("critical", "critical_fixed_point")}
_PRODUCER = {f: stage for stage, fields in STAGE_FIELDS.items() for f in fields}

#: stage -> (the stages it reads when it starts, the stages it reads only when its own work is done)
READS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "defect": ((), ("checks",)),
    "plan_choice": ((), ("defect",)),
    "parallel": (("defect", "plan_choice"), ("checks",)),
    "gates": (("defect",), ())}

#: stages whose windows split over the ranks (each rank runs its batches; docs/scale_out.md)
WINDOW_STAGES = ("checks", "deficit", "ablation", "diversity", "defect")


#: (layers, d_model, d_mlp, d_vocab) of SmolLM2-135M, where the weights were measured; a layer's critical points
#: cost about CRITICAL_WEIGHT x (CRITICAL_SETUP + starts) float64 FFN Jacobians (the set-up: landscape, power, edges)
SMOLLM2_DIMS, CRITICAL_WEIGHT, CRITICAL_SETUP = (30, 576, 1536, 49152), 23.6, 38


def stage_costs(s: SuiteSettings, n_windows: int, length: int,
                dims: tuple[int, int, int, int] = SMOLLM2_DIMS) -> dict[str, tuple[float, float, float]]:
    """A rough cost of each stage of ``s`` in forwards over all the windows for a model of ``dims``: ``(part that
    splits over the batches of windows, part that splits over measured plans or layers, part that does not split)``.
    Only the ratios matter (they weigh :func:`assign_stages`); docs/scale_out.md, "The sharded report"."""
    n_var = len(set(s.ablation_variants) | {"zero"}) + 1  # the random-tangent control
    plans = 0.0  # the gold standard's plans, one pass over the windows each (split_map over the ranks)
    if s.defect_evaluate:
        ks = len(s.defect_k_values or [0, 1, 2, 3, 4])
        plans = 1 + 2 * max(1, s.plan_k) + (3 + s.defect_n_random) * ks
    gold = 0.0 if s.defect_gold_layers is None else 3.0 + len(s.defect_gold_layers) + 3 * len(
        s.defect_gold_k_values or [0, 1, 2, 3, 4])
    n_ks = len(s.plan_choice_k_values) if s.plan_choice_k_values is not None else 2
    choice = 0.0 if not s.plan_choice_strategies else 4.0 + 5.3 * len(s.plan_choice_strategies) * max(1, n_ks - 1)
    copies = 2 if s.plan_choice_strategies and "plan_choice" in s.stages else 1
    tw = min(s.parallel_timing_windows, s.batch_size, n_windows)  # the executor's timing batch
    timed = (2 + copies) * (s.parallel_repeats + 1) * tw / n_windows
    untimed = (max(0, n_windows // tw - s.parallel_repeats - 1) * tw + n_windows % tw) / n_windows  # a copy's loss
    fixed = 256.0 / max(1, n_windows * length)  # work that does not grow with the tokens, in forwards of them
    return {
        "checks": (1.0, 0.0, 1.0 / n_windows), "deficit": (1.0, 0.0, 0.0), "ablation": (1.25 * (1 + n_var), 0.0, 0.0),
        "diversity": (1.3 * (1 + len(s.diversity_ablations) + len(s.diversity_gains)), 0.0, 0.0),
        "defect": (3.0 + 1.5 * s.defect_brackets + 4.3 * (not s.defect_evaluate), plans + gold,
                   3.0 * s.timing_repeats * s.defect_timing * tw / min(n_windows, s.batch_size)),  # timed on tw
        "plan_choice": (0.0, 0.0, choice), "gates": (0.0, 0.0, 4.5),
        "parallel": (0.0, 0.0, (2.4 * fixed + 0.85 * untimed) * copies + 0.85 * timed),
        "critical": (0.0, CRITICAL_WEIGHT * (CRITICAL_SETUP + s.critical_n_starts) * len(s.critical_layers)
                     * jacobian_per_forward(dims) / max(1, n_windows * length), 0.0),
        "prefix": (0.0, 0.0, 0.7 * (1 + len(s.prefix_positions)))}


def jacobian_per_forward(dims: tuple[int, int, int, int]) -> float:
    """One float64 Jacobian of a layer's FFN field (d_model^2 d_mlp multiply-adds) in forwards of one token
    (layers x (4 d_model^2 + 3 d_model d_mlp) + d_model d_vocab): it grows with the width, not the tokens."""
    n_layers, d, d_mlp, vocab = dims
    return d * d * d_mlp / (n_layers * (4 * d * d + 3 * d * d_mlp) + d * vocab)


def _finish_times(plan: dict[str, tuple[int, ...]], cost: dict[str, float], size: int) -> dict[str, float]:
    """When each stage of ``plan`` would end: every rank runs its stages in STAGES order, a stage starts when its
    ranks are free and the stages it reads first have ended, and ends no sooner than the stages it reads last."""
    free = [0.0] * size
    end: dict[str, float] = {}
    for name in STAGES:
        if name not in plan:
            continue
        first, last = READS.get(name, ((), ()))
        ranks = plan[name]
        start = max([free[r] for r in ranks] + [end[d] for d in first if d in end])
        stop = max([start + cost[f"{name}@{len(ranks)}"]] + [end[d] for d in last if d in end])
        for r in ranks:
            free[r] = stop
        end[name] = stop
    return end


def assign_stages(names: list[str], s: SuiteSettings, n_windows: int, length: int, size: int,
                  dims: tuple[int, int, int, int] = SMOLLM2_DIMS) -> dict[str, tuple[int, ...]]:
    """The ranks that run each stage of ``names`` (one rank, or all of them for a window stage with at least
    ``size`` batches or plans to split, and for the critical stage with at least ``size`` layers): a greedy placement
    by cost, then single moves while the last rank finishes sooner."""
    if size <= 1:
        return {n: (0,) for n in names}
    n_batches = math.ceil(n_windows / s.batch_size)
    share = math.ceil(n_batches / size) / n_batches
    cost: dict[str, float] = {}
    options: dict[str, list[tuple[int, ...]]] = {}
    n_layers = len(s.critical_layers)  # the critical stage splits its layers, one rank each (as split_map)
    for name, (windows, plans, fixed) in stage_costs(s, n_windows, length, dims).items():
        per = math.ceil(n_layers / size) / n_layers if name == "critical" and n_layers else 1 / size
        cost[f"{name}@1"], cost[f"{name}@{size}"] = windows + plans + fixed, windows * share + plans * per + fixed
        options[name] = [(r,) for r in range(size)]
        if (name in WINDOW_STAGES and (n_batches >= size or plans > 0)) or (name == "critical" and n_layers >= size):
            options[name].append(tuple(range(size)))

    def key(plan: dict[str, tuple[int, ...]]) -> tuple[float, float]:
        end = _finish_times(plan, cost, size)
        return round(max(end.values(), default=0.0), 9), round(sum(end.values()), 9)

    plan: dict[str, tuple[int, ...]] = {}
    for name in sorted(names, key=lambda n: (-cost[f"{n}@1"], STAGES.index(n))):
        plan[name] = min(options[name], key=lambda o: key({**plan, name: o}))
    for _ in range(4 * len(names)):  # single moves while they help
        best = key(plan)
        moved = False
        for name in names:
            for o in options[name]:
                k = key({**plan, name: o})
                if k < best:
                    plan[name], best, moved = o, k, True
        if not moved:
            break
    return {n: plan[n] for n in names}


class Exchange:
    """The stages' results between the ranks: a rank sends a stage it ran alone to every other rank as soon as it
    ends (:func:`~tl_steering.data.sharding.send_object`, not waiting), and receives another rank's stage when one
    of its own stages first reads its fields (through a :class:`StageView`) or at the end (:meth:`finish`)."""

    def __init__(self, w: World, plan: dict[str, tuple[int, ...]]):
        self.w, self.plan = w, plan
        self.got: set[str] = set()
        self.sends: list[Callable[[], None]] = []
        if w.active:
            p2p_group(w)  # collective the first time: every rank here

    def runs_here(self, name: str) -> bool:
        return self.w.rank in self.plan[name]

    def publish(self, name: str, res: Any, error: BaseException | None = None) -> None:
        """Send the fields and timing of stage ``name`` (run on this rank alone) to the other ranks, or the
        ``error`` it raised (raised again on every rank that receives it, so none waits forever)."""
        if not self.w.active or len(self.plan[name]) > 1:
            return  # one process, or every rank ran it
        payload = error if error is not None else (
            {f: getattr(res, f) for f in STAGE_FIELDS[name]}, res.timings[name])
        tag = 100 + STAGES.index(name)
        self.sends += [send_object(payload, r, tag, self.w) for r in range(self.w.size) if r != self.w.rank]

    def receive(self, name: str, res: Any) -> None:
        """Fill ``res`` with stage ``name``'s fields from the rank that ran it (once; nothing if it ran here)."""
        if name in self.got or name not in self.plan or self.runs_here(name):
            return
        got = recv_object(self.plan[name][0], 100 + STAGES.index(name), self.w)
        if isinstance(got, BaseException):
            raise got
        fields, timing = got
        for f, v in fields.items():
            setattr(res, f, v)
        res.timings[name] = timing
        self.got.add(name)

    def finish(self, res: Any) -> None:
        """Receive every stage run elsewhere and wait until this rank's sends are done."""
        for name in self.plan:
            self.receive(name, res)
        for wait in self.sends:
            wait()
        self.sends = []


class StageView:
    """The result as a stage sees it: reading a field that another rank's stage fills waits for that stage."""

    __slots__ = ("_res", "_ex")

    def __init__(self, res: Any, ex: Exchange):
        object.__setattr__(self, "_res", res)
        object.__setattr__(self, "_ex", ex)

    def __getattr__(self, name: str) -> Any:
        res = object.__getattribute__(self, "_res")
        if name in _PRODUCER and getattr(res, name) is None:
            object.__getattribute__(self, "_ex").receive(_PRODUCER[name], res)
        return getattr(res, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_res"), name, value)


__all__ = ["Exchange", "READS", "SMOLLM2_DIMS", "STAGE_FIELDS", "WINDOW_STAGES", "assign_stages", "stage_costs"]
