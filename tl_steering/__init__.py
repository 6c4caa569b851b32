"""tl_steering: feed-forward steering diagnostics (arXiv:2608.02071) on TransformerLens models.

The data path reads one way: model -> hooks -> metrics -> results -> figures/report.

* loading: :func:`load_model`, :func:`tiny_model`, :func:`text_tokens`; the adapter :class:`ModelAdapter`
* geometry: :mod:`tl_steering.geometry` (pure float64 sphere math)
* hooks: :mod:`tl_steering.hooks` (``ffn_component``, ``ffn_gate``, ``parallel_blocks``, ``attention_gain``)
* probes: :func:`probe`
* protocols: :func:`angular_deficit`, :func:`ffn_ablation`, :func:`diversity`, :func:`parallel_defect`
* dynamics: :func:`critical_points`, :func:`find_equilibria`, :func:`prefix_sensitivity`,
  :func:`prefix_statistics`, :func:`calibrate_gates`
* execution: :func:`parallelize`
"""

from typing import TYPE_CHECKING

from ._util import __version__
from ._util.lazy import lazy_attributes

# Lazy attributes (PEP 562): ``import tl_steering`` imports neither torch's heavy parts nor TransformerLens, so
# the CLI can refuse a bad argument in well under a second; a public name imports its module on first use.
_LAZY: dict[str, str] = {
    "errors": ".errors",
    "geometry": ".geometry",
    "hooks": ".hooks",
    "ModelAdapter": ".backends",
    "adapt": ".backends",
    "tl_version": ".backends",
    "load_model": ".backends",
    "tiny_model": ".backends",
    "CriticalPointsResult": ".critical",
    "EquilibriaResult": ".critical",
    "classify_point": ".critical",
    "critical_points": ".critical",
    "critical_points_all_layers": ".critical",
    "find_equilibria": ".critical",
    "TokenWindows": ".data.windows",
    "corpus_label": ".data.windows",
    "text_tokens": ".data.windows",
    "text_windows": ".data.windows",
    "calibrate_gates": ".protocols.gates",
    "parallelize": ".parallel",
    "ParallelPlan": ".parallel",
    "ParallelScoresResult": ".parallel",
    "parallel_scores": ".parallel",
    "plan_parallel": ".parallel",
    "prefix_sensitivity": ".protocols.prefix",
    "prefix_statistics": ".protocols.prefix",
    "probe": ".probing.trace",
    "angular_deficit": ".protocols",
    "diversity": ".protocols",
    "ffn_ablation": ".protocols",
    "parallel_defect": ".parallel",
    "Provenance": ".results",
    "Result": ".results",
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

if TYPE_CHECKING:  # static tools see the eager imports
    from . import errors, geometry, hooks  # noqa: F401
    from .backends import ModelAdapter, adapt, load_model, tiny_model, tl_version  # noqa: F401
    from .critical import (CriticalPointsResult, EquilibriaResult, classify_point, critical_points,  # noqa: F401
                           critical_points_all_layers, find_equilibria)
    from .data.windows import TokenWindows, corpus_label, text_tokens, text_windows  # noqa: F401
    from .protocols.gates import calibrate_gates  # noqa: F401
    from .parallel import (ParallelPlan, ParallelScoresResult, parallel_defect, parallel_scores,  # noqa: F401
                           parallelize, plan_parallel)
    from .protocols.prefix import prefix_sensitivity, prefix_statistics  # noqa: F401
    from .probing.trace import probe  # noqa: F401
    from .protocols import angular_deficit, diversity, ffn_ablation  # noqa: F401
    from .results import Provenance, Result  # noqa: F401

__all__ = [
    "CriticalPointsResult",
    "EquilibriaResult",
    "ModelAdapter",
    "Provenance",
    "Result",
    "TokenWindows",
    "adapt",
    "angular_deficit",
    "calibrate_gates",
    "classify_point",
    "critical_points",
    "critical_points_all_layers",
    "diversity",
    "errors",
    "ffn_ablation",
    "find_equilibria",
    "geometry",
    "hooks",
    "load_model",
    "parallel_defect",
    "ParallelPlan",
    "ParallelScoresResult",
    "parallel_scores",
    "plan_parallel",
    "parallelize",
    "prefix_sensitivity",
    "prefix_statistics",
    "probe",
    "text_tokens",
    "text_windows",
    "corpus_label",
    "tiny_model",
    "tl_version",
]
