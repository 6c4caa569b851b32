"""The gold standard of layer planning: the measured loss of a plan, the one oracle, and the one curve builder
(docs/defect.md "Gold standard", "Prefix sharing of the gold standard and the curves")."""

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._util.progress import forward_done
from ..backends import adapt
from ..backends.adapter import keep_rows, kept_rows
from ..data.batching import loss_block_sums, token_mean
from ..data.sharding import batch_slices, split_map
from ..hooks import Write, parallel_blocks, parallel_hooks
from ..stats import block_length

#: Largest size of the clean residuals :class:`PlanLoss` keeps for prefix sharing (above it: a whole forward per plan).
PREFIX_CACHE_BYTES = 1 << 30


class PlanLoss:
    """Memoised mean CE of plans (sets of parallel layers) on one set of token windows, ``loss(layers)``; every
    measured plan keeps its per-block CE sums :attr:`blocks` (``[window, block]``, the resampling units of
    docs/parallel.md "Uncertainty and the choice"); ``share_prefix``: docs/defect.md "Prefix sharing"."""

    def __init__(self, model: Any, tokens: Tensor, batch_size: int = 8, world: Any = None,
                 share_prefix: bool = True):
        self.model, self.ad, self.tokens, self.batch_size, self.world = model, adapt(model), tokens, batch_size, world
        self.memo: dict[tuple[int, ...], float] = {}
        self.blocks: dict[tuple[int, ...], Tensor] = {}
        self._counted: dict[tuple[int, ...], int] = {}  # plan -> passes its measurement ran
        self.share_prefix = share_prefix
        self.prefix_note = ""
        self._prefix: dict[int, Tensor] | None = None  # layer -> clean residual entering it, every window
        self.prefix_of: tuple[PlanLoss, slice] | None = None  # (a loss on windows holding these, which rows)
        self._clean_blocks: Tensor | None = None
        self.block = block_length(int(tokens.shape[1]) - 1)

    @staticmethod
    def _key(layers: Sequence[int]) -> tuple[int, ...]:
        return tuple(sorted(int(x) for x in layers))

    def _measure(self, key: tuple[int, ...]) -> Tensor:
        return self.ce_blocks(key)

    def ce_blocks(self, layers: Sequence[int], write: Write | None = None) -> Tensor:
        """Per-block CE sums ``[window, block]`` (float64, CPU; not memoised) with ``layers`` parallel, their FFN
        writes given by ``write`` (as :func:`tl_steering.hooks.parallel_hooks`) when given."""
        plan = sorted(lay for lay in set(int(v) for v in layers) if not self.ad.is_parallel(lay))
        if self._prefix_ready():  # the clean pass that builds the prefix gives the clean CE
            return self._suffix_blocks(plan, write) if plan else self._clean_blocks.clone()
        hooks = parallel_blocks(self.model, plan) if write is None else parallel_hooks(self.model, plan, write)
        parts = []
        for rows in batch_slices(int(self.tokens.shape[0]), self.batch_size):
            logits = self.ad.run_with_hooks(self.tokens[rows], list(hooks), return_type="logits")
            parts.append(loss_block_sums(logits, self.tokens[rows], self.block))
        return torch.cat(parts)

    def _prefix_ready(self) -> bool:
        """Build the clean prefix on first use (one clean pass, which also gives the clean CE); False when prefix
        sharing is off or cannot be used here (:attr:`prefix_note` says why)."""
        if self._prefix is not None:
            return True
        if not self.share_prefix or self.prefix_note:
            return False
        owner, rows = self.prefix_of or (None, slice(None))
        if owner is not None and owner._prefix_ready():  # these windows' rows of another loss's clean pass
            return self._keep({lay: t[rows] for lay, t in owner._prefix.items()}, owner._clean_blocks[rows], 0)
        ad, toks = self.ad, self.tokens
        n = int(toks.shape[0])
        size = n * int(toks.shape[1]) * ad.d_model * ad.n_layers * torch.empty((), dtype=ad.dtype).element_size()
        if size > PREFIX_CACHE_BYTES:
            self.prefix_note = f"the clean residuals would take {size / 2**20:.0f} MiB (> PREFIX_CACHE_BYTES)"
            return False
        if ad.has_hooks():
            self.prefix_note = "the model holds hooks of its own, which the shared prefix would bypass"
            return False
        names = [ad.hook_name(lay, "resid_pre") for lay in range(ad.n_layers)]
        prefix: dict[int, Tensor] = {}
        per_row: list[Tensor] = []
        with torch.no_grad():
            for i, rows in enumerate(batch_slices(n, self.batch_size)):
                logits, cache = ad.run_with_cache(toks[rows], names)
                per_row.append(loss_block_sums(logits, toks[rows], self.block))
                if i == 0:  # the path against the model's own forward: the last block, final norm, unembedding
                    ours = ad.run_blocks(cache[names[-1]], ad.n_layers - 1)
                    err = float((ours - logits).abs().max()) / max(float(logits.abs().max()), 1e-30)
                    if not err <= 10 * ad.identity_tolerance():
                        self.prefix_note = (f"run_blocks differs from the model's forward by {err:.2g} (relative) "
                                            "on this model")
                        return False
                for lay, name in enumerate(names):
                    if lay not in prefix:
                        prefix[lay] = torch.empty((n, *cache[name].shape[1:]), dtype=cache[name].dtype,
                                                  device=cache[name].device)
                    prefix[lay][rows] = cache[name]
                del cache, logits
        return self._keep(prefix, torch.cat(per_row), 1)

    def _keep(self, prefix: dict[int, Tensor], blocks: Tensor, passes: int) -> bool:
        """Keep the clean prefix and block sums, the clean plan's CE unless known, and the ``passes`` they cost."""
        self._prefix, self._clean_blocks = prefix, blocks
        self._counted.setdefault((), passes)
        if () not in self.memo:
            self._store((), blocks)
        return True

    def _suffix_blocks(self, plan: list[int], write: Write | None) -> Tensor:
        """Per-block CE sums of ``plan`` from the clean residual entering its first layer."""
        parts = []
        with torch.no_grad():
            for rows in batch_slices(int(self.tokens.shape[0]), self.batch_size):
                logits = self.ad.run_blocks(self._prefix[plan[0]][rows], plan[0], plan, write)
                forward_done(int(self.tokens[rows].numel()))  # progress: a run from the prefix counts as a forward
                parts.append(loss_block_sums(logits, self.tokens[rows], self.block))
        return torch.cat(parts)

    def cost_of(self, layers: Sequence[int]) -> int:
        """Passes over the windows one measurement of the plan ``layers`` runs (1 here; more for fitted plans)."""
        return 1

    @property
    def passes(self) -> int:
        """Passes over the windows its plans cost so far (the clean pass that builds the shared prefix counts once)."""
        return sum(self._counted.values())

    def __call__(self, layers: Sequence[int]) -> float:
        key = self._key(layers)
        if key not in self.memo and not self._reused(key):
            self._store(key, self._measure(key))
        return self.memo[key]

    #: a plain plan's block sums depend on the windows and the plan alone: a suite run shares them (``keep_rows``)
    shared = True

    def _reused(self, key: tuple[int, ...]) -> bool:
        """Whether the plan's block sums were kept in this suite run on windows holding these (then they are taken,
        no pass run, and :attr:`passes` counts the pass as if run: the same on any placement of the stages); a loss
        on an active process group always measures (its ranks then measure alike)."""
        active = self.world is not None and self.world.active
        got = kept_rows(self.model, ("PlanLoss", key), self.tokens, ["ce"]) if self.shared and not active else None
        if got is not None:
            self._store(key, got["ce"], keep=False)  # kept already
        return got is not None

    def _store(self, key: tuple[int, ...], blocks: Tensor, keep: bool = True) -> None:
        """Keep a plan's block sums, token-weighted mean CE and passes; ``keep``: also for the run's other losses."""
        self._counted.setdefault(key, self.cost_of(key))
        self.blocks[key], self.memo[key] = blocks, token_mean(blocks, self.tokens)
        if self.shared and keep:
            keep_rows(self.model, ("PlanLoss", key), self.tokens, {"ce": blocks})

    def work(self, layers: Sequence[int]) -> float:
        """The relative cost of measuring the plan ``layers``, in blocks over the windows: the blocks a pass runs (from
        its first parallel layer when prefix sharing is on) and the unembedding, times :meth:`cost_of`."""
        ad, plan = self.ad, [lay for lay in self._key(layers) if not self.ad.is_parallel(lay)]
        head = int(ad.cfg.d_vocab) / (4 * ad.d_model + 3 * int(ad.cfg.d_mlp or 4 * ad.d_model))  # in blocks
        return self.cost_of(layers) * (ad.n_layers - (plan[0] if plan and self.share_prefix else 0) + head)

    def prefetch(self, plans: Iterable[Sequence[int]], load: Sequence[float] = ()) -> None:
        """Measure every plan of ``plans`` not known yet, split over the ranks of :attr:`world` by :meth:`work`
        (:func:`tl_steering.data.sharding.split_map`; every rank calls it with the same plans; ``load``: the work
        ranks 0, 1, ... have besides, in the same unit)."""
        keys = [k for k in dict.fromkeys(self._key(p) for p in plans) if k not in self.memo and not self._reused(k)]
        cost = [self.work(k) for k in keys] if self.world is not None and self.world.active else None
        for k, blocks in zip(keys, split_map(self._measure, keys, self.world, cost, load) if keys else []):
            self._store(k, blocks)

    @property
    def clean(self) -> float:
        return self([])

    def share_clean(self, other: "PlanLoss") -> None:
        """Take the clean plan's CE, block sums and shared prefix from ``other`` (the same windows: the same clean
        forward)."""
        other.clean  # noqa: B018 - measured if it was not yet
        self.memo[()], self.blocks[()] = other.memo[()], other.blocks[()]
        self.prefix_of = (other, slice(None))

    def delta_blocks(self, layers: Sequence[int]) -> Tensor:
        """Per-block sums of ``CE(layers parallel) - CE(clean)``, ``[window, block]`` (measured if needed)."""
        self(layers)
        self([])
        return self.blocks[self._key(layers)] - self.blocks[()]

    def delta(self, layers: Sequence[int]) -> float:
        """``CE(layers parallel) - CE(clean)``."""
        return self(layers) - self.clean


def delta_curves(loss: PlanLoss, sets: dict[str, list[list[int]]]) -> dict[str, Tensor]:
    """The one curve builder: per name, ``CE(plan) - CE(clean)`` of each of its plans (float64 ``[n_plans]``), every
    plan measured once by ``loss`` (split over the ranks of its world)."""
    loss.prefetch([[]] + [p for plans in sets.values() for p in plans])
    return {name: torch.tensor([loss.delta(p) for p in plans], dtype=torch.float64) for name, plans in sets.items()}


def single_layer_gold(loss: PlanLoss, layers: Sequence[int], already_parallel: Sequence[bool],
                      scores: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
    """The measured single-layer dCE of every layer (0 for already-parallel blocks; float64) and the Spearman rho
    of each score with it over the sequential layers."""
    cidx = [i for i, par in enumerate(already_parallel) if not par]
    delta = torch.zeros(len(layers), dtype=torch.float64)
    delta[cidx] = delta_curves(loss, {"single": [[layers[i]] for i in cidx]})["single"]
    return delta, {k: spearman(v[cidx], delta[cidx]) for k, v in scores.items()}


def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman rho (scipy); NaN with fewer than 3 points or a constant input."""
    if x.numel() < 3:
        return math.nan
    from scipy.stats import spearmanr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(spearmanr(x.numpy(), y.numpy()).statistic)


__all__ = ["PREFIX_CACHE_BYTES", "PlanLoss", "delta_curves", "single_layer_gold", "spearman"]
