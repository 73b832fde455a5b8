"""Run a simulation in a child process, so that a crash no Python code can catch still gets a one-line answer.

A segmentation fault in an extension (a compiled kernel reading a fake tensor's data pointer, a bug in a native
library) kills the process that runs the traced step; run there, nothing is left to write an error report. In a
child, the parent sees it die: :func:`run_in_child` returns the function's result, re-raises its Python exception as
:class:`ChildFailed`, or raises :class:`ChildDied` naming the signal (or the exit code) the child ended with.

>>> outcome = run_in_child(run_one_rank, options)      # a module-level function and picklable arguments
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable
from typing import Any


class ChildDied(RuntimeError):
    """The child process ended without an answer: killed by ``signal`` (a number) or exited with ``exitcode``."""

    def __init__(self, signum: int | None, exitcode: int | None = None) -> None:
        self.signum, self.exitcode = signum, exitcode
        if signum is not None:
            what = f"was killed by {signal_name(signum)} (signal {signum})"
            if signum in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT):
                what += ", a crash in native code that no Python code can catch"
            elif signum == signal.SIGKILL:
                what += " (out of host memory, or killed from outside)"
        else:
            what = f"exited with code {exitcode} without a result"
        super().__init__(f"the simulation process {what}")


class ChildFailed(RuntimeError):
    """The function raised in the child: its exception's type name, message and formatted traceback."""

    def __init__(self, type_name: str, message: str, traceback_text: str = "") -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.message, self.traceback_text = type_name, message, traceback_text


def signal_name(signum: int) -> str:
    """``SIGSEGV`` for 11 (the platform's name), ``signal 99`` for a number it does not know."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _child_main(conn: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # a process group of its own: what the user's code starts goes with it (_end_group)
    from hyperdryrun.startup import import_torch_stack, owned_process

    try:
        with owned_process():
            import_torch_stack()
            result = fn(*args, **kwargs)
    except BaseException as err:  # sent to the parent as plain text: the exception itself may not pickle
        conn.send(("error", (type(err).__name__, str(err), traceback.format_exc())))
    else:
        conn.send(("ok", result))
    finally:
        conn.close()


def _end_group(pgid: int | None) -> None:
    """Kill what is left of the child's process group (processes the user's script started): a dry run, ended
    or interrupted (SIGTERM, Ctrl-C), leaves nothing running behind it."""
    if pgid is None:
        return
    with contextlib.suppress(OSError):  # no such group: nothing was left (or the child never made it)
        os.killpg(pgid, signal.SIGKILL)


def run_in_child(fn: Callable[..., Any], *args: Any, start_method: str = "spawn", **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a fresh child process (``spawn``: no state of this process leaks in); its result
    (which must pickle), or :class:`ChildFailed` / :class:`ChildDied`."""
    ctx = multiprocessing.get_context(start_method)
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(send, fn, args, kwargs), name="hyperdryrun-simulation")
    proc.start()
    send.close()  # the child holds the only write end: its death closes the pipe
    try:
        try:
            kind, payload = receive.recv()
        except EOFError:
            kind, payload = None, None
    except BaseException:
        proc.kill()
        proc.join()
        _end_group(proc.pid)
        raise
    finally:
        receive.close()
    proc.join()
    _end_group(proc.pid)
    if kind == "ok":
        return payload
    if kind == "error":
        if payload[0] == "BrokenPipeError":  # the child's prints met a closed stdout (``| head``): exit 141
            raise BrokenPipeError(errno.EPIPE, payload[1])
        if payload[0] == "KeyboardInterrupt":
            # raised in the child (a Ctrl-C reaches it too, or the user's code raised it): as in this process,
            # and as Python itself answers an uncaught one, interrupted (130), not an internal error
            raise KeyboardInterrupt
        raise ChildFailed(*payload)
    code = proc.exitcode
    raise ChildDied(-code if code is not None and code < 0 else None, code)
