"""Edits of process-wide state of Python, rich and torch that the package makes outside a simulated step's
patches, each a reversible :class:`~hyperdryrun.patches.Patch` naming the behaviour it works around (the
architecture scan, ``tests/test_architecture.py``, finds such edits anywhere else)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from hyperdryrun.patches import Patch


def excepthook_patch() -> Patch:
    """``sys.excepthook`` kept as it is now and put back when undone: torch 2.13's ``init_process_group`` wraps it
    with a ``[rank<r>]:`` prefix and never unwraps it (the simulated world undoes it on exit)."""
    return Patch(
        sys,
        "excepthook",
        sys.excepthook,
        "torch 2.13 init_process_group wraps sys.excepthook with a '[rank<r>]:' prefix and never unwraps it",
    )


def argv_patch(argv: list[str]) -> Patch:
    """``sys.argv`` as ``python FILE ARGS`` gives a script its own arguments (``hyperdryrun script``)."""
    return Patch(sys, "argv", argv, "a script parses sys.argv as python FILE ARGS would give it")


def broken_pipe_patch(handler: Callable[[Any], None]) -> Patch:
    """rich's ``Console.on_broken_pipe`` replaced by ``handler``: rich's default raises ``SystemExit(1)`` when
    stdout's reader has gone, the exit code of a failed verdict, where a closed pipe should exit 141."""
    from rich.console import Console

    return Patch(
        Console,
        "on_broken_pipe",
        handler,
        "rich's Console.on_broken_pipe raises SystemExit(1), the exit code of a failed verdict, on a closed stdout",
    )


__all__ = ["argv_patch", "broken_pipe_patch", "excepthook_patch"]
