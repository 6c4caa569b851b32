"""Corpora that stream: token windows cut from any text source of :func:`.windows.parse_source` (a text file, a
directory of files, JSONL, a Hugging Face dataset in streaming mode), never holding the corpus in memory (see
docs/scale_out.md)."""

from collections.abc import Iterator
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from .windows import DEFAULT_CHUNK_CHARS, CorpusSpec, TokenWindows, parse_source, text_chunks
from ..errors import InputError
from ..validation import as_int


def stream_windows(model: Any, source: str | CorpusSpec = "pydoc", length: int = 128, n_windows: int | None = None,
                   batch_size: int = 8, start: int = 0, rank: int = 0, world_size: int = 1,
                   chunk_chars: int = DEFAULT_CHUNK_CHARS) -> Iterator[tuple[int, TokenWindows]]:
    """Stream ``(first_window_index, TokenWindows)`` batches of consecutive windows of real text, labelled
    ``"<source>:w<first>-<last>/<length>"`` (arguments: docs/scale_out.md, "Streaming corpora")."""
    from ..backends import adapt

    ad = adapt(model)
    spec = source if isinstance(source, CorpusSpec) else parse_source(source)
    batch_size, start = as_int(batch_size, "batch_size", minimum=1), as_int(start, "start", minimum=0)
    world_size = as_int(world_size, "world_size", minimum=1)
    n_windows = None if n_windows is None else as_int(n_windows, "n_windows", minimum=1)
    rank = as_int(rank, "rank", minimum=0, maximum=world_size - 1)
    rows: list[list[int]] = []
    first = None
    for i, row in iter_window_rows(model, spec, length, chunk_chars):
        if n_windows is not None and i >= n_windows:
            break
        if i < start or i % world_size != rank:
            continue
        if first is None:
            first = i
        rows.append(row)
        if len(rows) == batch_size:
            yield first, _batch(rows, first, i, spec, length, ad.device)
            rows, first = [], None
    if rows:
        yield first, _batch(rows, first, first + (len(rows) - 1) * world_size, spec, length, ad.device)


def iter_window_rows(model: Any, source: str | CorpusSpec, length: int,
                     chunk_chars: int = DEFAULT_CHUNK_CHARS) -> Iterator[tuple[int, list[int]]]:
    """``(i, token ids of window i)`` for every window of the stream, in order (see the module docstring)."""
    spec = source if isinstance(source, CorpusSpec) else parse_source(source)
    length, chunk_chars = as_int(length, "length", minimum=2), as_int(chunk_chars, "chunk_chars", minimum=1)
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise InputError("the model has no tokenizer; streaming a corpus needs one to tokenize the text")
    from ..backends import adapt

    bos = adapt(model).info.prepend_bos and tok.bos_token_id is not None
    body = length - 1 if bos else length
    pending: list[int] = []
    i = 0
    for chunk in text_chunks(spec, chunk_chars):
        pending.extend(tok(chunk, add_special_tokens=False)["input_ids"])
        n_full = len(pending) // body
        for w in range(n_full):
            row = pending[w * body:(w + 1) * body]
            yield i, ([tok.bos_token_id] + row if bos else row)
            i += 1
        del pending[:n_full * body]


def _batch(rows: list[list[int]], first: int, last: int, spec: CorpusSpec, length: int,
           device: torch.device) -> TokenWindows:
    t: Int[Tensor, "batch pos"] = torch.tensor(rows, dtype=torch.long, device=device)
    return TokenWindows(t, f"{spec.label}:w{first}-{last}/{length}")


__all__ = ["CorpusSpec", "iter_window_rows", "parse_source", "stream_windows", "text_chunks"]
