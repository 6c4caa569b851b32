"""Streaming corpora (tl_steering.data.corpus): windows equal to whole-text tokenization, sharding, resuming,
JSONL / directory sources, and a file larger than the windows asked for is never read whole."""

import json
import tracemalloc

import pytest
import torch

import tl_steering as ts
from tl_steering.backends import adapt
from tl_steering.data.corpus import parse_source, stream_windows
from tl_steering.errors import InputError

LINE = "The quick brown fox jumps over the lazy dog while the cat sleeps.\n"


def _all_rows(model, source, length, **kw):
    return torch.cat([w.tokens for _, w in stream_windows(model, source, length=length, **kw)])


@pytest.fixture(scope="module")
def model():
    """Streaming needs only a tokenizer and the BOS convention: one tiny model (every arch shares the tokenizer)."""
    return ts.tiny_model("gpt2", backend="bridge")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "big.txt"
    p.write_text("".join(f"{i} {LINE}" for i in range(3000)))  # ~200 KB
    return p


def test_windows_match_whole_text_tokenization(tiny, text_file):
    tok = tiny.tokenizer
    ids = tok(text_file.read_text(), add_special_tokens=False)["input_ids"]
    length = 16
    bos = adapt(tiny).info.prepend_bos
    body = length - 1 if bos else length
    got = _all_rows(tiny, str(text_file), length, n_windows=50, chunk_chars=700)
    want = torch.tensor([([tok.bos_token_id] if bos else []) + ids[i * body:(i + 1) * body] for i in range(50)])
    assert torch.equal(got, want)  # line-aligned chunks: no seam differs for this tokenizer


def test_shards_partition_the_stream_and_resume_skips(model, text_file):
    full = _all_rows(model, str(text_file), 16, n_windows=23, batch_size=4)
    r0 = list(stream_windows(model, str(text_file), length=16, n_windows=23, batch_size=4, rank=0, world_size=2))
    r1 = list(stream_windows(model, str(text_file), length=16, n_windows=23, batch_size=4, rank=1, world_size=2))
    assert [i for i, _ in r0] == [0, 8, 16] and [i for i, _ in r1] == [1, 9, 17]
    rows0, rows1 = torch.cat([w.tokens for _, w in r0]), torch.cat([w.tokens for _, w in r1])
    assert torch.equal(rows0, full[0::2]) and torch.equal(rows1, full[1::2])
    assert r0[0][1].corpus == "file:big.txt:w0-6/16" and r1[-1][1].corpus == "file:big.txt:w17-21/16"
    resumed = _all_rows(model, str(text_file), 16, n_windows=23, batch_size=4, start=12)
    assert torch.equal(resumed, full[12:])


def test_jsonl_and_directory_sources(model, tmp_path):
    recs = [{"text": f"{i} {LINE * 3}", "id": i} for i in range(40)]
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in recs))
    a = _all_rows(model, f"jsonl:{p}", 12, n_windows=10)
    b = _all_rows(model, f"jsonl:{p}:text", 12, n_windows=10)
    assert a.shape == (10, 12) and torch.equal(a, b)
    assert parse_source(f"jsonl:{p}:body").field == "body"
    with pytest.raises(InputError, match="no field 'body'"):
        _all_rows(model, f"jsonl:{p}:body", 12, n_windows=2)
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.txt").write_text(LINE * 20)
    rows = _all_rows(model, str(d), 12)
    assert rows.shape[0] >= 3 * 20 * 10 // 12  # every file was read
    with pytest.raises(InputError, match="neither 'pydoc'"):
        parse_source(str(tmp_path / "missing"))
    with pytest.raises(InputError, match="rank"):
        next(stream_windows(model, str(d), rank=2, world_size=2))


def test_a_large_file_is_never_read_whole(model, tmp_path, monkeypatch):
    """Memory flat in N and bytes read bounded by what the windows asked for need (plus one chunk)."""
    p = tmp_path / "huge.txt"
    with open(p, "w") as f:
        for i in range(60000):
            f.write(f"{i} {LINE}")  # ~4.3 MB of text
    size = p.stat().st_size
    read = {"chars": 0}
    real_open = open

    class Counting:
        def __init__(self, h):
            self.h = h

        def __iter__(self):
            for line in self.h:
                read["chars"] += len(line)
                yield line

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.h.close()

    import tl_steering.data.corpus as corpus_mod

    monkeypatch.setattr(corpus_mod, "open", lambda *a, **k: Counting(real_open(*a, **k)), raising=False)
    peaks = {}
    for n in (20, 400):
        read["chars"] = 0
        tracemalloc.start()
        count = 0
        for _, w in stream_windows(model, str(p), length=32, n_windows=n, batch_size=8, chunk_chars=4096):
            count += len(w)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert count == n
        assert read["chars"] < n * 32 * 6 + 2 * 4096 < size  # a few chars per token, plus one chunk
    assert peaks[400] < 1.5 * peaks[20] + 200_000, peaks  # no growth with the number of windows
