#!/usr/bin/env python
"""Recompute the pinned SmolLM2-135M regression values and write tl_steering/reference/smollm2_pinned.json.

    .venv-tl4/bin/python scripts/regenerate_pinned.py [--backend bridge|hooked] [--check]

Run it after an intended change of a definition, look at the diff of the JSON, and commit both together.
``--check`` compares instead of writing (exit 1 on a mismatch). The values come from
tl_steering.reference.pinned.compute_pinned (one run_suite with its PINNED_SETTINGS: 4 pydoc windows x 64 tokens,
seed 0; names -> SuiteResult fields in tl_steering.suite.numbers.PINNED);
tests/published/test_smollm2_pinned.py asserts them on TL 4.x (bridge) and TL 3.9 (HookedTransformer).
"""

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch

import tl_steering as ts
from tl_steering.backends import adapt, tl_version
from tl_steering.reference import PINNED_FILE, pinned_values
from tl_steering.reference.pinned import PINNED_SETTINGS, TOLERANCES, compare, compute_pinned
from tl_steering.results import _encode

OUT = Path(__file__).resolve().parent.parent / "tl_steering" / "reference" / PINNED_FILE


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="bridge", choices=["bridge", "hooked"])
    p.add_argument(
        "--check", action="store_true", help="compare with the committed file instead of writing it"
    )
    args = p.parse_args()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = ts.load_model("smollm2-135m", backend=args.backend, processing=PINNED_SETTINGS["processing"])
    measured = compute_pinned(model)
    seconds = time.perf_counter() - t0
    if args.check:
        problems = compare(pinned_values(), measured)
        print(
            "\n".join(problems) if problems else f"all {len(measured)} pinned values agree ({seconds:.0f} s)"
        )
        return 1 if problems else 0
    ad = adapt(model)
    doc = {
        "schema_version": 1,
        "model": "smollm2-135m",
        "model_revision": ad.info.revision,
        "settings": PINNED_SETTINGS,
        "generated": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "generated_with": {
            "tl_steering": ts.__version__,
            "transformer_lens": tl_version(),
            "backend": ad.backend,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "script": "scripts/regenerate_pinned.py",
            "seconds": round(seconds, 1),
        },
        "tolerances": TOLERANCES,
        "values": {name: {"value": value, "tol": group} for name, (value, group) in measured.items()},
    }
    OUT.write_text(json.dumps(_encode(doc), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    print(f"wrote {len(measured)} values to {OUT} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
