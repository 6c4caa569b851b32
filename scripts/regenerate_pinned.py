#!/usr/bin/env python
"""Recompute the pinned regression values of SmolLM2-135M or Gemma-3-270M and write tl_steering/reference/<file>.

    .venv-tl4/bin/python scripts/regenerate_pinned.py [--model smollm2-135m|gemma-3-270m] [--backend bridge|hooked]
                                                      [--check] [--against-backends]

Run it after an intended change of a definition, look at the diff of the JSON, and commit both together.
``--check`` compares instead of writing (exit 1 on a mismatch); ``--against-backends`` also compares with the
tighter cross-backend tolerances (BACKEND_TOLERANCES: rtol 1e-4 geometry, 1e-4 nats losses), e.g. a TL 3.9
HookedTransformer run against the file written from the TL 4.x bridge. The values come from
tl_steering.suite.numbers.compute_pinned (one run_suite with the model's settings, PINNED_MODELS: SmolLM2 4 pydoc
windows x 64 tokens, Gemma 2 x 64, seed 0; names -> SuiteResult fields in tl_steering.suite.numbers.PINNED);
tests/published/test_smollm2_pinned.py and test_gemma_pinned.py assert them on TL 4.x (bridge) and TL 3.9
(HookedTransformer).
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
from tl_steering.reference import pinned_values
from tl_steering.reference.pinned import (
    BACKEND_TOLERANCES,
    PINNED_MODELS,
    TOLERANCES,
    as_pinned,
    compare,
)
from tl_steering.suite.numbers import compute_pinned
from tl_steering.results import _encode

REFERENCE = Path(__file__).resolve().parent.parent / "tl_steering" / "reference"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", choices=sorted(PINNED_MODELS))
    p.add_argument("--backend", default="bridge", choices=["bridge", "hooked"])
    p.add_argument(
        "--check", action="store_true", help="compare with the committed file instead of writing it"
    )
    p.add_argument(
        "--against-backends", action="store_true",
        help="with --check: also compare with the cross-backend tolerances (rtol 1e-4 geometry, 1e-4 nats)",
    )
    args = p.parse_args()
    file_name, settings = PINNED_MODELS[args.model]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = ts.load_model(args.model, backend=args.backend, processing=settings["processing"])
    t_load = time.perf_counter() - t0
    measured = compute_pinned(model, settings=settings)
    seconds = time.perf_counter() - t0
    print(f"load {t_load:.0f} s, suite {seconds - t_load:.0f} s")
    if args.check:
        pinned = pinned_values(args.model)
        problems = compare(pinned, measured)
        print(
            "\n".join(problems) if problems else f"all {len(measured)} pinned values agree ({seconds:.0f} s)"
        )
        if args.against_backends:
            worse = compare(pinned, measured, tolerances=BACKEND_TOLERANCES)
            print("cross-backend tolerances:", "all agree" if not worse else "\n" + "\n".join(worse))
            problems += worse
        return 1 if problems else 0
    ad = adapt(model)
    doc = {
        "schema_version": 1,
        "model": args.model,
        "model_revision": ad.info.revision,
        "settings": settings,
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
        "values": as_pinned(measured)["values"],
    }
    out = REFERENCE / file_name
    out.write_text(json.dumps(_encode(doc), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    print(f"wrote {len(measured)} values to {out} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
