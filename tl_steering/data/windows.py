"""Token windows of real English text, and the one reader of text sources (:func:`parse_source`,
:func:`text_chunks`): Python's own ``pydoc_data`` (the language reference, about 100k tokens, on every install, no
network), a local text file or directory, JSONL, or a Hugging Face dataset (optional extra)."""

from __future__ import annotations  # torch is imported where tokens are made: the CLI's checks of a source need none

import dataclasses
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InputError

if TYPE_CHECKING:
    import torch
    from jaxtyping import Int
    from torch import Tensor


@functools.lru_cache(maxsize=1)
def pydoc_text() -> str:
    """The text of ``pydoc_data.topics`` in a fixed order (sorted topic names)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


DEFAULT_CHUNK_CHARS = 1 << 16


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    """What to read: ``kind`` is ``"pydoc"``, ``"file"``, ``"dir"``, ``"jsonl"`` or ``"hf"``; built by
    :func:`parse_source` from a source string (docs/scale_out.md, "Streaming corpora")."""

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


@functools.lru_cache(maxsize=8)
def _token_stream(tokenizer_key: str, source: str, tokenizer: Any) -> tuple[list[int], str]:
    """The token ids of the whole text of ``source`` (an ``hf:`` source: its first 2000 non-empty records), and
    its label; ``tokenizer_key`` keys the cache."""
    spec = parse_source(source)
    if spec.kind != "hf":
        text = "".join(text_chunks(spec))
    else:
        ds = datasets_module().load_dataset(spec.location, spec.config, split=spec.split)
        col = spec.field or ("text" if "text" in ds.column_names else ds.column_names[0])
        text = "\n\n".join(t for t in ds[col][:2000] if t and t.strip())
    return tokenizer(text, add_special_tokens=False)["input_ids"], spec.label


def text_tokens(model: Any, source: str = "pydoc", n_windows: int = 8, length: int = 128,
                seed: int = 0) -> Int[Tensor, "batch pos"]:
    """``[n_windows, length]`` long tensor (on the model's device) of deterministic windows of real text, tokenized
    for ``model``: non-overlapping chunks of the token stream of ``source`` (``"pydoc"``, offline, or any source of
    :func:`parse_source`; ``hf:`` reads the first 2000 records) chosen by a permutation seeded with ``seed``. A
    window is ``[BOS] + length - 1`` text tokens where the model prepends BOS (GPT-2, Gemma), else ``length``."""
    import torch

    from ..backends import adapt

    ad = adapt(model)
    if n_windows < 1 or length < 2:
        raise InputError(f"need n_windows >= 1 and length >= 2, got {n_windows} and {length}")
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise InputError("the model has no tokenizer; pass token ids yourself")
    bos = ad.info.prepend_bos and tok.bos_token_id is not None
    body = length - 1 if bos else length
    key = f"{getattr(tok, 'name_or_path', '')}:{len(tok)}"
    ids, label = _token_stream(key, source, tok)
    n_chunks = len(ids) // body
    if n_chunks < n_windows:
        raise InputError(f"{label} gives {len(ids)} tokens: only {n_chunks} windows of {body}; ask for fewer or shorter")
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(n_chunks, generator=g)[:n_windows].sort().values.tolist()
    rows = [ids[c * body:(c + 1) * body] for c in chosen]
    if bos:
        rows = [[tok.bos_token_id] + r for r in rows]
    return torch.tensor(rows, dtype=torch.long, device=ad.device)


def corpus_label(source: str = "pydoc", n_windows: int = 8, length: int = 128, seed: int = 0) -> str:
    """The provenance label of ``text_tokens(model, source, n_windows, length, seed)``, e.g. ``"pydoc:8x128:seed0"``
    (a file source: ``"file:NAME:..."``); pass it as ``corpus=``."""
    label = source if source == "pydoc" or source.startswith("hf:") else f"file:{Path(source).name}"
    return f"{label}:{n_windows}x{length}:seed{seed}"


@dataclasses.dataclass(frozen=True)
class TokenWindows:
    """Token ids together with the label of the corpus they came from, provenance that survives slicing (every
    public call takes one as ``tokens``; docs/protocols.md, "Conventions shared by every protocol")."""

    tokens: Int[Tensor, "batch pos"]
    corpus: str

    @property
    def shape(self) -> torch.Size:
        return self.tokens.shape

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def __getitem__(self, rows: Any) -> "TokenWindows":
        sub = self.tokens[rows]
        if sub.ndim == 1:
            sub = sub.unsqueeze(0)
        if isinstance(rows, slice):
            start, stop, step = rows.indices(len(self))
            where = f"{start}:{stop}" + (f":{step}" if step != 1 else "")
        else:
            where = str(rows.tolist() if hasattr(rows, "tolist") else rows)  # a tensor or array of rows
        return TokenWindows(sub, f"{self.corpus}[{where}]")

    def split(self, size: int) -> list["TokenWindows"]:
        """Consecutive row batches of ``size`` windows (the last may be smaller), each labelled."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InputError(f"TokenWindows.split: size must be a positive int, got {size!r}")
        return [self[i:i + size] for i in range(0, len(self), size)]

    def to(self, device: Any) -> "TokenWindows":
        return TokenWindows(self.tokens.to(device), self.corpus)


def text_windows(model: Any, source: str = "pydoc", n_windows: int = 8, length: int = 128,
                 seed: int = 0) -> TokenWindows:
    """:func:`text_tokens` with its corpus label attached (a :class:`TokenWindows`)."""
    return TokenWindows(text_tokens(model, source, n_windows, length, seed),
                        corpus_label(source, n_windows, length, seed))


def token_source(tokens: Any, corpus: str | None = None) -> tuple[Any, str | None]:
    """Unpack what a public call was given as ``tokens``: ``(tensor-or-input, corpus label or None)``, an explicit
    ``corpus`` before a :class:`TokenWindows` label; not validated here (:func:`model_tokens` does that)."""
    if corpus is not None and not isinstance(corpus, str):
        raise InputError(f"corpus must be a str label (e.g. 'pydoc:8x128:seed0'), got {type(corpus).__name__}")
    if isinstance(tokens, TokenWindows):
        return tokens.tokens, corpus if corpus is not None else tokens.corpus
    return tokens, corpus


def model_tokens(model: Any, tokens: Any, corpus: str | None = None) -> tuple[Any, Tensor, str | None]:
    """What every public call does first: ``(adapter, token tensor checked by the adapter's validate_tokens, corpus
    label or None)``; ``tokens`` may be a tensor or a :class:`TokenWindows` (:func:`token_source`)."""
    from ..backends import adapt

    ad = adapt(model)
    tokens, corpus = token_source(tokens, corpus)
    return ad, ad.validate_tokens(tokens), corpus


__all__ = ["CorpusSpec", "TokenWindows", "corpus_label", "model_tokens", "pydoc_text", "text_tokens", "text_windows",
           "token_source", "parse_source", "text_chunks"]
