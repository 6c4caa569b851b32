"""What several benchmarks share: the model by name (an offline model, a TL name, or ``tiny-ARCH``) and the
calibration / held-out split of one set of pydoc windows (the planner's own: the first ceil(n/2) windows calibrate,
the rest are held out)."""

import argparse
import json
import sys
import time
import warnings
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


def start(ap: Any, argv: list[str] | None) -> tuple[Any, float, Any, Any, list[int]]:
    """Parse ``argv`` with ``ap`` (which has ``--model`` and ``--backend``), silence warnings, load the model:
    ``(args, t0, model, adapter, sequential layers)``; ``args.k`` (when the parser has ``--k``) defaults to half
    the sequential layers."""
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    t0 = time.time()
    model = bench_model(args.model, args.backend)
    ad = ts.adapt(model)
    cand = [lay for lay in ad.layers() if not ad.is_parallel(lay)]
    if getattr(args, "k", 0) is None:
        args.k = len(cand) // 2
    return args, t0, model, ad, cand


def plan_parser(doc: str | None) -> argparse.ArgumentParser:
    """The arguments every planning benchmark takes: --model, --backend, --k (default L // 2), --windows (pydoc
    windows, the first half calibrate), --length, --batch-size."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a load_model name, or tiny-gpt2 / tiny-llama")
    ap.add_argument("--backend", default="bridge")
    ap.add_argument("--k", type=int, default=None, help="layers to make parallel (default L // 2)")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    return ap
