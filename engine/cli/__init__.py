"""The engine's commands: model checkpoints, offline generation, the codec, checkpoint conversion.

`duplex` (realtime/cli/main.py) runs them beside the gateway's commands; `python -m engine.cli`
runs them alone. Each subcommand is one module with `register()` (engine/cli/common.py).
"""

from __future__ import annotations

from engine.cli.common import CliError as CliError  # noqa: F401 (re-exported: the commands' error)
from engine.cli.common import Command, build_parser, run

DESCRIPTION = "duplex: the engine's commands (the gateway's are in `duplex --help`)"


def engine_commands() -> tuple[Command, ...]:
    # imported here, not above: `import engine.cli.decode` alone stays as light as that module
    from engine.cli import convert, decode, encode, generate, model

    return (model, generate, decode, encode, convert)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(engine_commands(), DESCRIPTION), argv)
