#!/usr/bin/env python
"""Diff two report results.json files numerically (timings aside), field by field.

    .venv-tl4/bin/python scripts/compare_results.py BEFORE/results.json AFTER/results.json [--rtol 1e-6] [--atol 1e-9]

Reads both the old report format (``tl_steering.report`` v1: ``results``/``plan``/``parallel_executor``/...) and
a saved :class:`~tl_steering.suite.SuiteResult` (the report's results.json since the suite runner), maps both to
the SuiteResult's field names, flattens every number (tensors element by element), and prints per top-level field:
how many leaves are equal, within tolerance, different, only in one file; then the differing leaves (at most
``--show`` per field). Timing-derived leaves (wall/CPU seconds, sub-module times, speedups, timestamps) are skipped.
Exit status 1 when a compared number differs beyond the tolerance.
"""

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

TIMING = re.compile(
    r"(seconds|wall_s|cpu_s|(^|\.)t_(attn|ffn|other)|T_(seq|par|other)_s|t_forward|speedup|created|started|"
    r"timings|timing_\w+_s|total_wall_s|torch_threads|(^|\.)command$|(^|\.)out$|timing_device|label$)"
)

OLD_RESULTS = {
    "deficit",
    "ablation",
    "diversity",
    "defect",
    "gates",
    "critical",
    "critical_fixed_point",
    "prefix",
}


def _normalise_old(doc: dict[str, Any]) -> dict[str, Any]:
    out = {k: doc["results"][k] for k in OLD_RESULTS if k in doc["results"]}
    out["checks"] = {
        "clean_loss": doc["clean_loss"],
        "max_residual_identity_error": doc["max_residual_identity_error"],
    }
    out["plan"] = doc["plan"]
    out["speedup"] = doc["speedup_estimate"]
    out["executor"] = doc["parallel_executor"]
    out["settings"] = doc["settings"]
    out["headline"] = doc["headline"]
    out["comparison"] = {
        r["id"]: {"ours": r["ours"], "relation": r["relation"], "verdict": r.get("in_paper_band")}
        for r in doc["comparison"]
    }
    out["model"] = doc["model"]
    out["provenance"] = doc["provenance"]
    return out


def _normalise_new(path: Path) -> dict[str, Any]:
    from tl_steering.results import _encode
    from tl_steering.report.comparison import comparison_rows
    from tl_steering.suite import SuiteResult

    suite = SuiteResult.load(path)
    out = {k: v for k, v in suite.to_dict().items() if not k.startswith("__")}
    out["headline"] = _encode(suite.summary())
    out["comparison"] = {
        r["id"]: {"ours": _encode(r["ours"]), "relation": r["relation"], "verdict": r["verdict"].verdict}
        for r in comparison_rows(suite)
    }
    return out


def load(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    if doc.get("format") == "tl_steering.report" and doc.get("format_version") == 1:
        return _normalise_old(doc)
    return _normalise_new(path)


def flatten(node: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(node, dict):
        if node.get("__tensor__"):
            flatten(node["data"], prefix, out)
            return
        for k, v in node.items():
            if k in ("__dataclass__", "__kind__", "__format__"):
                continue
            flatten(v, f"{prefix}.{k}" if prefix else k, out)
    elif isinstance(node, list):
        if not node:
            out[prefix] = "[]"
        for i, v in enumerate(node):
            flatten(v, f"{prefix}[{i}]", out)
    else:
        if isinstance(node, str) and node in ("NaN", "Infinity", "-Infinity"):
            node = float(node.replace("Infinity", "inf"))
        out[prefix] = node


def same(a: Any, b: Any, rtol: float, atol: float) -> str:
    """'equal', 'close' or 'differ'."""
    if (
        isinstance(a, bool)
        or isinstance(b, bool)
        or not isinstance(a, (int, float))
        or not isinstance(b, (int, float))
    ):
        return "equal" if a == b else "differ"
    if a == b or (math.isnan(a) and math.isnan(b)):
        return "equal"
    return "close" if abs(a - b) <= atol + rtol * abs(b) else "differ"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--rtol", type=float, default=1e-6)
    p.add_argument("--atol", type=float, default=1e-9)
    p.add_argument("--show", type=int, default=8, help="differing leaves shown per field")
    args = p.parse_args()
    fa, fb = {}, {}
    flatten(load(args.before), "", fa)
    flatten(load(args.after), "", fb)
    stats: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    diffs: dict[str, list[str]] = defaultdict(list)
    for key in sorted(set(fa) | set(fb)):
        top = key.split(".")[0].split("[")[0]
        if TIMING.search(key):
            stats[top]["timing (skipped)"] += 1
            continue
        if key not in fb:
            stats[top]["only before"] += 1
            diffs[top].append(f"only before: {key} = {fa[key]!r}"[:200])
            continue
        if key not in fa:
            stats[top]["only after"] += 1
            diffs[top].append(f"only after:  {key} = {fb[key]!r}"[:200])
            continue
        verdict = same(fa[key], fb[key], args.rtol, args.atol)
        stats[top][verdict] += 1
        if verdict == "differ":
            a, b = fa[key], fb[key]
            d = (
                f" (|diff| {abs(a - b):.3g})"
                if isinstance(a, (int, float)) and isinstance(b, (int, float))
                else ""
            )
            diffs[top].append(f"differ:      {key}: {a!r} -> {b!r}{d}"[:240])
    bad = 0
    print(f"{'field':<22} {'equal':>7} {'close':>6} {'differ':>7} {'only<':>6} {'only>':>6} {'timing':>7}")
    for top in sorted(stats):
        s = stats[top]
        bad += s["differ"]
        print(
            f"{top:<22} {s['equal']:>7} {s['close']:>6} {s['differ']:>7} {s['only before']:>6} "
            f"{s['only after']:>6} {s['timing (skipped)']:>7}"
        )
    for top in sorted(diffs):
        print(f"\n[{top}] {len(diffs[top])} leaves")
        for line in diffs[top][: args.show]:
            print("  " + line)
        if len(diffs[top]) > args.show:
            print(f"  ... {len(diffs[top]) - args.show} more")
    print(f"\n{bad} compared numbers differ beyond rtol={args.rtol:g}, atol={args.atol:g} (timings skipped)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
