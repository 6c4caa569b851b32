"""The dequantized-weight cache (tl_steering/backends/weight_cache.py) on tiny tensor dicts: no GGUF needed.

Asserts: a hit returns bit-identical tensors (every dtype, tied weights, 0-d) without calling the builder; a
corrupted, truncated, partial or foreign entry is detected, deleted and rebuilt, never used; writing is atomic
(no temporary directory left after success, after a failing build, or after a process killed mid-write); the key
follows the source file's content, the dtype and the format version; the cache root follows TL_STEERING_CACHE,
then XDG_CACHE_HOME, then ~/.cache. Cost: about 1 s in all (one subprocess that imports torch).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tl_steering.backends import weight_cache as wc


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(11, 5, generator=g)
    return {
        "embed.weight": emb,
        "head.weight": emb,  # tied: shares storage with embed.weight (safetensors refuses shared tensors)
        "layer.0.w": torch.randn(5, 7, generator=g),
        "layer.0.w_t": torch.randn(7, 5, generator=g).t(),  # non-contiguous
        "norm.bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "scale": torch.tensor(3.25, dtype=torch.float64),
        "ids": torch.arange(6, dtype=torch.int64),
        "denormal": torch.tensor([1e-45, -0.0, float("inf")], dtype=torch.float32),
    }


class Builder:
    """A build callback that counts its calls and writes one auxiliary file, like a tokenizer."""

    def __init__(self):
        self.calls = 0

    def __call__(self, out: Path):
        self.calls += 1
        (out / "config.json").write_text(json.dumps({"d": 5}))
        return _tensors(), {"revision": "tiny-v0"}


@pytest.fixture
def source(tmp_path, monkeypatch):
    monkeypatch.setenv("TL_STEERING_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "weights.gguf"
    src.write_bytes(b"not really a gguf" * 100)
    return src


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for k, v in b.items():
        assert a[k].dtype == v.dtype and a[k].shape == v.shape, k
        # bitwise: compare the raw bytes (torch.equal would call -0.0 == 0.0 equal)
        assert a[k].reshape(-1).view(torch.uint8).tolist() == v.reshape(-1).view(torch.uint8).tolist(), k


def test_hit_is_bit_identical_to_the_cold_build_and_skips_it(source):
    build = Builder()
    entry, meta, hit = wc.cached_entry("tiny", source, torch.float32, build)
    assert (hit, build.calls, meta) == (False, 1, {"revision": "tiny-v0"})
    cold = load_file(entry / wc.WEIGHTS_FILE)
    entry2, meta2, hit2 = wc.cached_entry("tiny", source, torch.float32, build)
    assert (entry2, meta2, hit2, build.calls) == (entry, meta, True, 1)
    warm = load_file(entry2 / wc.WEIGHTS_FILE)
    expect = _tensors()
    expect.pop("head.weight")  # stored once; the model re-ties it on load
    assert sorted(warm) == sorted(expect) == sorted(cold)
    _same(warm, expect)
    _same(cold, expect)
    assert json.loads((entry / "config.json").read_text()) == {"d": 5}
    assert entry.parent.parent == Path(os.environ["TL_STEERING_CACHE"])


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete_weights", "delete_manifest", "edit_aux",
                                    "bad_json", "foreign_key"])
def test_a_damaged_entry_is_deleted_and_rebuilt_never_used(source, damage):
    build = Builder()
    entry, _, _ = wc.cached_entry("tiny", source, torch.float32, build)
    weights, manifest = entry / wc.WEIGHTS_FILE, entry / wc.MANIFEST_FILE
    if damage == "flip_byte":
        data = bytearray(weights.read_bytes())
        data[-3] ^= 0x01  # inside the tensor data, same size: only the hash can tell
        weights.write_bytes(bytes(data))
    elif damage == "truncate":  # a partial copy
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "delete_weights":
        weights.unlink()
    elif damage == "delete_manifest":  # e.g. a directory copied by hand without its manifest
        manifest.unlink()
    elif damage == "edit_aux":
        (entry / "config.json").write_text(json.dumps({"d": 6}))
    elif damage == "bad_json":
        manifest.write_text("{not json")
    elif damage == "foreign_key":  # the manifest of another source
        m = json.loads(manifest.read_text())
        m["key"]["source_sha256"] = "0" * 64
        manifest.write_text(json.dumps(m))
    key = wc._key("tiny", wc.file_sha256(source), torch.float32)
    assert wc.read_entry(entry, key) is None
    assert not entry.exists(), "a bad entry is deleted on read"
    entry2, _, hit = wc.cached_entry("tiny", source, torch.float32, build)
    assert (entry2, hit, build.calls) == (entry, False, 2)
    _same(load_file(entry2 / wc.WEIGHTS_FILE), {k: v for k, v in _tensors().items() if k != "head.weight"})
    assert json.loads((entry / "config.json").read_text()) == {"d": 5}


def test_key_follows_source_content_dtype_and_format(source, monkeypatch):
    build = Builder()
    e1, _, _ = wc.cached_entry("tiny", source, torch.float32, build)
    e2, _, hit = wc.cached_entry("tiny", source, torch.bfloat16, build)
    assert e2 != e1 and not hit and "bfloat16" in e2.name
    source.write_bytes(b"another checkpoint")
    e3, _, hit = wc.cached_entry("tiny", source, torch.float32, build)
    assert e3 != e1 and not hit and build.calls == 3
    assert e3.name.split("-")[1] == wc.file_sha256(source)[:16]
    # extra key fields (the loader's transformers version): side by side, neither evicts the other
    e5, _, hit = wc.cached_entry("tiny", source, torch.float32, build, extra={"transformers": "4.0"})
    e6, _, hit6 = wc.cached_entry("tiny", source, torch.float32, build, extra={"transformers": "5.0"})
    assert len({e3, e5, e6}) == 3 and not hit and not hit6 and build.calls == 5
    assert [wc.cached_entry("tiny", source, torch.float32, build, extra=x)[2]
            for x in ({"transformers": "4.0"}, {"transformers": "5.0"}, None)] == [True, True, True]
    monkeypatch.setattr(wc, "CACHE_FORMAT", wc.CACHE_FORMAT + 1)
    e4, _, hit = wc.cached_entry("tiny", source, torch.float32, build)
    assert e4 != e3 and not hit and e4.name.endswith(f"-v{wc.CACHE_FORMAT}")


def test_writing_leaves_no_temporary_files(source):
    build = Builder()
    entry, _, _ = wc.cached_entry("tiny", source, torch.float32, build)
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]

    def failing(out: Path):
        (out / "half.safetensors").write_bytes(b"\0" * 100)
        raise RuntimeError("dequantization failed half way")

    with pytest.raises(RuntimeError, match="half way"):
        wc.cached_entry("other", source, torch.float32, failing)
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name], "a failed build leaves nothing"


def test_a_process_killed_mid_write_leaves_no_entry_and_its_temp_is_swept(source, tmp_path):
    """A real kill: a subprocess dies (os._exit, no cleanup) inside the build, after writing half a file."""
    module = Path(wc.__file__)
    script = textwrap.dedent(f"""
        import importlib.util, os, sys
        spec = importlib.util.spec_from_file_location("wc", {str(module)!r})
        wc = importlib.util.module_from_spec(spec); spec.loader.exec_module(wc)
        import torch
        def build(out):
            (out / "model.safetensors").write_bytes(b"partial" * 1000)
            os._exit(9)
        wc.cached_entry("tiny", {str(source)!r}, torch.float32, build)
    """)
    env = dict(os.environ, TL_STEERING_CACHE=os.environ["TL_STEERING_CACHE"])
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr[-2000:]
    entry = wc.entry_dir("tiny", wc.file_sha256(source), torch.float32)
    leftovers = [p.name for p in entry.parent.iterdir()]
    assert not entry.exists() and len(leftovers) == 1 and ".tmp-" in leftovers[0]
    # the next build (any entry in that directory) removes the dead process's temp directory
    build = Builder()
    entry2, _, hit = wc.cached_entry("tiny", source, torch.float32, build)
    assert (entry2, hit) == (entry, False)
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]
    # and a cache HIT sweeps too: a dead process's temp beside an entry that is already built
    stale = entry.parent / f"{entry.name}.tmp-{leftovers[0].split('.tmp-')[1]}"
    stale.mkdir()
    entry3, _, hit = wc.cached_entry("tiny", source, torch.float32, build)
    assert (entry3, hit) == (entry, True) and not stale.exists()


def test_an_entry_completed_by_another_process_meanwhile_is_kept(source):
    """Two processes miss at once: the second os.replace finds a complete entry and keeps it."""
    key_sha = wc.file_sha256(source)
    first = Builder()

    def racing(out: Path):
        wc.write_entry(wc.entry_dir("tiny", key_sha, torch.float32), wc._key("tiny", key_sha, torch.float32), first)
        return {"x": torch.zeros(2)}, {"revision": "loser"}

    entry, meta, hit = wc.cached_entry("tiny", source, torch.float32, racing)
    assert (meta, hit, first.calls) == ({"revision": "tiny-v0"}, False, 1)
    assert "x" not in load_file(entry / wc.WEIGHTS_FILE)
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("TL_STEERING_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert wc.cache_root() == tmp_path / "xdg" / "tl_steering"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert wc.cache_root() == tmp_path / "home" / ".cache" / "tl_steering"
    monkeypatch.setenv("TL_STEERING_CACHE", str(tmp_path / "mine"))
    assert wc.cache_root() == tmp_path / "mine"
