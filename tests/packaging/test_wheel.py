"""The package as a user gets it: build the wheel, install it into a clean virtual environment through the
tutorials' own install cell, and use it from outside the checkout.

Steps (about 20 s on an idle 2-core machine; nothing is downloaded):

1. ``python -m build --wheel --no-isolation`` (``build`` and ``hatchling`` are test extras);
2. ``python -m venv --without-pip`` a clean environment whose only view of the outer one is a ``.pth`` line with
   the outer ``site-packages`` (so torch, TransformerLens and pip are not installed again; the outer editable
   install of the checkout is not active there: ``.pth`` files of a directory added that way are not processed);
3. run the first code cell of ``tutorials/01_quickstart.ipynb`` there with ``TL_STEERING_SOURCE=<the wheel>`` and
   ``PIP_NO_INDEX=1`` (pip resolves the wheel's dependencies against what is visible, never the network);
4. from a temporary working directory, a smoke script imports ``tl_steering`` (asserting it comes from the clean
   environment, not the checkout), finds every package data file of the checkout in the installed package
   (reference JSON, report CSS, ``py.typed``), runs the angular-deficit protocol on a tiny model, saves and reloads
   the result, and prints the per-layer deficit, which must equal the checkout's own to 1e-12.
"""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import tl_steering as ts

pytest.importorskip("build")
pytest.importorskip("hatchling")

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "tutorials" / "01_quickstart.ipynb"

SMOKE = r"""
import importlib.resources, json, os, sys
checkout, venv, data_files = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
import torch
import tl_steering as ts
here = os.path.realpath(ts.__file__)
assert here.startswith(os.path.realpath(venv) + os.sep), f"imported from {here}, not the clean venv {venv}"
assert not here.startswith(os.path.realpath(checkout) + os.sep), here
assert not any(os.path.realpath(p or ".") == os.path.realpath(checkout) for p in sys.path), sys.path
pkg = importlib.resources.files("tl_steering")
missing = [f for f in data_files if not pkg.joinpath(f).is_file()]
assert not missing, f"package data missing from the wheel: {missing}"
published = json.loads(pkg.joinpath("reference/published.json").read_text())
assert published, "published.json is empty"
model = ts.tiny_model("gpt2", backend="bridge", seed=0)
tokens = torch.randint(1, 257, (3, 16), generator=torch.Generator().manual_seed(0))
res = ts.angular_deficit(model, tokens, n_bootstrap=20, seed=0, corpus="random-ids")
res.save("deficit.json")
back = type(res).load("deficit.json")
print("SMOKE " + json.dumps({"deficit": back.deficit.tolist(), "file": here, "n_data": len(data_files)}))
"""


def _package_data_files() -> list[str]:
    """Every non-Python file of the package in the checkout (what the wheel must carry)."""
    pkg = ROOT / "tl_steering"
    return sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*")
                  if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts)


def _install_cell() -> str:
    nb = json.loads(TUTORIAL.read_text())
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    return "".join(cell["source"])


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> str:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    what = " ".join(map(str, cmd[:4]))
    assert p.returncode == 0, f"{what} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def test_wheel_installs_into_a_clean_venv_and_works_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1")

    # 1. the wheel
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(ROOT)], tmp_path,
         env)
    wheels = list(dist.glob("tl_steering-*.whl"))
    assert len(wheels) == 1, wheels

    # 2. a clean venv that sees the outer site-packages (dependencies) but not the checkout
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    py = venv / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path,
                        env).strip())
    (purelib / "_outer_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    absent = subprocess.run([str(py), "-c", "import tl_steering"], cwd=tmp_path, env=env, capture_output=True)
    assert absent.returncode != 0, "tl_steering is importable in the clean venv before installing: the test is void"

    # 3. the tutorials' install cell, pointed at the wheel
    cell = _install_cell()
    assert "TL_STEERING_SOURCE" in cell and '_pip("tl-steering")' not in cell
    _run([str(py), "-c", cell], tmp_path, dict(env, TL_STEERING_SOURCE=str(wheels[0])))
    assert (venv / "bin" / "tl-steering").exists(), "the console script was not installed"

    # 4. the smoke script from outside the checkout
    work = tmp_path / "work"
    work.mkdir()
    data_files = _package_data_files()
    assert {"reference/published.json", "reference/smollm2_pinned.json", "py.typed"} <= set(data_files)
    out = _run([str(py), "-c", SMOKE, str(ROOT), str(venv), json.dumps(data_files)], work, env)
    smoke = json.loads(next(l for l in out.splitlines() if l.startswith("SMOKE "))[6:])
    assert smoke["n_data"] == len(data_files)

    model = ts.tiny_model("gpt2", backend="bridge", seed=0)
    tokens = torch.randint(1, 257, (3, 16), generator=torch.Generator().manual_seed(0))
    ours = ts.angular_deficit(model, tokens, n_bootstrap=20, seed=0, corpus="random-ids").deficit
    theirs = torch.tensor(smoke["deficit"], dtype=ours.dtype)
    assert theirs.shape == ours.shape and torch.isfinite(theirs).all()
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-12)
