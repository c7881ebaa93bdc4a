"""`duplex`: the project's command line (the console script; `python -m realtime.cli`).

It sits above both packages and names every command module: the engine's (engine/cli/) and the
gateway's (realtime/cli/). Every edge points down, where the import graph sees it; engine/ never
reaches up for the gateway's commands.
"""

from __future__ import annotations

from engine.cli import engine_commands
from engine.cli.common import Command, build_parser, run
from realtime.cli import client, serve, soak

DESCRIPTION = "duplex: a full-duplex spoken-dialogue server (OpusLM on vLLM) and its tools"


def commands() -> tuple[Command, ...]:
    return (*engine_commands(), serve, client, soak)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(commands(), DESCRIPTION), argv)
