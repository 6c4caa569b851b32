"""The main job: run the protocols on a model and write a report (minimal end-to-end version; the full
report with every protocol and figures lands with the report issue)."""

import html
import json
import time
from pathlib import Path

from .adapter import adapt
from .data import text_tokens
from .loading import load_model


def run_report(model: str = "smollm2-135m", backend: str = "bridge", text: str = "pydoc", windows: int | None = None,
               length: int | None = None, out: str = "report", device: str | None = None, seed: int = 0,
               quick: bool = False) -> Path:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    m = load_model(model, backend=backend, device=device)
    windows = windows or (4 if quick else 8)
    length = length or (64 if quick else 128)
    tokens = text_tokens(m, source=text, n_windows=windows, length=length, seed=seed)
    ad = adapt(m)
    loss = float(ad.loss_per_token(tokens).mean())
    _, cache = ad.run_with_cache(tokens[:1], ad.identity_names())
    identity = max(ad.check_residual_identity(cache).values())
    prov = ad.provenance(tokens, seed=seed)
    results = {"provenance": prov.__dict__, "clean_loss": loss, "max_identity_error": identity,
               "seconds": time.perf_counter() - t0}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in results.items())
    (out_dir / "index.html").write_text(f"<!doctype html><meta charset='utf-8'><title>tl_steering report</title>"
                                        f"<h1>tl_steering report</h1><table>{rows}</table>")
    return out_dir / "index.html"
