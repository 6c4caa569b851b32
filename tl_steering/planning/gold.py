"""The gold standard of layer planning: the measured loss of a plan (see docs/defect.md "Gold standard").

``dCE(S) = CE(layers S parallel) - CE(clean)``, CE the mean next-token cross-entropy over every predicted
position of the token windows, the parallel blocks applied exactly with :func:`tl_steering.hooks.parallel_blocks`.
"""

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..backends import adapt
from ..batching import mean_loss
from ..hooks import parallel_blocks


class PlanLoss:
    """Memoised mean CE of plans (sets of parallel layers) on one set of token windows.

    ``loss(layers)`` runs ``ceil(batch / batch_size)`` hooked forwards the first time a set is asked for;
    :attr:`passes` counts the passes over the windows actually run (the cost, over all ranks).
    ``world`` (a :class:`tl_steering.sharding.World`): :meth:`prefetch` then evaluates a list of plans one plan
    per rank in turn and hands every value to every rank; the values are those of one process.
    """

    def __init__(self, model: Any, tokens: Tensor, batch_size: int = 8, world: Any = None):
        self.model = model
        self.ad = adapt(model)
        self.tokens = tokens
        self.batch_size = batch_size
        self.world = world
        self.memo: dict[tuple[int, ...], float] = {}
        self.passes = 0

    @staticmethod
    def _key(layers: Sequence[int]) -> tuple[int, ...]:
        return tuple(sorted(int(x) for x in layers))

    def _measure(self, key: tuple[int, ...]) -> float:
        return mean_loss(self.ad, self.tokens, parallel_blocks(self.model, list(key)), self.batch_size)

    def _cost(self, key: tuple[int, ...]) -> int:
        """Passes over the windows one measurement of ``key`` runs (1 here; more for fitted plans)."""
        return 1

    def __call__(self, layers: Sequence[int]) -> float:
        key = self._key(layers)
        if key not in self.memo:
            self.memo[key] = self._measure(key)
            self.passes += self._cost(key)
        return self.memo[key]

    def prefetch(self, plans: Iterable[Sequence[int]]) -> None:
        """Measure every plan of ``plans`` not known yet: split over the ranks of :attr:`world` (one pass over all
        windows per plan, :func:`tl_steering.sharding.split_map`), in this process without one. Every rank must
        call it with the same plans (the planners derive them from numbers every rank holds)."""
        from ..sharding import split_map

        keys = [k for k in dict.fromkeys(self._key(p) for p in plans) if k not in self.memo]
        if not keys:
            return
        self.memo.update(zip(keys, split_map(self._measure, keys, self.world)))
        self.passes += sum(self._cost(k) for k in keys)

    @property
    def clean(self) -> float:
        return self([])

    def delta(self, layers: Sequence[int]) -> float:
        """``CE(layers parallel) - CE(clean)``."""
        return self(layers) - self.clean


def single_layer_delta(loss: PlanLoss, layers: Sequence[int], already_parallel: Sequence[bool]) -> Tensor:
    """Per layer, dCE with that layer alone parallel (0 for already-parallel blocks), float64."""
    return torch.tensor([0.0 if par else loss.delta([lay]) for lay, par in zip(layers, already_parallel)],
                        dtype=torch.float64)


def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman rho (scipy); NaN with fewer than 3 points or a constant input."""
    if x.numel() < 3:
        return math.nan
    from scipy.stats import spearmanr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rho = spearmanr(x.numpy(), y.numpy()).statistic
    return float(rho)


__all__ = ["PlanLoss", "single_layer_delta", "spearman"]
