"""Safety: no pickle of untrusted data, no remote code, results as JSON/safetensors only."""

import ast
import re
from pathlib import Path

import tl_steering

PKG = Path(tl_steering.__file__).parent
SOURCES = sorted(PKG.rglob("*.py"))


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def test_sources_found():
    assert len(SOURCES) >= 10, SOURCES


def test_no_pickle_anywhere():
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n and n.split(".")[0] in ("pickle", "dill", "cloudpickle", "joblib") for n in names), path


def test_torch_load_only_with_weights_only():
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for call in _calls(tree):
            f = call.func
            if isinstance(f, ast.Attribute) and f.attr == "load" and getattr(f.value, "id", None) == "torch":
                kw = {k.arg: k.value for k in call.keywords}
                assert "weights_only" in kw and getattr(kw["weights_only"], "value", None) is True, \
                    f"{path}:{call.lineno} torch.load without weights_only=True"


def test_never_trust_remote_code():
    for path in SOURCES:
        text = path.read_text()
        for m in re.finditer(r"trust_remote_code\s*=\s*(\w+)", text):
            assert m.group(1) == "False", f"{path}: trust_remote_code={m.group(1)}"


def test_results_never_pickled(tmp_path):
    import torch

    from tl_steering.results import Provenance, Result

    r = Result(provenance=Provenance(model="<script>alert(1)</script>"))
    p = r.save(tmp_path / "r.json")
    assert p.read_bytes().startswith(b"{")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "r.safetensors"), framework="pt") as f:  # its tensors: no code in either file
        assert f.metadata() == {"tl_steering_result": "r.json"}
    assert Result.load(p).provenance.model == "<script>alert(1)</script>"
    del torch
