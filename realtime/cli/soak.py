"""`duplex soak`: simulated callers against a server (realtime/soak/run.py)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from realtime.soak.run import __doc__ as doc
    from realtime.soak.run import add_arguments

    p = subparsers.add_parser("soak", help="latency soak: simulated callers over real sockets, with a report",
                              description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from realtime.soak.run import run_from_args

    return run_from_args(args)
