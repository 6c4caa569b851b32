"""tl_steering: feed-forward steering diagnostics (arXiv:2608.02071) on TransformerLens models.

The public surface is :data:`PUBLIC` (listed in docs/index.md): the functions a user calls, the objects a user
passes back in, and :class:`Result`, whose ``load`` reads any saved result. Result classes are imported from their
rooms (``from tl_steering.protocols.deficit import DeficitResult``); the rooms: docs/architecture.md."""

from typing import TYPE_CHECKING

from ._util import __version__
from ._util.lazy import lazy_attributes

# The public surface, one list: name -> the module that defines it. Lazy (PEP 562): ``import tl_steering`` imports
# neither torch's heavy parts nor TransformerLens, so the CLI can refuse a bad argument in well under a second; a
# name imports its module on first use (a name equal to its module's last part is the module itself).
PUBLIC: dict[str, str] = {
    # primitives and the backend
    "errors": ".errors", "geometry": ".geometry", "hooks": ".hooks", "Result": ".results", "adapt": ".backends",
    "load_model": ".backends", "tiny_model": ".backends", "tl_version": ".backends",
    # data
    "TokenWindows": ".data.windows", "text_tokens": ".data.windows", "text_windows": ".data.windows",
    # the probe
    "probe": ".probing.trace", "scan": ".probing.scan",
    # protocols and diagnostics
    "angular_deficit": ".protocols.deficit", "ffn_ablation": ".protocols.ablation",
    "diversity": ".protocols.diversity", "calibrate_gates": ".protocols.gates",
    "prefix_sensitivity": ".protocols.prefix", "prefix_statistics": ".protocols.prefix",
    "critical_points": ".critical.model", "critical_census": ".critical.model", "find_equilibria": ".critical.finder",
    # parallel blocks
    "parallel_defect": ".parallel.defect", "parallel_scores": ".parallel.scores", "plan_parallel": ".parallel.plan",
    "ParallelPlan": ".parallel.plan_result", "parallelize": ".parallel.apply",
    # the suite and its report
    "run_suite": ".suite.run", "SuiteSettings": ".suite.settings", "render_report": ".report"}

__getattr__, __dir__ = lazy_attributes(__name__, PUBLIC, globals())
__all__ = list(PUBLIC)

if TYPE_CHECKING:  # static tools see the names (tests/test_public_surface.py checks these imports name PUBLIC)
    from . import errors, geometry, hooks
    from .backends import adapt, load_model, tiny_model, tl_version
    from .critical.finder import find_equilibria
    from .critical.model import critical_census, critical_points
    from .data.windows import TokenWindows, text_tokens, text_windows
    from .parallel.apply import parallelize
    from .parallel.defect import parallel_defect
    from .parallel.plan import plan_parallel
    from .parallel.plan_result import ParallelPlan
    from .parallel.scores import parallel_scores
    from .probing.scan import scan
    from .probing.trace import probe
    from .protocols.ablation import ffn_ablation
    from .protocols.deficit import angular_deficit
    from .protocols.diversity import diversity
    from .protocols.gates import calibrate_gates
    from .protocols.prefix import prefix_sensitivity, prefix_statistics
    from .report import render_report
    from .results import Result
    from .suite.run import run_suite
    from .suite.settings import SuiteSettings
