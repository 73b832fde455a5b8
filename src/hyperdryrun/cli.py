"""``hyperdryrun`` command line: thin — build the parser from the command modules, dispatch, return the exit code."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from hyperdryrun import __version__
from hyperdryrun.commands import OneLineParser
from hyperdryrun.commands import audit_kernels as audit_kernels_command
from hyperdryrun.commands import compare as compare_command
from hyperdryrun.commands import measure as measure_command
from hyperdryrun.commands import run as run_command
from hyperdryrun.commands import torchtitan as torchtitan_command
from hyperdryrun.commands.job import FLAG_OF, RUN_FLAGS, config_from_args  # noqa: F401  (public re-exports)

COMMANDS = [run_command, measure_command, compare_command, audit_kernels_command, torchtitan_command]
"""Each module registers one subcommand (memray's layout: one small module per command)."""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="hyperdryrun",
        description="Per-rank accelerator memory of one distributed training step, on a CPU-only machine.",
    )
    parser.add_argument("--version", action="version", version=f"hyperdryrun {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
