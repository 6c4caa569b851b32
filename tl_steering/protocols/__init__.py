"""The paper's experiment protocols on TransformerLens models (docs/protocols.md). The fourth, the
sequential-to-parallel defect, lives with the plans it scores in :mod:`tl_steering.parallel`.

* :func:`angular_deficit` (docs/deficit.md): alignment of the attention-only update with the real block update.
* :func:`ffn_ablation` (docs/ablation.md): keep only the tangential / radial part of every FFN write; loss, KL, top-1.
* :func:`diversity` (docs/diversity.md): spherical diversity of token directions around attention and the FFN.

Each returns a registered :class:`tl_steering.results.Result` with provenance, ``summary()`` and ``plot()``.
"""

from .ablation import VARIANTS, AblationResult, ffn_ablation
from .deficit import DeficitResult, angular_deficit
from .diversity import DiversityResult, diversity

__all__ = [
    "AblationResult",
    "DeficitResult",
    "DiversityResult",
    "VARIANTS",
    "angular_deficit",
    "diversity",
    "ffn_ablation",
]
