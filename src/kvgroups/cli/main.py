"""The ``kvgroups`` command: ``inspect`` a model's KV cache, list ``presets``, ``generate`` with prefix
reuse, look into a ``store``.

Strings become enums and dtypes in :mod:`kvgroups.cli.arguments` and nowhere else. Any bad input
ends as one line on stderr and exit code 2; ``kvgroups`` alone prints its usage (on stderr, exit 2).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from collections.abc import Sequence
from typing import NoReturn

from rich.console import Console

from kvgroups.cli.generate_command import add_generate_command
from kvgroups.cli.inspect_command import add_inspect_commands
from kvgroups.cli.store_command import add_store_commands

EXIT_BAD_INPUT = 2


class _BadInputError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _BadInputError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvgroups", description="Describe the KV cache of LLMs from their config.json.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_inspect_commands(commands)
    add_store_commands(commands, _Parser)
    add_generate_command(commands)
    return parser


def _console() -> Console:
    # Wide enough that group rows do not wrap when piped; a terminal's own width wins when wider.
    return Console(width=max(shutil.get_terminal_size((180, 24)).columns, 180), soft_wrap=True)


def main(argv: Sequence[str] | None = None) -> int:
    # Warnings reach the user through the report (on stderr); keep library log lines off the terminal
    # while the command runs (and only then: main() also runs inside other programs and tests).
    library = logging.getLogger("kvgroups")
    previous = library.level
    library.setLevel(logging.ERROR)
    try:
        return _run(sys.argv[1:] if argv is None else list(argv))
    finally:
        library.setLevel(previous)


def _run(argv: list[str]) -> int:
    parser = build_parser()
    if not argv:
        sys.stderr.write(parser.format_help())
        return EXIT_BAD_INPUT
    try:
        args = parser.parse_args(argv)
        return int(args.run(args, _console()))
    except (_BadInputError, ValueError, TypeError, OSError) as error:
        message = " ".join(str(error).split())
        sys.stderr.write(f"kvgroups: error: {message}\n")
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
