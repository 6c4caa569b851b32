"""tl_steering: feed-forward steering diagnostics (arXiv:2608.02071) on TransformerLens models.

The public surface is :data:`PUBLIC` (listed in docs/index.md); the rooms behind it: docs/architecture.md.
"""

from typing import TYPE_CHECKING

from ._util import __version__
from ._util.lazy import lazy_attributes

# The public surface, one list: name -> the module that defines it. Lazy (PEP 562): ``import tl_steering`` imports
# neither torch's heavy parts nor TransformerLens, so the CLI can refuse a bad argument in well under a second; a
# name imports its module on first use (a name equal to its module's last part is the module itself).
PUBLIC: dict[str, str] = {
    # primitives and the backend
    "errors": ".errors",
    "geometry": ".geometry",
    "hooks": ".hooks",
    "Provenance": ".results",
    "Result": ".results",
    "ModelAdapter": ".backends",
    "adapt": ".backends",
    "load_model": ".backends",
    "tiny_model": ".backends",
    "tl_version": ".backends",
    # data
    "TokenWindows": ".data.windows",
    "corpus_label": ".data.windows",
    "text_tokens": ".data.windows",
    "text_windows": ".data.windows",
    # the probe
    "probe": ".probing.trace",
    "ProbeResult": ".probing.result",
    "scan": ".probing.scan",
    # protocols and diagnostics
    "angular_deficit": ".protocols.deficit",
    "DeficitResult": ".protocols.deficit",
    "ffn_ablation": ".protocols.ablation",
    "AblationResult": ".protocols.ablation",
    "diversity": ".protocols.diversity",
    "DiversityResult": ".protocols.diversity",
    "calibrate_gates": ".protocols.gates",
    "GateResult": ".protocols.gates",
    "prefix_sensitivity": ".protocols.prefix",
    "prefix_statistics": ".protocols.prefix",
    "PrefixSensitivityResult": ".protocols.prefix",
    "PrefixStatisticsResult": ".protocols.prefix",
    "critical_points": ".critical.model",
    "critical_census": ".critical.model",
    "CensusResult": ".critical.census",
    "CriticalPointsResult": ".critical.results",
    "find_equilibria": ".critical.finder",
    "classify_point": ".critical.finder",
    "EquilibriaResult": ".critical.results",
    # parallel blocks
    "parallel_defect": ".parallel.defect",
    "DefectResult": ".parallel.defect_result",
    "parallel_scores": ".parallel.scores",
    "ParallelScoresResult": ".parallel.scores",
    "plan_parallel": ".parallel.plan",
    "ParallelPlan": ".parallel.plan_result",
    "parallelize": ".parallel.apply",
    # the suite and its report
    "run_suite": ".suite.run",
    "default_settings": ".suite.settings",
    "SuiteSettings": ".suite.settings",
    "SuiteResult": ".suite.result",
    "render_report": ".report",
}

__getattr__, __dir__ = lazy_attributes(__name__, PUBLIC, globals())
__all__ = list(PUBLIC)

if TYPE_CHECKING:  # static tools see the names (tests/test_public_surface.py checks these imports name PUBLIC)
    from . import errors, geometry, hooks
    from .backends import ModelAdapter, adapt, load_model, tiny_model, tl_version
    from .critical.finder import classify_point, find_equilibria
    from .critical.census import CensusResult
    from .critical.model import critical_census, critical_points
    from .critical.results import CriticalPointsResult, EquilibriaResult
    from .data.windows import TokenWindows, corpus_label, text_tokens, text_windows
    from .parallel.apply import parallelize
    from .parallel.defect import parallel_defect
    from .parallel.defect_result import DefectResult
    from .parallel.plan import plan_parallel
    from .parallel.plan_result import ParallelPlan
    from .parallel.scores import ParallelScoresResult, parallel_scores
    from .probing.result import ProbeResult
    from .probing.scan import scan
    from .probing.trace import probe
    from .protocols.ablation import AblationResult, ffn_ablation
    from .protocols.deficit import DeficitResult, angular_deficit
    from .protocols.diversity import DiversityResult, diversity
    from .protocols.gates import GateResult, calibrate_gates
    from .protocols.prefix import PrefixSensitivityResult, PrefixStatisticsResult, prefix_sensitivity, prefix_statistics
    from .report import render_report
    from .results import Provenance, Result
    from .suite.result import SuiteResult
    from .suite.run import run_suite
    from .suite.settings import SuiteSettings, default_settings
