"""The crash guard: a simulation in a child process; a native crash there becomes a one-line error naming the
signal and an error report, written by the parent that saw the child die."""

from __future__ import annotations

import ctypes
import json
import os
import signal

import pytest

from hyperdryrun.child import ChildDied, ChildFailed, run_in_child
from hyperdryrun.commands.torchtitan import _crash_outcome


def answer(x: int) -> dict:
    return {"pid": os.getpid(), "twice": 2 * x}


def raise_value_error() -> None:
    raise ValueError("bad shape (3, 4)")


def read_address_zero() -> None:
    ctypes.string_at(0)  # a real segmentation fault in native code


def exit_without_answer() -> None:
    os._exit(3)


def test_the_result_comes_back_from_another_process():
    out = run_in_child(answer, 21, start_method="fork")
    assert out["twice"] == 42 and out["pid"] != os.getpid()


def test_a_python_exception_comes_back_by_type_and_message():
    with pytest.raises(ChildFailed, match=r"^ValueError: bad shape \(3, 4\)$") as info:
        run_in_child(raise_value_error, start_method="fork")
    assert "raise_value_error" in info.value.traceback_text


def test_a_segmentation_fault_is_named_by_its_signal():
    with pytest.raises(ChildDied) as info:
        run_in_child(read_address_zero)  # spawn, as the command runs it
    assert info.value.signum == signal.SIGSEGV
    assert str(info.value) == (
        "the simulation process was killed by SIGSEGV (signal 11), a crash in native code that no Python code "
        "can catch"
    )


def test_an_exit_without_an_answer_gives_the_exit_code():
    with pytest.raises(ChildDied, match="exited with code 3 without a result") as info:
        run_in_child(exit_without_answer, start_method="fork")
    assert info.value.signum is None and info.value.exitcode == 3


def test_a_crash_still_writes_an_error_report(tmp_path):
    options = {"rank": 3, "world_size": 8, "argv": ["--module", "llama3"], "output_dir": str(tmp_path)}
    outcome = _crash_outcome(options, ChildDied(signal.SIGSEGV))
    path = tmp_path / "rank_3" / "rank_3_memory.json"
    assert outcome["paths"] == [str(path)]
    assert outcome["error"] == (
        "rank 3: the simulation process was killed by SIGSEGV (signal 11), a crash in native code that no Python "
        f"code can catch (report: {path})"
    )
    report = json.loads(path.read_text())
    assert report["status"] == "error" and report["stage"] == "simulation"
    assert report["error"]["type"] == "ChildDied" and "SIGSEGV" in report["error"]["message"]
    assert report["metadata"]["rank"] == 3 and report["metadata"]["torchtitan"]["argv"] == [
        "--module",
        "llama3",
    ]
