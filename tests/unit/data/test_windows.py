"""Token windows from pydoc_data or a file, and their corpus label (tl_steering/data/windows.py)."""

import pytest
import torch

import tl_steering as ts
from tl_steering.errors import InputError


def test_text_tokens_deterministic_and_bos(tiny):
    a = ts.text_tokens(tiny, n_windows=4, length=32, seed=0)
    b = ts.text_tokens(tiny, n_windows=4, length=32, seed=0)
    c = ts.text_tokens(tiny, n_windows=4, length=32, seed=1)
    assert a.shape == (4, 32) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (a[:, 0] == tiny.tokenizer.bos_token_id).all()  # tiny models prepend BOS
    text = tiny.tokenizer.decode(a[0, 1:])
    assert sum(ch.isalpha() for ch in text) > 10  # real English text from the language reference
    assert not hasattr(a, "_tl_steering_corpus")  # no tags on the user's tensors: provenance is explicit
    from tl_steering.data.windows import corpus_label

    assert corpus_label("pydoc", 4, 32, 0) == "pydoc:4x32:seed0"


def test_token_windows_keep_their_corpus_through_slicing(tiny):
    w = ts.text_windows(tiny, n_windows=4, length=32, seed=0)
    assert torch.equal(w.tokens, ts.text_tokens(tiny, n_windows=4, length=32, seed=0))
    assert w.corpus == "pydoc:4x32:seed0" and len(w) == 4 and w.shape == (4, 32)
    parts = w.split(3)
    assert [p.corpus for p in parts] == ["pydoc:4x32:seed0[0:3]", "pydoc:4x32:seed0[3:4]"]
    assert [len(p) for p in parts] == [3, 1]
    assert w[1].shape == (1, 32) and w[1].corpus == "pydoc:4x32:seed0[1]"
    # a protocol records the label: from the TokenWindows, or from an explicit corpus= (which wins)
    res = ts.angular_deficit(tiny, parts[0], layers=[0])
    assert res.provenance.corpus == "pydoc:4x32:seed0[0:3]" and res.provenance.n_sequences == 3
    res = ts.angular_deficit(tiny, w.tokens[:2], layers=[0], corpus="mine")
    assert res.provenance.corpus == "mine" and res.provenance.world_size == 1
    res = ts.angular_deficit(tiny, w.tokens[:2], layers=[0])
    assert res.provenance.corpus.startswith("caller's tokens")
    with pytest.raises(InputError, match="corpus must be a str"):
        ts.angular_deficit(tiny, w.tokens[:2], layers=[0], corpus=3)
    with pytest.raises(InputError, match="positive int"):
        w.split(0)


def test_text_tokens_from_file(tiny, tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("The quick brown fox jumps over the lazy dog. " * 50)
    t = ts.text_tokens(tiny, source=str(p), n_windows=2, length=16)
    assert t.shape == (2, 16)
    with pytest.raises(InputError, match="neither 'pydoc'"):
        ts.text_tokens(tiny, source=str(tmp_path / "missing.txt"))
    with pytest.raises(InputError, match="windows"):
        ts.text_tokens(tiny, source=str(p), n_windows=1000, length=64)
