"""The probe: per-layer geometry of the residual stream in one pass (:mod:`.trace`), its streaming kernels
(:mod:`.kernels`), its result (:mod:`.result`) and corpus-scale scans (:mod:`.scan`); see docs/probe.md."""

from typing import TYPE_CHECKING

from .._util.lazy import lazy_attributes

# lazy (PEP 562): importing .kernels or .result alone does not import the probe and its backends
_LAZY = {n: ".trace" for n in ("ALL_QUANTITIES", "METRICS", "QUANTITIES", "SITES3", "ProbeResult", "ProbeTrace",
                               "probe")}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

if TYPE_CHECKING:
    from .trace import ALL_QUANTITIES, METRICS, QUANTITIES, SITES3, ProbeResult, ProbeTrace, probe  # noqa: F401

__all__ = sorted(_LAZY)
