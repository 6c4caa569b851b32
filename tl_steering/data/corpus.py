"""Corpora that stream: token windows cut from a text file, a directory of files, JSONL or a Hugging Face
dataset in streaming mode, without ever holding the corpus in memory (see docs/scale_out.md)."""

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from .windows import TokenWindows, pydoc_text
from ..errors import InputError
from ..validation import as_int

DEFAULT_CHUNK_CHARS = 1 << 16


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    """What to read: ``kind`` is ``"pydoc"``, ``"file"``, ``"dir"``, ``"jsonl"`` or ``"hf"``.

    Build one with :func:`parse_source` from a string: ``"pydoc"``, ``PATH`` (a text file or a directory of
    ``*.txt`` / ``*.md`` files, read in sorted order), ``"jsonl:PATH[:FIELD]"`` (default field ``text``), or
    ``"hf:NAME[:CONFIG]:SPLIT[:FIELD]"`` (needs the ``datasets`` extra and the hub).
    """

    kind: str
    location: str
    field: str | None = None
    config: str | None = None
    split: str | None = None

    @property
    def label(self) -> str:
        """Short provenance label of the source (file names, not absolute paths)."""
        if self.kind == "pydoc":
            return "pydoc"
        if self.kind in ("file", "dir"):
            return f"{self.kind}:{Path(self.location).name}"
        if self.kind == "jsonl":
            return f"jsonl:{Path(self.location).name}:{self.field}"
        return ":".join(x for x in ("hf", self.location, self.config, self.split, self.field) if x)


def parse_source(source: str) -> CorpusSpec:
    """Turn a ``source`` string into a :class:`CorpusSpec` (errors name what is wrong and what to pass)."""
    if not isinstance(source, str) or not source:
        raise InputError(f"source must be a non-empty string ('pydoc', a path, 'jsonl:PATH[:FIELD]' or "
                         f"'hf:NAME[:CONFIG]:SPLIT[:FIELD]'), got {source!r}")
    if source == "pydoc":
        return CorpusSpec("pydoc", "pydoc")
    if source.startswith("jsonl:"):
        rest = source[len("jsonl:"):]
        path, _, field = (rest, "", "") if Path(rest).is_file() else rest.rpartition(":")
        if not Path(path).is_file():
            raise InputError(f"JSONL corpus {path!r} is not a file")
        return CorpusSpec("jsonl", path, field=field or "text")
    if source.startswith("hf:"):
        parts = source[3:].split(":")
        if len(parts) == 1 or not parts[0]:
            raise InputError(f"Hugging Face source {source!r}: use 'hf:NAME[:CONFIG]:SPLIT[:FIELD]'")
        name = parts[0]
        config, split, field = None, parts[-1], None
        if len(parts) == 3:
            config, split = parts[1], parts[2]
        elif len(parts) >= 4:
            config, split, field = parts[1] or None, parts[2], parts[3]
        return CorpusSpec("hf", name, field=field, config=config, split=split)
    path = Path(source)
    if path.is_dir():
        return CorpusSpec("dir", str(path))
    if path.is_file():
        return CorpusSpec("file", str(path))
    raise InputError(f"text source {source!r} is neither 'pydoc', an existing file or directory, "
                     "'jsonl:PATH[:FIELD]' nor 'hf:NAME[:CONFIG]:SPLIT[:FIELD]'")


def datasets_module() -> Any:
    """The ``datasets`` package (an optional extra), or an InputError saying how to install it."""
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError as e:
        raise InputError("an 'hf:' source needs the datasets extra: pip install 'tl-steering[datasets]'") from e
    return datasets


def _read_chunks(handle: Any, chunk_chars: int) -> Iterator[str]:
    """Line-aligned chunks of about ``chunk_chars`` characters from a text handle (one line may be longer)."""
    buf: list[str] = []
    size = 0
    for line in handle:
        buf.append(line)
        size += len(line)
        if size >= chunk_chars:
            yield "".join(buf)
            buf, size = [], 0
    if buf:
        yield "".join(buf)


def text_chunks(spec: CorpusSpec, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> Iterator[str]:
    """The source's text as a stream of line-aligned chunks; documents are separated by a blank line."""
    if spec.kind == "pydoc":
        text = pydoc_text()
        for i in range(0, len(text), chunk_chars):
            yield text[i:i + chunk_chars]
    elif spec.kind == "file":
        with open(spec.location, encoding="utf-8", errors="replace") as f:
            yield from _read_chunks(f, chunk_chars)
    elif spec.kind == "dir":
        files = sorted(p for p in Path(spec.location).rglob("*") if p.is_file() and p.suffix in (".txt", ".md"))
        if not files:
            raise InputError(f"directory {spec.location!r} holds no *.txt or *.md file")
        for p in files:
            with open(p, encoding="utf-8", errors="replace") as f:
                yield from _read_chunks(f, chunk_chars)
            yield "\n\n"
    elif spec.kind == "jsonl":
        with open(spec.location, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{spec.location}:{lineno}: not a JSON line ({e.msg})") from e
                if not isinstance(rec, dict) or spec.field not in rec:
                    raise InputError(f"{spec.location}:{lineno}: no field {spec.field!r} "
                                     "(choose it with 'jsonl:PATH:FIELD')")
                text = str(rec[spec.field])
                for i in range(0, len(text), chunk_chars):
                    yield text[i:i + chunk_chars]
                yield "\n\n"
    elif spec.kind == "hf":
        ds = datasets_module().load_dataset(spec.location, spec.config, split=spec.split, streaming=True)
        for rec in ds:
            field = spec.field or ("text" if "text" in rec else next(iter(rec)))
            text = rec[field]
            if text and str(text).strip():
                yield str(text)
                yield "\n\n"
    else:  # pragma: no cover - CorpusSpec is built by parse_source
        raise InputError(f"unknown corpus kind {spec.kind!r}")


def stream_windows(model: Any, source: str | CorpusSpec = "pydoc", length: int = 128, n_windows: int | None = None,
                   batch_size: int = 8, start: int = 0, rank: int = 0, world_size: int = 1,
                   chunk_chars: int = DEFAULT_CHUNK_CHARS) -> Iterator[tuple[int, TokenWindows]]:
    """Stream ``(first_window_index, TokenWindows)`` batches of consecutive windows of real text (docs/scale_out.md).

    ``source``: see :class:`CorpusSpec`; ``length``: tokens per window (BOS included where the model prepends it);
    ``n_windows``: how many windows of the stream to cover (all ranks together; ``None``: until the source ends);
    ``batch_size``: windows per yielded batch; ``start``: skip the stream's first windows (``resume``); this
    process keeps window ``i`` only when ``i % world_size == rank``; ``chunk_chars``: characters tokenized at a
    time. Each batch is labelled ``"<source>:w<first>-<last>/<length>"``, its tokens on the model's device.
    """
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
