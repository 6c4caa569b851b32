"""Command line: ``tl-steering report ...`` (also ``python -m tl_steering``)."""

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tl-steering", description="Feed-forward steering diagnostics (arXiv:2608.02071)")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="run every protocol and write an HTML report")
    r.add_argument("--model", default="smollm2-135m", help="smollm2-135m (offline), gemma-3-270m, or a TL model name")
    r.add_argument("--backend", default="bridge", choices=["bridge", "hooked"])
    r.add_argument("--text", default="pydoc", help="'pydoc' (offline), a text file, or hf:NAME[:CONFIG]:SPLIT")
    r.add_argument("--windows", type=int, default=None, help="number of token windows (default 8, --quick 4)")
    r.add_argument("--length", type=int, default=None, help="tokens per window (default 128, --quick 64)")
    r.add_argument("--out", default="report", help="output directory")
    r.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ...")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--quick", action="store_true", help="small settings (about 2 minutes on 2 CPU cores)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "report":
        from .report import run_report

        path = run_report(
            model=args.model, backend=args.backend, text=args.text, windows=args.windows, length=args.length,
            out=args.out, device=args.device, seed=args.seed, quick=args.quick, progress=not args.no_progress,
        )
        print(f"report written to {path}")
        return 0
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
