"""`duplex model make-tiny OUT_DIR [--seed N]`: write a tiny random OpusLM checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.cli.common import CliError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="model checkpoints")
    msub = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    tiny = msub.add_parser("make-tiny", help="write a tiny randomly initialised OpusLM checkpoint")
    tiny.add_argument("out_dir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=run_make_tiny)


def run_make_tiny(args: argparse.Namespace) -> int:
    from engine.tiny import make_tiny

    out: Path = args.out_dir
    if out.exists() and any(out.iterdir()):
        raise CliError(f"{out} exists and is not empty")
    make_tiny(out, seed=args.seed)
    print(f"wrote tiny OpusLM checkpoint (seed {args.seed}) to {out}")
    return 0
