"""The field's layer-choice scores, as baselines of the planner (docs/defect.md "Peer scores")."""

import math

import torch
from torch import Tensor

from .. import geometry as geo
# the peers' one-shot scores held in ``ParallelScoresResult.scores`` (and ``DefectResult.peer_scores``); the one copy
# is in the planner's registry (no torch: the CLI reads it before it imports torch code)
from .strategies import PEER_SCORES


def peer_terms(x: Tensor, post: Tensor, phi_x: Tensor, phi_in: Tensor, keep: Tensor) -> dict[str, Tensor]:
    """Per sequence, the sums over the kept positions of the per-token terms of :data:`PEER_SCORES`
    (``[batch]`` float64): ``1 - cos(x, post)``, ``angle(x, post) / pi`` and ``1 - cos(phi_in, phi_x)``.
    ``x``, ``post``, ``phi_x``, ``phi_in``: ``[batch, pos, d_model]``; ``keep``: ``[pos]`` bool."""
    cos_block = geo.safe_cosine(x[:, keep], post[:, keep])
    ang = geo.angle(x[:, keep], post[:, keep]) / math.pi
    cos_ffn = geo.safe_cosine(phi_in[:, keep], phi_x[:, keep])
    return {"block_influence": (1.0 - cos_block).sum(-1), "angular_distance": ang.sum(-1),
            "ffn_fusion": (1.0 - cos_ffn).sum(-1)}


def pooled(sums: dict[str, Tensor], n_tokens: int) -> dict[str, Tensor]:
    """The token means of per-sequence, per-layer sums (``{name: [n_seq, n_layer]}`` -> ``{name: [n_layer]}``);
    NaN without a token."""
    return {k: (v.sum(0) / n_tokens) if n_tokens else torch.full((v.shape[1],), math.nan, dtype=torch.float64)
            for k, v in sums.items()}


__all__ = ["PEER_SCORES", "peer_terms", "pooled"]
