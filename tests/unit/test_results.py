"""The Result file format (tl_steering/results.py): NAME.json + NAME.safetensors, bit-identical round trips,
atomic writes, strict loading, kinds, added fields."""

import dataclasses
import json
import math
import os

import pytest
import torch

import tl_steering as ts
from tl_steering.backends import adapt
from tl_steering.errors import InputError, ResultFileError
from tl_steering.results import Provenance, Result, register


@register
@dataclasses.dataclass(kw_only=True)
class _Demo(Result):
    values: torch.Tensor
    spectrum: torch.Tensor
    labels: list[str]
    scalars: dict[str, float]


@register
@dataclasses.dataclass
class _Part:
    name: str
    weights: torch.Tensor


@register
@dataclasses.dataclass(kw_only=True)
class _Everything(Result):
    """Every kind of value a result holds, tensors of every dtype the protocols store among them."""

    tensors: dict[str, torch.Tensor]
    parts: list[_Part]
    numbers: list[float]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = torch.view_as_real(t.resolve_conj()) if t.is_complex() else t
    return t.contiguous().reshape(-1).view(torch.uint8)


def _identical(a, b) -> bool:
    """Bit for bit: tensors by dtype, shape and bytes (NaN payloads, -0.0), floats by repr."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bits(a), _bits(b)))
    if isinstance(a, float):
        return isinstance(b, float) and repr(a) == repr(b) and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_identical(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    return (type(a) is type(b) or isinstance(a, str) and isinstance(b, str)) and a == b  # torch.__version__: a str


def _everything() -> _Everything:
    g = torch.Generator().manual_seed(0)
    payload_nan = torch.tensor([0x7FF8_0000_DEAD_BEEF, -0x0008_0000_0000_0001], dtype=torch.int64).view(torch.float64)
    base = torch.randn(3, 4, generator=g, dtype=torch.float64)
    tensors = {
        "float64": torch.cat([payload_nan, torch.tensor([-0.0, math.inf, -math.inf, 5e-324, 0.1])]),
        "float32": torch.randn(2, 3, generator=g), "float16": torch.randn(4, generator=g).half(),
        "bfloat16": torch.randn(4, generator=g).bfloat16(),
        "complex128": torch.randn(3, generator=g, dtype=torch.complex128).conj(),  # a lazy conjugate view
        "complex64": torch.randn(2, 2, generator=g, dtype=torch.complex64),
        "int64": torch.tensor([-(2**63), 2**63 - 1]), "int32": torch.arange(5, dtype=torch.int32),
        "bool": torch.tensor([True, False, True]), "uint8": torch.tensor([0, 255], dtype=torch.uint8),
        "empty": torch.zeros(0, 3, dtype=torch.float64), "scalar": torch.tensor(2.5, dtype=torch.float64),
        "transposed": base.T, "view_of_base": base[1],  # non-contiguous; sharing storage with "transposed"
    }
    parts = [_Part("a", torch.randn(2, 2, generator=g, dtype=torch.float64)), _Part("b", base[:, 0])]
    return _Everything(tensors=tensors, parts=parts, numbers=[0.1, -0.0, math.nan, math.inf, 1e308],
                       provenance=Provenance(model="m", seed=3, extra={"layers": [1, 2], "eps": 1e-12}))


def test_save_load_is_bit_identical(tmp_path):
    """Every tensor (every dtype, NaN payloads, -0.0, views, conjugates, empty and 0-d ones, tensors of nested
    records) and every number comes back bit for bit, loaded by either file's name."""
    r = _everything()
    path = r.save(tmp_path / "r.json")
    assert path == tmp_path / "r.json" and sorted(os.listdir(tmp_path)) == ["r.json", "r.safetensors"]
    for name in ("r.json", "r.safetensors"):
        back = Result.load(tmp_path / name)
        assert _identical(r, back), name
    assert _identical(r, _Everything.load(r.save(tmp_path / "s.safetensors")))


def test_every_tensor_is_in_the_one_safetensors_file(tmp_path):
    """The JSON holds every field but no tensor data: each tensor, nested ones included, is a reference into
    NAME.safetensors, which holds exactly the result's tensors; the JSON names it with its SHA-256."""
    import hashlib

    from safetensors import safe_open

    r = _everything()
    r.save(tmp_path / "r.json")
    text = (tmp_path / "r.json").read_text()
    doc = json.loads(text)
    assert '"data"' not in text and '"__tensor__"' not in text
    assert doc["parts"][0]["weights"]["__tensor_ref__"] == "parts.0.weights"
    assert doc["__sidecar__"] == {"file": "r.safetensors",
                                  "sha256": hashlib.sha256((tmp_path / "r.safetensors").read_bytes()).hexdigest()}
    with safe_open(str(tmp_path / "r.safetensors"), framework="pt") as f:
        assert len(list(f.keys())) == len(r.tensors) + len(r.parts)
        assert f.metadata() == {"tl_steering_result": "r.json"}


def test_a_killed_save_leaves_no_pair_that_loads(tmp_path, monkeypatch):
    """A save writes each file under a temporary name and renames it, the tensors first. Killed while writing, the
    previous result still loads and no temporary file stays; killed between the two renames (new tensors beside
    the previous JSON), loading refuses the pair by its hash."""
    import tl_steering.results as results

    a, b = _everything(), _everything()
    b.numbers = [1.0]
    b.tensors["float32"] = b.tensors["float32"] + 1
    a.save(tmp_path / "r.json")

    monkeypatch.setattr(results.os, "fsync", lambda fd: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        b.save(tmp_path / "r.json")
    assert sorted(os.listdir(tmp_path)) == ["r.json", "r.safetensors"]  # the temporary file is gone
    assert _identical(a, Result.load(tmp_path / "r.json"))
    monkeypatch.undo()

    real = results._write
    monkeypatch.setattr(results, "_write", lambda path, data: real(path, data) if path.suffix == ".safetensors"
                        else (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        b.save(tmp_path / "r.json")
    for name in ("r.json", "r.safetensors"):
        with pytest.raises(ResultFileError, match=r"r\.safetensors is not the tensors file saved with r\.json "
                                                  r"\(SHA-256 differs\)"):
            Result.load(tmp_path / name)


def test_a_result_moves_as_a_pair(tmp_path):
    """Renamed together, the two files load; a JSON without its tensors file, or a tensors file without its JSON,
    is a clear error; a save to another kind of path is refused."""
    r = _everything()
    r.save(tmp_path / "r.json")
    for suffix in (".json", ".safetensors"):
        os.replace(tmp_path / f"r{suffix}", tmp_path / f"moved{suffix}")
    assert _identical(r, Result.load(tmp_path / "moved.json"))
    (tmp_path / "moved.safetensors").unlink()
    with pytest.raises(ResultFileError, match=r"moved\.json: its tensors file 'r\.safetensors' is not beside it"):
        Result.load(tmp_path / "moved.json")
    r.save(tmp_path / "alone.json")
    (tmp_path / "alone.json").unlink()
    with pytest.raises(ResultFileError, match=r"alone\.safetensors: it holds the tensors of a result whose fields "
                                              r"are in alone\.json"):
        Result.load(tmp_path / "alone.safetensors")
    with pytest.raises(InputError, match=r"NAME\.json .* NAME\.safetensors .* got '.*r\.pt'"):
        r.save(tmp_path / "r.pt")


def test_result_round_trip(tmp_path):
    r = _Demo(values=torch.tensor([1.0, float("nan"), 3.0], dtype=torch.float64),
              spectrum=torch.tensor([1 + 2j, -0.5j], dtype=torch.complex128),
              labels=["saddle", "attractor", "NaN", "-Infinity"], scalars={"a": 0.5, "inf": float("inf")},
              provenance=Provenance(model="x", seed=3, extra={"layers": [1, 2], "corpus": "Infinity"}))
    json.dumps(r.to_dict(), allow_nan=False)  # strict JSON
    back = _Demo.load(r.save(tmp_path / "r.json"))
    assert _identical(r, back)
    # strings that read like non-finite floats stay strings; non-finite floats stay floats
    assert back.labels[2:] == ["NaN", "-Infinity"] and back.provenance.extra["corpus"] == "Infinity"
    assert back.scalars["inf"] == float("inf")


# ----------------------------------------------------------------------------------------------------------
# strict loading: every failure names the file and the field


def _demo():
    return _Demo(values=torch.tensor([1.0, 2.0]), spectrum=torch.tensor([1j]), labels=["a"], scalars={"x": 1.0},
                 provenance=Provenance(model="m"))


def test_truncated_files_name_the_file(tmp_path):
    path = _demo().save(tmp_path / "cut.json")
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ResultFileError, match=r"cut\.json: not valid JSON .*truncated"):
        _Demo.load(path)
    st = _demo().save(tmp_path / "cut.safetensors")
    st.write_bytes(st.read_bytes()[:40])
    with pytest.raises(ResultFileError, match=r"cut\.safetensors: .*truncated or corrupted"):
        _Demo.load(st)
    with pytest.raises(ResultFileError, match=r"cut\.json: cut\.safetensors is not the tensors file saved with"):
        _Demo.load(tmp_path / "cut.json")


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.pop("labels"), r"missing field\(s\) \['labels'\]"),
    (lambda d: d["provenance"].pop("seed"), r"provenance: missing field\(s\) \['seed'\]"),
    (lambda d: d.__setitem__("bogus", 1), r"unknown field\(s\) \['bogus'\]"),
    (lambda d: d.__setitem__("labels", "saddle"), r"\.labels: expected list\[str\], got str"),
    (lambda d: d.__setitem__("labels", [1, 2]), r"\.labels: expected list\[str\]"),
    (lambda d: d.__setitem__("values", [1.0, 2.0]), r"\.values: expected .*got list"),
    (lambda d: d["provenance"].__setitem__("n_tokens", "many"), r"n_tokens: expected int, got str"),
    (lambda d: d.__setitem__("__kind__", "no_such_kind"), r"unknown result kind 'no_such_kind'"),
    (lambda d: d.__setitem__("__format__", 99), r"format version 99.*newer tl_steering"),
])
def test_bad_field_is_an_error_at_load(tmp_path, edit, match):
    d = _demo().to_dict()
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ResultFileError, match=r"bad\.json: .*" + match):
        _Demo.load(path)


def test_registry_keys_on_kind_and_refuses_duplicates():
    from tl_steering.results import _REGISTRY, kind_of

    deficit_cls = _REGISTRY["angular_deficit"]  # keyed by the class's explicit kind, not its name
    assert kind_of(deficit_cls) == "angular_deficit" and deficit_cls.__name__ != "angular_deficit"
    d = _demo().to_dict()
    assert d["__kind__"] == "_Demo" and d["__format__"] == 1 and d["provenance"]["__kind__"] == "provenance"

    with pytest.raises(TypeError, match="'angular_deficit' is already registered"):
        @register
        @dataclasses.dataclass(kw_only=True)
        class Impostor(Result):
            kind = "angular_deficit"
    assert _REGISTRY["angular_deficit"] is deficit_cls


@register
@dataclasses.dataclass(kw_only=True)
class _Grown(Result):
    """A result that gained ``note`` after its files were first written (``added_fields``)."""

    values: torch.Tensor
    note: str = "none"
    kind = "test_grown"
    added_fields = ("note",)


def test_a_field_added_later_loads_with_its_default_and_only_that_one(tmp_path):
    """A file written before a field was added (listed in ``added_fields``, with a default) loads with the
    default; a missing field that is not listed is still an incomplete file; ``register`` refuses an
    ``added_fields`` entry without a default."""
    d = _Grown(values=torch.tensor([1.0]), note="kept", provenance=Provenance(model="m")).to_dict()
    d.pop("note")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    assert _Grown.load(path).note == "none"
    d.pop("values")
    path.write_text(json.dumps(d))
    with pytest.raises(ResultFileError, match=r"missing field\(s\) \['values'\]"):
        _Grown.load(path)

    @dataclasses.dataclass(kw_only=True)
    class _Bad(Result):
        values: torch.Tensor
        kind = "test_bad_added"
        added_fields = ("values",)

    with pytest.raises(TypeError, match="not a field with a default"):
        register(_Bad)


def test_parallel_plan_saved_before_linear_refit_loads():
    """A ParallelPlan record without ``linears`` (files written before refit="linear") loads with no linear
    maps."""
    plan = ts.ParallelPlan(layers=[1], k=1, strategy="c", provenance=Provenance(model="m"))
    d = plan.to_dict()
    d.pop("linears")
    back = ts.ParallelPlan.from_dict(d)
    assert back.layers == [1] and back.linears.shape == (0, 0, 0)


def test_a_fresh_process_finds_every_kind(tmp_path):
    """A file names its kind; ``import tl_steering`` is lazy, so loading an unknown kind imports the package's
    modules: in a fresh process that registers every module with a ``@register`` class (no list to keep), and
    ``Result.load`` rebuilds a file of a kind not imported yet."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    pkg = Path(__file__).resolve().parents[2] / "tl_steering"
    registering = set()
    for path in pkg.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(d, ast.Name) and d.id == "register" for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
               for d in n.decorator_list):
            registering.add(".".join(path.relative_to(pkg.parent).with_suffix("").parts))
    assert len(registering) > 10
    plan = ts.ParallelPlan(layers=[1], k=1, strategy="c", gates=torch.tensor([0.5], dtype=torch.float64),
                           provenance=Provenance(model="m"))
    path = plan.save(tmp_path / "plan.json")
    code = ("import json, sys, tl_steering.results as r; x = r.Result.load(sys.argv[1]); "
            "print(type(x).__name__, x.gates.tolist()); r.import_result_modules(); "
            "print(json.dumps(sorted({c.__module__ for c in r._REGISTRY.values()})))")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True,
                          cwd=pkg.parent)
    first, found = done.stdout.splitlines()
    assert first == "ParallelPlan [0.5]"
    assert set(json.loads(found)) == registering


def test_every_result_prints_in_a_few_lines_without_tensor_contents(tiny, tiny_tokens):
    """print(result): kind, model, headline numbers, tensor shapes; never the tensors' values (a plan holding
    [d_model, d_model] maps printed thousands of characters)."""
    from tl_steering.results import _REGISTRY, import_result_modules

    import_result_modules()
    real = ts.angular_deficit(tiny, tiny_tokens, n_bootstrap=4)
    built = [real]
    if not adapt(tiny).is_parallel(0):  # NeoX blocks are parallel already: nothing to plan
        built.append(ts.plan_parallel(tiny, tiny_tokens, 1, strategy="C"))
    for cls in _REGISTRY.values():
        if isinstance(cls, type) and issubclass(cls, Result) and cls is not Result:
            try:
                built.append(cls())
            except Exception:  # noqa: BLE001 - kinds whose defaults do not make a valid instance
                continue
    assert len(built) > 10
    for r in built:
        text = repr(r)
        assert text == str(r)
        assert text.startswith(type(r).__name__ + "("), text
        assert len(text.splitlines()) <= 7 and len(text) <= 800, (type(r).__name__, text)
        assert "tensor(" not in text and "tensor([" not in text, text
    assert "deficit_mean=" in repr(real) and "deficit[" in repr(real)  # a headline number, a shape
    assert real.provenance.model in repr(real)
