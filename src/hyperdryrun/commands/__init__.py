"""One module per ``hyperdryrun`` subcommand; each exposes ``register(subparsers)``.

Exit codes, the same for every command (a CI gate may read them):

- 0 done (the job fits with the margin, or no capacity was asked; compare: within tolerance);
- 1 the verdict asked for failed: OOM, or "at risk" (within the margin under the capacity, ``--margin-gib 0``
  turns that off: :mod:`hyperdryrun.allocator.verdict`), compare outside ``--tolerance``, an audit mismatch;
  nothing else;
- 2 bad input: a flag, the job file, a value rule, an output directory that cannot be written;
- 3 an internal error: one line (with the report path when one was written), ``--debug`` shows the traceback;
- 130 interrupted by SIGINT (Ctrl-C), 143 stopped by SIGTERM: one line, nothing written after the signal;
- 141 stdout was closed by its reader (``| head``), silently, as a shell reports SIGPIPE (the user's script's own
  prints included).

Two ways stdout goes away, two answers. A reader that closed the pipe (``| head -1``: the write fails with EPIPE, as
SIGPIPE would end a C program) is 141, quietly, whatever the command had done: the reader chose to stop, and a shell's
``pipefail`` reads it as SIGPIPE. A stdout that was never open (``>&-``: EBADF, no reader at all) is no broken pipe:
it is ``/dev/null``, as if the shell had redirected it there (Python itself leaves ``sys.stdout`` None and drops what
is printed), so the command does its work and its exit code is its own (0 when the reports were written, 1 for the
verdict, 2 for bad input; ``--version >&-`` and ``--help >&-`` are 0). Closed stdin or stderr is the same. A stdout
that refuses writes (``>/dev/full``: ENOSPC) lost what the command printed: one line and 2; a stderr that does
(``2>/dev/full``) changes no exit code (:mod:`hyperdryrun.cli`).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from hyperdryrun.report.build import one_line

EXIT_OK, EXIT_VERDICT, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_SIGINT, EXIT_SIGTERM, EXIT_SIGPIPE = 128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGPIPE
EXIT_ERROR = EXIT_BAD_INPUT
"""The name of exit code 2 from before internal errors had their own code."""

RERUN_WITH_DEBUG = "internal error: rerun with --debug for the traceback"


def plain_int(text: str) -> int:
    """``int(text)`` for ASCII digits only: Python's ``int`` also takes ``'1_0'`` and ``'١'`` (an Arabic-Indic one),
    which no user means as a number of a flag (issue 30)."""
    if not plain_number(text):
        raise ValueError(f"{text!r} is not an integer of ASCII digits")
    return int(text)


def plain_number(text: str) -> bool:
    """Whether ``text`` is free of what Python's ``int``/``float`` take beyond a plain number: non-ASCII digits,
    ``_`` separators."""
    return text.isascii() and "_" not in text


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit 2, and an int or float flag takes ASCII digits only."""

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        if action.type in (int, float) and isinstance(arg_string, str) and not plain_number(arg_string):
            name = action.type.__name__  # type: ignore[union-attr]
            raise argparse.ArgumentError(action, f"invalid {name} value: {arg_string!r} (ASCII digits only)")
        return super()._get_value(action, arg_string)  # type: ignore[misc]

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"hyperdryrun: error: {message}\n")
        raise SystemExit(EXIT_BAD_INPUT)

    def _print_message(self, message: str, file: Any = None) -> None:
        """argparse's, without its ``except OSError: pass``: ``--help | head -1`` must see the closed pipe (exit
        141), not exit 0 as if the help had been read."""
        if message:
            (file or sys.stderr).write(message)


def fail(message: str, err: BaseException | None = None, debug: bool = False) -> int:
    """Print ``hyperdryrun: error: <one line>`` (the traceback first with ``--debug``) and return exit code 2."""
    if debug and err is not None:
        traceback.print_exception(err)
    sys.stderr.write(f"hyperdryrun: error: {one_line(message)}\n")
    return EXIT_BAD_INPUT


def internal_error(
    message: str, tb: str | None = None, debug: bool = False, has_traceback: bool = True
) -> int:
    """Print an internal error on one line (the traceback ``tb`` first with ``--debug``); return exit code 3.
    ``has_traceback=False`` (a process killed by a signal: no Python traceback exists) leaves out the hint to rerun
    with ``--debug``."""
    if debug and tb:
        sys.stderr.write(tb if tb.endswith("\n") else tb + "\n")
    hint = "" if debug or not has_traceback else f"; {RERUN_WITH_DEBUG}"
    sys.stderr.write(f"hyperdryrun: error: {one_line(message)}{hint}\n")
    return EXIT_INTERNAL


def exit_code_of(outcomes: Sequence[Any], debug: bool = False) -> int:
    """The exit code of the ranks run (:class:`hyperdryrun.runner.RankOutcome`, one or several): a failure wins
    over a verdict, an internal one over bad input; the first failure is printed on one line."""
    from hyperdryrun.runner import INTERNAL

    failed = [o for o in outcomes if o.error]
    if not failed:
        return EXIT_VERDICT if any(o.verdict_failed for o in outcomes) else EXIT_OK
    internal = [o for o in failed if o.error_kind == INTERNAL]
    first = (internal or failed)[0]
    more = f" (and {len(failed) - 1} more of {len(outcomes)} ranks failed)" if len(failed) > 1 else ""
    if debug:
        for o in failed:
            if o.traceback:
                sys.stderr.write(o.traceback if o.traceback.endswith("\n") else o.traceback + "\n")
    if internal:
        return internal_error(first.error + more, None, debug, has_traceback=first.traceback is not None)
    return fail(first.error + more)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt so that the same cleanup runs (temporary files
    removed, worker processes killed)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated` (main thread only); the previous handler comes back on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
