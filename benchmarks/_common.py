"""What several benchmarks share: the model by name (an offline model, a TL name, or ``tiny-ARCH``) and the
calibration / held-out split of one set of pydoc windows (the planner's own: the first ceil(n/2) windows calibrate,
the rest are held out)."""

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tl_steering as ts  # noqa: E402


def bench_model(name: str, backend: str, **tiny_sizes: int) -> Any:
    """``tiny-ARCH`` (a random test model, ``n_layers=8`` unless ``tiny_sizes`` say otherwise) or
    :func:`tl_steering.load_model`'s names."""
    if name.startswith("tiny-"):
        return ts.tiny_model(name.removeprefix("tiny-"), backend=backend, **{"n_layers": 8, **tiny_sizes})
    return ts.load_model(name, backend=backend)


def cal_held(model: Any, windows: int, length: int, seed: int = 0) -> tuple[Any, Any]:
    """``windows`` pydoc windows of ``length`` tokens split into (calibration, held out)."""
    toks = ts.text_tokens(model, n_windows=windows, length=length, seed=seed)
    half = windows - windows // 2
    return toks[:half], toks[half:]


def finish(out: dict, json_path: str | None, t0: float) -> dict:
    """Write ``out`` to ``json_path`` (when given), print the total seconds since ``t0``, return ``out``."""
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))
    print(f"# total {time.time() - t0:.0f}s", flush=True)
    return out
