"""tl_steering: feed-forward steering diagnostics (arXiv:2608.02071) on TransformerLens models.

Public surface: loaders (:func:`load_model`, :func:`tiny_model`, :func:`text_tokens`), the adapter
(:class:`ModelAdapter`), geometry (:mod:`tl_steering.geometry`), hook factories (:mod:`tl_steering.hooks`),
probes, the paper's protocols, and the parallel executor.
"""

__version__ = "0.1.0"

from . import errors
from .adapter import ModelAdapter, adapt, tl_version
from .data import text_tokens
from .loading import load_model, tiny_model

__all__ = ["ModelAdapter", "adapt", "errors", "load_model", "text_tokens", "tiny_model", "tl_version"]
