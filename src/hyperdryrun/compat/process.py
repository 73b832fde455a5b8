"""Edits of process-wide state of Python, rich and torch that the package makes outside a simulated step's
patches, each a reversible :class:`~hyperdryrun.patches.Patch` naming the behaviour it works around (the
architecture scan, ``tests/test_architecture.py``, finds such edits anywhere else)."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

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


def std_stream_patches(stdout: Any, stderr: Any) -> list[Patch]:
    """``sys.stdout`` and ``sys.stderr`` replaced by wrappers of themselves (the CLI's guards): Python's print and
    rich raise a bare ``OSError`` on a full or closed stream, and an error message that cannot be shown would turn
    into a second error with another exit code."""
    return [
        Patch(
            sys,
            "stderr",
            stderr,
            "a write into a full or closed stderr raises OSError and changes the exit code",
        ),
        Patch(
            sys,
            "stdout",
            stdout,
            "a write into a full stdout raises an OSError indistinguishable from a file's",
        ),
    ]


def open_closed_std_fds() -> None:
    """A standard stream the shell closed (``>&-``) becomes ``/dev/null``, as if it had been redirected there: its
    descriptor would otherwise go to the first file this process opens (a report written through ``print``, a
    worker's output into a report), and Python's ``sys.stdout`` is ``None``. The command then does its work and its
    exit code is its verdict; what it would have printed is discarded. Not undone: the descriptors and streams
    live as long as the process (the CLI's entry point calls it once)."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDONLY if mode == "r" else os.O_WRONLY)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115  (lives as long as the process)


def exit_without_teardown(code: int) -> NoReturn:
    """End this process with ``code`` as the interpreter's exit would, less its teardown of the modules.

    After the atexit functions, CPython's ``Py_FinalizeEx`` clears every module and frees what they hold, with
    collections over the whole heap between: after a dry run, torch's stack and the step's caches (~520,000 objects
    the collector tracks), ~1 CPU s of the README's first command (~6), measured here (docs/PERFORMANCE.md). A
    process that is about to end has no use for that work; the rank and search workers skip it already
    (``os._exit`` once their answer is sent). What an exit must still do is done first, in the interpreter's order:
    it waits for threads (here: a live non-daemon thread sends it down the interpreter's own exit instead), runs the
    atexit functions (``logging``'s flush, ``multiprocessing``'s reaping of children, weakref finalizers, coverage's
    save), then flushes stdout and stderr (a flush that fails does too: the interpreter reports it as it would).
    Only for a process whose command ran none of the user's code: a file their code left open would lose what its
    buffer holds. A profiler or tracer attached to the process (``python -m cProfile``, ``trace``, a debugger) gets
    the usual exit too: what wraps the command writes its results after the command returns."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        raise SystemExit(code)
    if any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()):
        raise SystemExit(code)
    atexit._run_exitfuncs()
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):
        raise SystemExit(code) from None
    os._exit(code)


def end_worker() -> NoReturn:
    """End a worker process whose answer is sent, without the interpreter's teardown (its parent is waiting to reap
    it): the atexit functions first, as in :func:`exit_without_teardown` (``multiprocessing``'s finalizers: a
    semaphore that a compiled job's Inductor made is unregistered from the resource tracker, which otherwise warned
    "There appear to be 1 leaked semaphore objects" at the parent's exit), then stdout and stderr flushed where they
    still can be (a reader that went away has had the answer already), then ``os._exit(0)``."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    os._exit(0)


__all__ = [
    "argv_patch",
    "broken_pipe_patch",
    "end_worker",
    "excepthook_patch",
    "exit_without_teardown",
    "open_closed_std_fds",
    "std_stream_patches",
]
