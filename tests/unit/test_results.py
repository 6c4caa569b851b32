"""The Result serialisation round-trip (tl_steering/results.py): strict loading, kinds, added fields."""

import dataclasses
import json

import pytest
import torch

import tl_steering as ts
from tl_steering.backends import adapt
from tl_steering.results import Provenance, Result, register


@register
@dataclasses.dataclass(kw_only=True)
class _Demo(Result):
    values: torch.Tensor
    spectrum: torch.Tensor
    labels: list[str]
    scalars: dict[str, float]


def test_result_round_trip(tmp_path):
    r = _Demo(values=torch.tensor([1.0, float("nan"), 3.0], dtype=torch.float64),
              spectrum=torch.tensor([1 + 2j, -0.5j], dtype=torch.complex128),
              labels=["saddle", "attractor"], scalars={"a": 0.5, "inf": float("inf")},
              provenance=Provenance(model="x", seed=3, extra={"layers": [1, 2]}))
    d = r.to_dict()
    json.dumps(d, allow_nan=False)  # strict JSON
    for suffix in (".json", ".safetensors"):
        path = r.save(tmp_path / f"r{suffix}")
        back = _Demo.load(path)
        assert torch.equal(back.values.nan_to_num(7.0), r.values.nan_to_num(7.0))
        assert back.values.dtype == torch.float64
        assert torch.equal(back.spectrum, r.spectrum)
        assert back.labels == r.labels and back.scalars["inf"] == float("inf")
        assert back.provenance.seed == 3 and back.provenance.extra == {"layers": [1, 2]}


# ----------------------------------------------------------------------------------------------------------
# strict loading: every failure names the file and the field


def _demo():
    return _Demo(values=torch.tensor([1.0, 2.0]), spectrum=torch.tensor([1j]), labels=["a"], scalars={"x": 1.0},
                 provenance=Provenance(model="m"))


def test_truncated_json_names_the_file(tmp_path):
    from tl_steering.errors import ResultFileError

    path = _demo().save(tmp_path / "cut.json")
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ResultFileError, match=r"cut\.json: not valid JSON .*truncated"):
        _Demo.load(path)
    st = _demo().save(tmp_path / "cut.safetensors")
    st.write_bytes(st.read_bytes()[:40])
    with pytest.raises(ResultFileError, match=r"cut\.safetensors: .*truncated or corrupted"):
        _Demo.load(st)


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
    from tl_steering.errors import ResultFileError

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
    from tl_steering.errors import ResultFileError

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


def test_result_modules_name_every_module_that_registers_a_result():
    """A saved file names its kind; loading imports RESULT_MODULES to find it, so each module with a
    ``@register`` class must be listed (else a file of that kind fails to load in a fresh process)."""
    import ast
    from pathlib import Path

    from tl_steering.results import RESULT_MODULES

    pkg = Path(__file__).resolve().parents[2] / "tl_steering"
    registering = set()
    for path in pkg.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(d, ast.Name) and d.id == "register" for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
               for d in n.decorator_list):
            registering.add(".".join(path.relative_to(pkg.parent).with_suffix("").parts))
    assert registering - {"tl_steering.results"} == set(RESULT_MODULES)


def test_every_result_prints_in_a_few_lines_without_tensor_contents(tiny, tiny_tokens):
    """print(result): kind, model, headline numbers, tensor shapes; never the tensors' values (a plan holding
    [d_model, d_model] maps printed thousands of characters)."""
    from tl_steering.results import _REGISTRY, _import_result_modules

    _import_result_modules()
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
