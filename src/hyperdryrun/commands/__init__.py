"""One module per ``hyperdryrun`` subcommand; each exposes ``register(subparsers)``.

Exit codes shared by every command: 0 success, 1 a verdict the user asked for failed (OOM, tolerance), 2 an error
(bad input, a failed simulation, an unwritable output).
"""

from __future__ import annotations

import argparse
import sys
import traceback

from hyperdryrun.report.build import one_line

EXIT_OK, EXIT_VERDICT, EXIT_ERROR = 0, 1, 2


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"hyperdryrun: error: {message}\n")
        raise SystemExit(EXIT_ERROR)


def fail(message: str, err: BaseException | None = None, debug: bool = False) -> int:
    """Print ``hyperdryrun: error: <one line>`` (the traceback first with ``--debug``) and return exit code 2."""
    if debug and err is not None:
        traceback.print_exception(err)
    sys.stderr.write(f"hyperdryrun: error: {one_line(message)}\n")
    return EXIT_ERROR
