"""``hyperdryrun`` command line: thin — build the parser from the command modules, dispatch, return the exit code."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

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
IMPORTS_TORCH_HERE = RUNS_TORCH - {"torchtitan", "script"}
"""The commands whose own process imports the dry run's torch stack (:func:`hyperdryrun.startup.import_torch_stack`,
first thing after parsing); torchtitan and script run their step in a child process, which imports it there."""


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


def _stdout_lost() -> None:
    """Point stdout at /dev/null so that Python's own flush at exit has nothing left to fail on."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)


def _stdout_gone() -> int:
    """Exit code 141 for a stdout whose reader went away (stdout then points at /dev/null)."""
    _stdout_lost()
    return EXIT_SIGPIPE


class _QuietOnFailure:
    """A text stream that forwards to ``stream`` until a write fails (``2>/dev/full``: ENOSPC; a closed terminal:
    EIO), then drops what follows: an error message that cannot be shown must not turn into another error and
    change the exit code (bad input stays 2)."""

    def __init__(self, stream: Any) -> None:
        self._stream, self._broken = stream, False

    def write(self, text: str) -> int:
        if not self._broken:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):
                self._broken = True
        return len(text)

    def flush(self) -> None:
        if not self._broken:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._broken = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class StdoutLost(Exception):
    """stdout refused a write for another reason than a reader that went away (``>/dev/full``)."""


class _StdoutGuard:
    """A text stream that forwards to ``stream``; a write or flush that fails other than with a broken pipe raises
    :class:`StdoutLost` (one line, exit 2) instead of an ``OSError`` indistinguishable from a file's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _guard(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as err:
            raise StdoutLost(f"stdout: cannot write what the command prints ({err.strerror or err})") from err

    def write(self, text: str) -> int:
        return self._guard(self._stream.write, text)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def guarded_std_streams() -> Iterator[None]:
    """While inside, ``sys.stderr`` is :class:`_QuietOnFailure` and ``sys.stdout`` a :class:`_StdoutGuard`; the
    streams come back on exit."""
    from hyperdryrun.compat.process import std_stream_patches
    from hyperdryrun.patches import PatchSet

    with PatchSet(std_stream_patches(_StdoutGuard(sys.stdout), _QuietOnFailure(sys.stderr))):
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()


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
    internal error on one line, Ctrl-C and SIGTERM one line each. A closed standard stream is ``/dev/null``
    (:func:`~hyperdryrun.compat.process.open_closed_std_fds`); a stderr that cannot be written is dropped (:class:`_QuietOnFailure`)."""
    return _run(argv, [])


def console_main() -> NoReturn:
    """The ``hyperdryrun`` executable and ``python -m hyperdryrun``: :func:`main` on ``sys.argv``, then the process
    ends. After a command that ran only our code and the libraries' in this process (:data:`IMPORTS_TORCH_HERE`:
    ``torchtitan`` and ``script`` run the user's code in a child), without the interpreter's teardown of torch's
    stack (:func:`~hyperdryrun.compat.process.exit_without_teardown`: ~1 CPU s); after any other, as usual."""
    from hyperdryrun.compat.process import exit_without_teardown

    ran: list[str] = []
    code = _run(None, ran)
    if ran and ran[0] in IMPORTS_TORCH_HERE:
        exit_without_teardown(code)
    raise SystemExit(code)


def _run(argv: Sequence[str] | None, ran: list[str]) -> int:
    from hyperdryrun.compat.process import open_closed_std_fds
    from hyperdryrun.startup import owned_process

    open_closed_std_fds()
    with guarded_std_streams(), owned_process():
        return _main(argv, ran)


def _main(argv: Sequence[str] | None, ran: list[str]) -> int:
    """:func:`main`'s work; ``ran`` receives the command's name once its arguments parse."""
    from hyperdryrun.runner import BAD_INPUT, error_kind

    args = None
    try:
        with sigterm_raises(), broken_pipe_raises():
            args = build_parser().parse_args(argv)
            ran.append(args.command)
            check_limits()  # every command reads files or simulates within these: refuse a bad one first
            if args.command in RUNS_TORCH and (problem := torch_problem()):
                return fail(problem)
            if args.command in IMPORTS_TORCH_HERE:
                from hyperdryrun.startup import import_torch_stack

                import_torch_stack()
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
        except StdoutLost as err:
            _stdout_lost()
            return fail(str(err))
        raise
    except KeyboardInterrupt:
        sys.stderr.write("hyperdryrun: interrupted (SIGINT)\n")
        return EXIT_SIGINT
    except Terminated:
        sys.stderr.write("hyperdryrun: terminated (SIGTERM)\n")
        return EXIT_SIGTERM
    except BrokenPipeError:  # stdout's reader went away (``| head``): as a shell would, quietly
        return _stdout_gone()
    except StdoutLost as err:  # ``>/dev/full``: what the command printed was lost
        _stdout_lost()
        return fail(str(err))
    except Exception as err:
        debug = bool(getattr(args, "debug", False))
        if error_kind(err) == BAD_INPUT:
            return fail(str(err), err, debug)
        return internal_error(f"{type(err).__name__}: {err}", "".join(traceback.format_exception(err)), debug)


if __name__ == "__main__":
    console_main()
