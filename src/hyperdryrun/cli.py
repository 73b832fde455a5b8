"""``hyperdryrun`` command line: thin — build the parser from the command modules, dispatch, return the exit code."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import traceback
from collections.abc import Iterator, Sequence

from hyperdryrun.commands import (
    EXIT_SIGINT,
    EXIT_SIGPIPE,
    EXIT_SIGTERM,
    OneLineParser,
    Terminated,
    fail,
    internal_error,
    sigterm_raises,
)
from hyperdryrun.commands import audit_kernels as audit_kernels_command
from hyperdryrun.commands import compare as compare_command
from hyperdryrun.commands import fit as fit_command
from hyperdryrun.commands import measure as measure_command
from hyperdryrun.commands import report as report_command
from hyperdryrun.commands import run as run_command
from hyperdryrun.commands import script as script_command
from hyperdryrun.commands import snapshot as snapshot_command
from hyperdryrun.commands import torchtitan as torchtitan_command
from hyperdryrun.commands.job import FLAG_OF, RUN_FLAGS, config_from_args  # noqa: F401  (public re-exports)
from hyperdryrun.commands.preflight import check_limits
from hyperdryrun.compat.versions import torch_problem
from hyperdryrun.version import __version__

COMMANDS = [
    run_command,
    measure_command,
    compare_command,
    audit_kernels_command,
    snapshot_command,
    report_command,
    torchtitan_command,
    fit_command,
    script_command,
]
"""Each module registers one subcommand (memray's layout: one small module per command)."""
RUNS_TORCH = frozenset({"run", "measure", "fit", "torchtitan", "script", "audit-kernels"})
"""The commands that execute a training step on the installed torch: an unsupported or missing torch stops them
before any work, in one line (:func:`hyperdryrun.compat.versions.torch_problem`); the others only read files and
run without torch."""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="hyperdryrun",
        description="Per-rank accelerator memory of one distributed training step, on a CPU-only machine.",
        epilog="exit codes: 0 done, 1 the verdict failed (OOM or at risk, outside --tolerance), 2 bad input, 3 internal "
        "error, 130 SIGINT, 143 SIGTERM, 141 stdout closed by its reader",
    )
    parser.add_argument("--version", action="version", version=f"hyperdryrun {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def _stdout_gone() -> int:
    """Exit code 141 for a stdout whose reader went away, with stdout pointed at /dev/null so that Python's own
    flush at exit has nothing left to fail on."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_SIGPIPE


@contextlib.contextmanager
def broken_pipe_raises() -> Iterator[None]:
    """While inside, rich's consoles raise :class:`BrokenPipeError` when stdout's reader has gone (``| head``), as
    ``print`` does, so that :func:`main` exits 141: rich's default ``Console.on_broken_pipe`` raises
    ``SystemExit(1)``, the exit code of a failed verdict. The method comes back on exit."""
    from rich.console import Console

    from hyperdryrun.compat.process import broken_pipe_patch
    from hyperdryrun.patches import PatchSet

    def on_broken_pipe(self: Console) -> None:
        self.quiet = True  # nothing more from this console
        raise BrokenPipeError(errno.EPIPE, "stdout was closed by its reader")

    with PatchSet([broken_pipe_patch(on_broken_pipe)]):
        yield


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and return its exit code (see :mod:`hyperdryrun.commands`): what escapes a command is an
    internal error on one line, Ctrl-C and SIGTERM one line each."""
    from hyperdryrun.runner import BAD_INPUT, error_kind

    args = None
    try:
        with sigterm_raises(), broken_pipe_raises():
            args = build_parser().parse_args(argv)
            check_limits()  # every command reads files or simulates within these: refuse a bad one first
            if args.command in RUNS_TORCH and (problem := torch_problem()):
                return fail(problem)
            code = args.func(args)
            sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's exit
            return code
    except (
        SystemExit
    ):  # argparse's --help, --version and usage errors: what they printed must reach its reader too
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            return _stdout_gone()
        raise
    except KeyboardInterrupt:
        sys.stderr.write("hyperdryrun: interrupted (SIGINT)\n")
        return EXIT_SIGINT
    except Terminated:
        sys.stderr.write("hyperdryrun: terminated (SIGTERM)\n")
        return EXIT_SIGTERM
    except BrokenPipeError:  # stdout's reader went away (``| head``): as a shell would, quietly
        return _stdout_gone()
    except Exception as err:
        debug = bool(getattr(args, "debug", False))
        if error_kind(err) == BAD_INPUT:
            return fail(str(err), err, debug)
        return internal_error(f"{type(err).__name__}: {err}", "".join(traceback.format_exception(err)), debug)


if __name__ == "__main__":
    raise SystemExit(main())
