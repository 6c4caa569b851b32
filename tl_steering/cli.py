"""Command line: ``tl-steering report ...``, ``render ...`` and ``scan ...`` (also ``python -m tl_steering``;
``torchrun ... -m tl_steering scan ...`` runs a scan on N processes). See docs/suite.md, "The report", and
docs/scale_out.md."""

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any, NoReturn

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (no usage dump) with exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tl-steering", description="Feed-forward steering diagnostics (arXiv:2608.02071)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    r = sub.add_parser("report", help="run every protocol and write an HTML report")
    r.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (offline), gemma-3-270m, a TL model name, or tiny-ARCH (a random test model)")
    r.add_argument("--backend", default="bridge", choices=["bridge", "hooked"])
    r.add_argument("--text", default="pydoc", help="'pydoc' (offline), a text file, or hf:NAME[:CONFIG]:SPLIT")
    r.add_argument("--windows", type=int, default=None, help="number of token windows (default 8, --quick 4)")
    r.add_argument("--length", type=int, default=None, help="tokens per window (default 128, --quick 64)")
    r.add_argument("--batch-size", type=int, default=None,
                   help="windows per forward (default 8); under torchrun each rank runs every world-size-th batch")
    r.add_argument("--out", default="report", help="output directory")
    r.add_argument("--resume", action="store_true",
                   help="continue a killed run in --out: its finished stages (out/checkpoint.json) are not run again")
    r.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ...")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--quick", action="store_true", help="small settings (about 2 minutes on 2 CPU cores)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    r.add_argument("--nprocs", default="auto", help="local gloo ranks the stages split over; auto: 2 for "
                   "the offline models on a CPU with 2+ cores for torch, else 1 (docs/scale_out.md)")
    sub.add_parser("scan", add_help=False,
                   help="resumable probe scan of a streamed corpus, data parallel under torchrun "
                        "(tl-steering scan --help; docs/scale_out.md)")
    v = sub.add_parser("render", help="re-render a saved results.json (no model)")
    v.add_argument("results", help="a results.json written by 'tl-steering report'")
    v.add_argument("--out", default=None, help="output directory (default: the results file's directory)")
    return p


def check_report_args(args: argparse.Namespace) -> None:
    """Raise :class:`~tl_steering.errors.InputError` naming the first bad argument (no model, no file written)."""
    from .errors import InputError
    from .hub import OFFLINE_MODELS, check_hub

    if not isinstance(args.model, str) or not args.model.strip() or any(c.isspace() for c in args.model):
        raise InputError(f"--model must be a model name (e.g. {OFFLINE_MODELS[0]}), got {args.model!r}")
    if args.model.lower() not in OFFLINE_MODELS and not args.model.startswith("tiny-"):
        # a hub name offline: say so now (before torch is imported), not after TransformerLens has retried the hub
        # for half a minute
        check_hub(args.model)
    from ._util.checks import as_int, check_windows_length  # no torch: the launcher of the ranks runs these

    check_text_source(args.text)
    check_windows_length(args.windows, args.length)
    as_int(args.seed, "--seed", minimum=0)
    if getattr(args, "batch_size", None) is not None:
        as_int(args.batch_size, "--batch-size", minimum=1)
    if args.device not in (None, "cpu"):  # the CPU always exists
        from .validation import as_device

        as_device(args.device, "--device")
    if getattr(args, "nprocs", "auto") != "auto" and not (str(args.nprocs).isdigit() and int(args.nprocs) >= 1):
        raise InputError(f"--nprocs must be auto or a positive integer, got {args.nprocs!r}")
    check_out_dir(args.out)


def check_text_source(text: str) -> None:
    """A source :func:`~tl_steering.data.windows.parse_source` reads (``hf:`` with ``datasets`` installed); a file
    must be non-empty UTF-8."""
    from .data.windows import parse_source
    from .errors import InputError

    spec = parse_source(text)
    if spec.kind == "hf" and importlib.util.find_spec("datasets") is None:
        raise InputError(f"--text {text!r} needs the datasets extra: pip install datasets")
    if spec.kind != "file":
        return
    try:
        with open(text, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise InputError(f"--text {text!r}: cannot read the file ({e.strerror})") from None
    if not head.strip():
        raise InputError(f"--text {text!r}: the file is empty")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a multi-byte character cut at the end of the sample
            raise InputError(f"--text {text!r}: not UTF-8 text (byte {e.start})") from None


def check_out_dir(out: str) -> None:
    """The output directory is a directory (or can be made one) that we may write into; nothing is created."""
    import os

    from .errors import InputError

    if not out:
        raise InputError("--out must be a directory path, got ''")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise InputError(f"--out {out!r} exists and is not a directory")
    parent = path
    while not parent.exists():
        parent = parent.parent if parent.parent != parent else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"--out {out!r}: cannot write into {str(parent)!r}")


def run_report(model: Any = "smollm2-135m", backend: str = "bridge", text: str = "pydoc", windows: int | None = None,
               length: int | None = None, out: str | Path = "report", device: str | None = None, seed: int = 0,
               quick: bool = False, progress: bool = True, settings: Any = None, batch_size: int | None = None,
               resume: bool = False) -> Path:
    """Load ``model`` (unless given), run the suite, save ``out/results.json``, render ``out/index.html``.

    Arguments: docs/suite.md, "Arguments of run_report"."""
    import dataclasses
    import time

    import torch

    from .backends import adapt
    from .data.windows import text_windows
    from .report import render_report
    from .probing.scan import load_named
    from .data.sharding import world
    from .suite import RunArguments, StageTiming, default_settings, run_suite

    t0, c0 = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    m = load_named(model, backend, device) if isinstance(model, str) else model
    ad = adapt(m)
    s = settings or default_settings(ad.n_layers, quick=quick, windows=windows, length=length)
    if batch_size is not None:
        s = dataclasses.replace(s, batch_size=batch_size)
    tokens = text_windows(m, source=text, n_windows=s.windows, length=s.length, seed=seed)
    load = StageTiming(wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0)
    out_dir = Path(out)
    checkpoint = out_dir / "checkpoint.json"
    if not resume and world().rank == 0:
        for f in (checkpoint, checkpoint.with_suffix(".safetensors")):
            f.unlink(missing_ok=True)
    if world().active:
        torch.distributed.barrier()  # no rank reads a checkpoint rank 0 is about to discard
    suite = run_suite(m, tokens, s, progress=progress, seed=seed, checkpoint=checkpoint)
    suite.timings = {"load": load, **suite.timings}
    suite.total_wall_s += load.wall_s
    suite.arguments = RunArguments(
        model=model if isinstance(model, str) else ad.info.name, backend=backend, text=text, windows=windows,
        length=length, out=str(out), device=device, seed=seed, quick=quick,
        command=" ".join(sys.argv) if sys.argv and "tl-steering" in Path(sys.argv[0]).name else None)
    if world().rank != 0:  # under torchrun: rank 0 alone writes (every rank holds the same result)
        return out_dir / "index.html"
    suite.save(out_dir / "results.json")
    for f in (checkpoint, checkpoint.with_suffix(".safetensors")):  # its fields and its tensors
        f.unlink(missing_ok=True)
    return render_report(suite, out_dir)


def main(argv: list[str] | None = None) -> int:
    import atexit
    import gc

    # at exit, the interpreter's last collections then skip every object torch and TransformerLens made (1.4 s)
    atexit.register(gc.freeze)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["scan"]:  # its own parser (tl_steering.probing.scan), options and all
        from .probing.scan import main as scan_main

        return scan_main(argv[1:])
    args = build_parser().parse_args(argv)
    from .errors import InputError, TLSteeringError

    try:
        if args.command == "report":
            check_report_args(args)
            n, threads = local_ranks(args)
            if n > 1:
                return _launch_ranks(argv, n, threads)
            path, rank = _distributed_report(args)
            if rank != 0:
                return 0
        else:
            from .report import render_report

            res = Path(args.results)
            if not res.is_file():
                raise InputError(f"no results file at {str(res)!r}")
            path = render_report(res, args.out if args.out is not None else res.parent)
    except TLSteeringError as e:
        msg = " ".join(str(e).split())
        print(f"tl-steering {args.command}: error: {msg}", file=sys.stderr)
        return USAGE_ERROR
    print(f"report written to {path}")
    return 0


def local_ranks(args: argparse.Namespace) -> tuple[int, int]:
    """``(ranks, torch threads per rank)`` of ``report --nprocs`` (docs/scale_out.md, "The report on every core")."""
    import os

    from ._util.threads import usable_cores
    from .hub import OFFLINE_MODELS

    env = os.environ.get("OMP_NUM_THREADS", "")
    cores = int(env) if env.isdigit() and int(env) > 0 else usable_cores()
    small = args.model.lower() in OFFLINE_MODELS and args.device in (None, "cpu") and os.name == "posix"
    n = (min(2, cores) if small else 1) if args.nprocs == "auto" else int(args.nprocs)
    return (1, cores) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else (n, max(1, cores // n))


def _launch_ranks(argv: list[str], n: int, threads: int) -> int:
    """This ``report`` as ``n`` local gloo ranks of ``threads`` threads (torchrun's environment, a free port);
    the first rank to fail stops the others and gives the exit code; a Ctrl-C reaches every rank: 30 s, then 130."""
    import os
    import socket
    import subprocess
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "WORLD_SIZE": str(n),
               "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(sock.getsockname()[1])}
    cmd = [sys.executable, "-m", "tl_steering", *argv]
    ranks = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(n)]
    code, until = 0, float("inf")
    while None in (codes := [p.poll() for p in ranks]) and (code or not any(codes)) and time.monotonic() < until:
        try:
            time.sleep(0.05)
        except KeyboardInterrupt:  # every rank has it too: they save what they finished and stop
            code, until = 130, time.monotonic() + 30
    for p in ranks:
        if p.poll() is None:
            p.terminate()
    codes = [p.wait() for p in ranks]
    return code or next((c for c in codes if c > 0), 1 if any(codes) else 0)  # a rank's own error first


def _distributed_report(args: argparse.Namespace) -> tuple[Path, int]:
    """``report`` in this process, or as one rank of a ``torchrun`` job (docs/scale_out.md, "The sharded report")."""
    import torch

    from .probing.scan import init_from_env
    from .data.sharding import rank_device, world

    created = init_from_env(args.device)
    try:
        device = rank_device(args.device)
        rank = world().rank
        path = run_report(model=args.model, backend=args.backend, text=args.text, windows=args.windows,
                          length=args.length, out=args.out, device=device, seed=args.seed, quick=args.quick,
                          progress=not args.no_progress and rank == 0, batch_size=args.batch_size,
                          resume=args.resume)
    finally:
        if created:
            torch.distributed.destroy_process_group()
    return path, rank


__all__ = ["build_parser", "check_report_args", "check_text_source", "local_ranks", "main", "run_report"]
