"""Corpus-scale probe scans: data parallel on ``torch.distributed``, resumable after a kill (docs/scale_out.md)."""

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..backends import adapt, weights_fingerprint
from ..data.corpus import CorpusSpec, iter_window_rows, parse_source
from ..errors import InputError
from ..validation import as_int
from .result import ProbeResult
from .trace import probe
from ..data.sharding import World, check_agreement, gather_objects, rank_device, world
from ..backends.ownership import exclusive

FORMAT = 1

__all__ = ["World", "check_agreement", "init_from_env", "main", "scan", "world"]


def init_from_env(device: str | None = None) -> bool:
    """Initialize the default process group from torchrun's environment (``WORLD_SIZE`` > 1): gloo on CPU, NCCL
    on ``cuda:LOCAL_RANK``. True when it created the group (the caller destroys it)."""
    dist = torch.distributed
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or (dist.is_available() and dist.is_initialized()):
        return False
    if not dist.is_available():
        raise InputError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    cuda = device is not None and str(device).startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    return True


def _digest(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


@exclusive
def scan(model: Any, source: str | CorpusSpec = "pydoc", *, n_windows: int, length: int = 128,
         metrics: Sequence[str] | str | None = None, layers: Sequence[int] | int | None = None,
         exclude_positions: Sequence[int] = (0,), shard_windows: int = 64, batch_size: int = 8,
         out_dir: str | Path | None = None, resume: bool = False, progress: bool = False) -> ProbeResult:
    """Probe ``n_windows`` windows of ``length`` tokens of a streamed corpus over the ranks of the process group, in
    shards of ``shard_windows`` windows, written to ``out_dir`` and resumable there (``resume``); the merged
    :class:`ProbeResult` on every rank (docs/scale_out.md, "Probe scans on N processes")."""
    for name, v, lo in (("n_windows", n_windows, 1), ("length", length, 2), ("shard_windows", shard_windows, 1),
                        ("batch_size", batch_size, 1)):
        as_int(v, name, minimum=lo, where="scan")
    if resume and out_dir is None:
        raise InputError("scan: resume=True needs out_dir (where the finished shards are)")
    ad = adapt(model)
    spec = source if isinstance(source, CorpusSpec) else parse_source(source)
    w = world()
    info = ad.info
    settings = {
        "format": FORMAT, "model": info.name, "revision": info.revision, "weights": weights_fingerprint(model),
        "processing": info.processing, "source": dataclasses.asdict(spec), "n_windows": n_windows,
        "length": length, "metrics": metrics if isinstance(metrics, (str, type(None))) else list(metrics),
        "layers": layers if isinstance(layers, (int, type(None))) else list(layers),
        "exclude_positions": list(exclude_positions), "shard_windows": shard_windows}
    check_agreement(settings, w)
    n_shards = -(-n_windows // shard_windows)
    mine = [j for j in range(n_shards) if j % w.size == w.rank]
    shard_dir = None
    done: set[int] = set()
    if out_dir is not None:
        shard_dir = _prepare_out(Path(out_dir), settings, n_shards, resume, w)
        if resume:
            done = {j for j in mine if (shard_dir / f"shard-{j:06d}.json").exists()}  # written last
            metrics = _resumed_metrics(metrics, shard_dir)
    todo = [j for j in mine if j not in done]
    probe_kw = {"metrics": metrics, "layers": layers, "exclude_positions": exclude_positions}
    results = _run_shards(ad, spec, todo, probe_kw, n_windows=n_windows, length=length, shard_windows=shard_windows,
                          batch_size=batch_size, shard_dir=shard_dir, progress=progress and w.rank == 0)
    for j in sorted(done):
        results[j] = ProbeResult.load(shard_dir / f"shard-{j:06d}.json")
    total = _merge_shards(results, n_shards, w)
    prov = dataclasses.replace(total.provenance, corpus=f"{spec.label}:{n_windows}x{length}", world_size=w.size,
                               extra={**total.provenance.extra, "scan": {"shard_windows": shard_windows,
                                                                        "n_shards": n_shards,
                                                                        "dist_backend": w.backend,
                                                                        "resumed_shards": len(done)}})
    total = dataclasses.replace(total, provenance=prov)
    if out_dir is not None and w.rank == 0:
        total.save(Path(out_dir) / "result.json")
    return total


def _prepare_out(out: Path, settings: dict[str, Any], n_shards: int, resume: bool, w: World) -> Path:
    """Rank 0 checks ``out/scan.json`` against ``settings`` (a resumed scan must match) and (re)writes it; every
    rank waits for it and gets the shard directory."""
    shard_dir = out / "shards"
    manifest = out / "scan.json"
    if w.rank == 0:
        if manifest.exists() and not resume:
            raise InputError(f"{out} already holds a scan; pass resume=True (--resume) to continue it, or "
                             "choose another output directory")
        if manifest.exists():
            old = json.loads(manifest.read_text())
            if old.get("digest") != _digest(settings):
                diff = sorted(k for k in settings if old.get("settings", {}).get(k) != settings[k])
                raise InputError(f"{manifest} was written with other settings (differs in: {', '.join(diff)});"
                                 " resume needs the same model, corpus and settings")
        shard_dir.mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps({"digest": _digest(settings), "settings": settings,
                                        "n_shards": n_shards}, indent=1, default=str))
    if w.active:
        torch.distributed.barrier()
    return shard_dir


def _run_shards(ad: Any, spec: CorpusSpec, todo: list[int], probe_kw: dict[str, Any], *, n_windows: int,
                length: int, shard_windows: int, batch_size: int, shard_dir: Path | None,
                progress: bool) -> dict[int, ProbeResult]:
    """Probe the shards ``todo`` of the corpus stream (saving each to ``shard_dir``, atomically, when given)."""
    results: dict[int, ProbeResult] = {}
    if not todo:
        return results
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo) * shard_windows * length, unit="tok", unit_scale=True, desc="scan")

    def finish(j: int, batch_rows: list[list[int]]) -> None:
        t0 = time.perf_counter()
        with probe(ad.model, corpus=f"{spec.label}:shard{j}", **probe_kw) as trace, torch.no_grad():
            for i in range(0, len(batch_rows), batch_size):
                t = torch.tensor(batch_rows[i:i + batch_size], dtype=torch.long, device=ad.device)
                ad.model(t, return_type=None)
        res = trace.result()
        if shard_dir is not None:
            res.save(shard_dir / f"shard-{j:06d}.json")  # atomic: no half shard
        results[j] = res
        if bar is not None:
            bar.update(len(batch_rows) * length)
            bar.set_postfix(tok_per_s=f"{len(batch_rows) * length / max(time.perf_counter() - t0, 1e-9):.0f}")

    wanted = set(todo)
    rows: list[list[int]] = []
    current = None
    for i, row in iter_window_rows(ad.model, spec, length):
        if i >= n_windows:
            break
        j = i // shard_windows
        if j not in wanted:
            continue
        if current is not None and j != current:
            finish(current, rows)
            rows = []
        current = j
        rows.append(row)
    if current is not None and rows:
        finish(current, rows)
    if bar is not None:
        bar.close()
    missing = wanted - set(results)
    if missing:
        raise InputError(f"the corpus {spec.label} ended before window {min(missing) * shard_windows}: it "
                         f"holds fewer than n_windows={n_windows} windows of {length} tokens")
    return results


def _merge_shards(results: dict[int, ProbeResult], n_shards: int, w: World) -> ProbeResult:
    """Gather every rank's shard sums and add them in shard order (the same order on every rank)."""
    merged_parts: dict[int, Any] = {}
    for part in gather_objects({j: r.to_dict() for j, r in results.items()}, w):
        merged_parts.update(part)
    total = None
    for j in range(n_shards):
        r = results[j] if j in results else ProbeResult.from_dict(merged_parts[j])
        total = r if total is None else total.merge(r)
    assert total is not None
    return total


def _resumed_metrics(metrics: Sequence[str] | str | None, shard_dir: Path) -> Sequence[str] | str | None:
    """The metrics the remaining shards measure on resume, so that the shards always merge (docs/scale_out.md)."""
    first = next(iter(sorted(shard_dir.glob("shard-*.json"))), None)
    if first is None:
        return metrics
    have = ProbeResult.load(first).metrics
    asked = [metrics] if isinstance(metrics, str) else metrics
    if asked is None or set(asked) <= set(have):
        return list(have)
    return metrics


def load_named(name: str, backend: str, device: str | None) -> Any:
    """A model by name for the command line: ``tiny-ARCH`` (a random test model) or :func:`load_model`'s names."""
    from .. import backends

    if name.startswith("tiny-"):
        return backends.tiny_model(name.removeprefix("tiny-"), backend=backend)  # type: ignore[arg-type]
    return backends.load_model(name, backend=backend, device=device)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    """``python -m tl_steering.probing.scan`` / ``torchrun ... -m tl_steering.probing.scan``: a resumable probe scan."""
    p = argparse.ArgumentParser(prog="tl-steering scan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, gemma-3-270m, tiny-gpt2, or a TL name")
    p.add_argument("--backend", default="bridge", choices=["bridge", "hooked"])
    p.add_argument("--source", default="pydoc", help="pydoc, a text file, a directory, jsonl:PATH[:FIELD], hf:...")
    p.add_argument("--windows", type=int, required=True)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--metrics", default=None, help="comma-separated probe metrics (default: all)")
    p.add_argument("--shard-windows", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        spec = parse_source(args.source)  # fail fast, before any model loads
        created = init_from_env(args.device)
        rank = world().rank
        try:
            device = rank_device(args.device)
            model = load_named(args.model, args.backend, device)
            metrics = args.metrics.split(",") if args.metrics else None
            res = scan(model, spec, n_windows=args.windows, length=args.length, metrics=metrics,
                       shard_windows=args.shard_windows, batch_size=args.batch_size, out_dir=args.out,
                       resume=args.resume, progress=not args.no_progress)
        finally:
            if created:
                torch.distributed.destroy_process_group()
    except InputError as e:
        print(f"tl-steering scan: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if rank == 0:
        print(json.dumps({"out": str(Path(args.out) / "result.json"), "n_tokens": res.n_tokens,
                          "world_size": res.provenance.world_size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

