"""What every `duplex` command shares: the parser built from command modules, the error a command
raises for bad input, and the exit codes. The engine's commands (engine/cli/) and the gateway's
(realtime/cli/) both build on it; `duplex` itself lives above both (realtime/cli/main.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Protocol


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2, no traceback."""


class Command(Protocol):
    """A command module: `register()` adds its subparser, which sets `func` (args -> exit code)."""

    def register(self, subparsers: argparse._SubParsersAction) -> None: ...


def build_parser(commands: Sequence[Command], description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duplex", description=description)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in commands:
        command.register(sub)
    return parser


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse `argv` and run its command: 0 or its code; 2 and one line for bad input; 130 on ^C."""
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, FileNotFoundError, ValueError) as e:
        print(f"duplex {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
