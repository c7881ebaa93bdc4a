"""`duplex`: the project's command line. Each subcommand is one module with `register()`."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "engine.cli.model",
    "engine.cli.generate",
    "engine.cli.decode",
    "engine.cli.encode",
    "engine.cli.convert",
    "realtime.cli.serve",
    "realtime.cli.client",
    "realtime.cli.soak",
)


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duplex", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if name.startswith(e.name or "\0"):  # a command (or its package) not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, FileNotFoundError, ValueError) as e:
        print(f"duplex {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
