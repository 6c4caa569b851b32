"""The paper's experiment protocols on TransformerLens models (docs/protocols.md).

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

try:  # protocols/defect.py (sequential-to-parallel defect, docs/defect.md) is written separately and may not exist yet
    from . import defect as _defect
except ModuleNotFoundError as _e:  # only a missing defect.py is tolerated; its own import errors surface
    if _e.name != f"{__name__}.defect":
        raise
    _defect = None
if _defect is not None:
    from .defect import *  # noqa: F401,F403

    __all__ += list(getattr(_defect, "__all__", [n for n in dir(_defect) if not n.startswith("_")]))
