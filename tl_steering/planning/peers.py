"""The field's layer-choice scores, as baselines of the planner (docs/defect.md "Peer scores").

Every score is pooled as a mean over the tokens of the non-excluded positions (position 0 excluded by default),
float64, "lower = safer to make parallel", from the forward :func:`tl_steering.protocols.parallel_defect` already
runs (no pass of their own). Per layer l, x = resid_pre, a = attn_out, Phi = MLP(LN2(.)):

* ``block_influence`` (ShortGPT, Men et al. 2024, arXiv:2403.03853): ``1 - E cos(x_l, x_{l+1})``, x_{l+1} the
  block's output (resid_post): how much the block turns the residual;
* ``angular_distance`` (Gromov et al. 2024, arXiv:2403.17887): ``E arccos(cos(x_l, x_{l+1})) / pi``, the angular
  distance between a block's input and output (their n = 1; averaged over tokens, not the last token only);
* ``ffn_fusion`` (FFN Fusion, Bercovich et al. 2025, arXiv:2503.18908): ``1 - E cos(Phi(x + a), Phi(x))``, the
  cosine distance between the block's FFN write with and without its attention input (for an already parallel
  block, the counterfactual sequential write).

SLEB (Song et al. 2024, arXiv:2402.09025), the greedy measured block choice, is a planner, not a score:
``plan_parallel(..., strategy="sleb")`` (``greedy_measured`` with ``shortlist=None``).
"""

import math

import torch
from torch import Tensor

from .. import geometry as geo
# the peers' one-shot scores held in ``ParallelScoresResult.scores`` (and ``DefectResult.peer_scores``); the one copy
# is in the suite's settings (the CLI reads them before it imports torch code)
from ..suite.settings import PEER_SCORES


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
