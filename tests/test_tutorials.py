"""The tutorial notebooks run, on small settings, and are committed with their outputs cleared.

Executed with nbclient in ONE kernel of the current interpreter (``kernel_name="python3"``: jupyter_client starts
``sys.executable -m ipykernel_launcher``), so the SmolLM2 weights are dequantized once for the four notebooks;
each notebook starts from an empty namespace (``%reset -f``). Environment: ``TL_STEERING_TUTORIAL_SMALL=1`` and
``TL_STEERING_TUTORIAL_MODEL=smollm2-135m`` (offline, deterministic; set the latter yourself to try GPT-2).
Each notebook's last cell asserts real numbers and built figures.

The notebooks are executed on the TransformerLens 4.x line only: they target what Colab installs today (the
newest TransformerLens, TransformerBridge), their code has no backend branch of its own, and every function they
call is covered on TL 3.9 by the unit and integration tiers. Running them again on 3.9 cost 150-200 s of the
suite's 20-minute budget for no new coverage; the checks on the committed files below run on both lines.
"""

import os
import time
from pathlib import Path

import pytest

from tl_steering.backends import tl_version

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

pytestmark = pytest.mark.integration

TUTORIALS = Path(__file__).resolve().parent.parent / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))
EXPECTED = [
    "01_quickstart",
    "02_compose_with_transformerlens",
    "03_critical_points",
    "04_parallel_plan_and_speedup",
]
TIMEOUT_PER_CELL = 600
TL_MAJOR = int(tl_version().split(".")[0])


def test_the_four_tutorials_exist():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_with_outputs_cleared(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: clear the outputs"
    first = nb.cells[1 if nb.cells[0].cell_type == "markdown" else 0]
    # the first code cell installs the package from a source the user can reach (it is not on PyPI: a
    # `pip install tl-steering` would install nothing of ours); tests/packaging/test_wheel.py runs this cell
    assert "_pip(source)" in first.source
    assert 'TL_STEERING_SOURCE = os.environ.get("TL_STEERING_SOURCE"' in first.source
    assert '_pip("tl-steering")' not in first.source and "pip install tl-steering" not in first.source
    assert "assert" in nb.cells[-1].source, "the last cell asserts something real"


@pytest.fixture(scope="module")
def kernel():
    """One kernel for every notebook of the module (the current interpreter), with small settings."""
    from jupyter_client.manager import KernelManager

    env = dict(os.environ)
    env["TL_STEERING_TUTORIAL_SMALL"] = "1"
    env.setdefault("TL_STEERING_TUTORIAL_MODEL", "smollm2-135m")
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=env, cwd=str(TUTORIALS))
    try:
        yield km
    finally:
        km.shutdown_kernel(now=True)


@pytest.mark.skipif(TL_MAJOR < 4, reason="notebooks are executed on the TransformerLens 4.x line only (what Colab "
                    "installs); this line checks the committed files, and its API is covered by unit/integration")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, kernel):
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell("get_ipython().run_line_magic('reset', '-f')"))
    client = nbclient.NotebookClient(
        nb,
        km=kernel,
        timeout=TIMEOUT_PER_CELL,
        allow_errors=False,
        resources={"metadata": {"path": str(TUTORIALS)}},
    )
    t0 = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - t0
    last = nb.cells[-1]
    text = "".join(o.get("text", "") for o in last.outputs if o.get("output_type") == "stream")
    assert "ok" in text, f"{path.name}: the last cell did not print ok ({text!r})"
    print(f"{path.stem}: {seconds:.1f} s")
