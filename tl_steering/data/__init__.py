"""Token data: windows of a model's tokens (:mod:`.windows`), corpora (:mod:`.corpus`), batching and losses
over batches (:mod:`.batching`), and sharding over ranks (:mod:`.sharding`)."""

from typing import TYPE_CHECKING

from .._util.lazy import lazy_attributes

# lazy (PEP 562): the CLI reads .sharding without importing torch's heavy parts through .windows
_LAZY = {n: ".windows" for n in ("TokenWindows", "corpus_label", "model_tokens", "pydoc_text", "text_tokens",
                                 "text_windows", "token_source")}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

if TYPE_CHECKING:
    from .windows import (TokenWindows, corpus_label, model_tokens, pydoc_text, text_tokens,  # noqa: F401
                          text_windows, token_source)

__all__ = sorted(_LAZY)
