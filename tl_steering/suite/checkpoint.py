"""Checkpoints of a suite run (docs/suite.md, "Resuming"): what a run's numbers depend on and resuming from the
result so far (``SuiteResult.save`` after every stage: a kill never leaves half a file that loads)."""

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from torch import Tensor

from ..backends import weights_fingerprint
from ..errors import InputError
from .result import SuiteResult
from .settings import SuiteSettings


def run_key(model: Any, name: str, tokens: Tensor, settings: SuiteSettings, seed: int) -> dict[str, Any]:
    """What a run's numbers depend on (ranks must agree on it; a checkpoint must match it)."""
    return {"model": name, "weights": weights_fingerprint(model),
            "settings": hashlib.sha256(repr(settings).encode()).hexdigest()[:16], "seed": seed,
            "tokens": hashlib.sha256(tokens.cpu().numpy().tobytes()).hexdigest()[:16], "shape": list(tokens.shape)}


def resume(path: Path, key: dict[str, Any], fresh: SuiteResult, ran: list[str]) -> tuple[SuiteResult, set[str]]:
    """The checkpointed result and its finished stages, after checking it belongs to this run."""
    old = SuiteResult.load(path)
    theirs = old.provenance.extra.get("run_key", {})
    bad = sorted(k for k in key if theirs.get(k) != key[k])
    if bad:
        raise InputError(f"checkpoint {path} was written by another run: it differs in {', '.join(bad)} "
                         f"({'; '.join(f'{k}: {theirs.get(k)!r} there, {key[k]!r} here' for k in bad)}); "
                         "resume with the same model, tokens, settings and seed, or use a new checkpoint path")
    done = {name for name in old.timings if name in ran}
    # this run's identity (world size, environment, start) with the finished stages' fields and timings
    for f in dataclasses.fields(SuiteResult):
        if f.name in ("provenance", "environment", "distributed", "started", "arguments", "total_wall_s"):
            continue
        setattr(fresh, f.name, getattr(old, f.name))
    fresh.provenance.extra["resumed_stages"] = sorted(done, key=ran.index)
    return fresh, done


__all__ = ["resume", "run_key"]
