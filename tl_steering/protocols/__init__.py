"""The paper's experiment protocols: :func:`angular_deficit`, :func:`ffn_ablation`, :func:`diversity`, and the
diagnostics beside them (docs/protocols.md; the fourth protocol, the defect, lives in :mod:`tl_steering.parallel`)."""

from .ablation import VARIANTS, AblationResult, ffn_ablation
from .deficit import DeficitResult, angular_deficit
from .diversity import DiversityResult, diversity

__all__ = [
    "AblationResult", "DeficitResult", "DiversityResult", "VARIANTS", "angular_deficit", "diversity",
    "ffn_ablation"]
