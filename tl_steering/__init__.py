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

__version__ = "0.1.0"

from . import errors, geometry, hooks
from .backends import ModelAdapter, adapt, tl_version
from .critical import CriticalPointsResult, critical_points, critical_points_all_layers
from .data import TokenWindows, corpus_label, text_tokens, text_windows
from .critical import EquilibriaResult, classify_point, find_equilibria
from .gates import calibrate_gates
from .backends import load_model, tiny_model
from .parallel import parallelize
from .prefix import prefix_sensitivity, prefix_statistics
from .probe import probe
from .protocols import angular_deficit, diversity, ffn_ablation, parallel_defect
from .planning import ParallelPlan, ParallelScoresResult, parallel_scores, plan_parallel
from .results import Provenance, Result

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
