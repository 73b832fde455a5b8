"""How the command line's own process ends (``cli.console_main``, ``compat.process.exit_without_teardown``): after
a command that ran only our code it skips the interpreter's teardown of the modules, and still does what an exit
must do (atexit functions, flushed streams, the exit code, waiting for a live thread); after any other command,
and in the Python API, the interpreter exits as usual. Each case is a real process: an exit cannot be observed in
this one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

SENTINELS = textwrap.dedent(
    """
    import atexit, sys

    class _Teardown:  # alive until the interpreter clears this module: its __del__ runs only in a teardown
        def __del__(self):
            sys.__stderr__.write("TEARDOWN\\n")
            sys.__stderr__.flush()

    _keep = _Teardown()
    atexit.register(lambda: print("ATEXIT", flush=False))  # printed into stdout's buffer: the exit must flush it
    """
)


def _python(code: str, cwd: Path, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else SRC
    return subprocess.run(
        [sys.executable, "-c", SENTINELS + textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
    )


def _console_main(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return _python(
        f"sys.argv = ['hyperdryrun', *{argv!r}]\nfrom hyperdryrun.cli import console_main\nconsole_main()\n",
        cwd,
    )


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


RUN = ["run", "--model", "llama-tiny", "--world-size", "2", "--dp-shard", "2", "--seq-len", "64"]


def test_run_ends_without_teardown_and_writes_what_the_usual_exit_writes(tmp_path):
    fast = _console_main([*RUN, "--output-dir", "fast"], tmp_path)
    assert fast.returncode == 0, fast.stderr
    assert "TEARDOWN" not in fast.stderr  # the modules were not cleared
    assert fast.stdout.rstrip().endswith(
        "ATEXIT"
    )  # the atexit functions ran, after the command, and were flushed
    assert "peak" in fast.stdout

    usual = _python(
        f"sys.argv = ['hyperdryrun', *{RUN!r}, '--output-dir', 'usual']\n"
        "from hyperdryrun.cli import main\nsys.exit(main())\n",
        tmp_path,
    )
    assert usual.returncode == 0, usual.stderr
    assert "TEARDOWN" in usual.stderr  # the sentinel does see a teardown when there is one
    assert fast.stdout.replace("fast", "usual") == usual.stdout
    fast_files, usual_files = _files(tmp_path / "fast"), _files(tmp_path / "usual")
    assert fast_files and fast_files == usual_files  # the same reports, byte for byte


def test_bad_input_keeps_its_exit_code_and_one_line(tmp_path):
    proc = _console_main([*RUN, "--tp", "0", "--output-dir", "out"], tmp_path)
    assert proc.returncode == 2
    assert [line for line in proc.stderr.splitlines() if line != "TEARDOWN"] == [proc.stderr.splitlines()[0]]
    assert "--tp" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_command_that_imports_no_torch_here_exits_as_usual(tmp_path):
    # ``report`` of a missing file: bad input, exit 2, and the interpreter's own exit (the teardown runs)
    proc = _console_main(["report", str(tmp_path / "missing.json")], tmp_path)
    assert proc.returncode == 2
    assert "TEARDOWN" in proc.stderr


@pytest.mark.parametrize("code", [0, 3])
def test_a_live_thread_is_waited_for_by_the_usual_exit(tmp_path, code):
    proc = _python(
        f"""
        import threading, time
        from hyperdryrun.compat.process import exit_without_teardown

        def late():
            time.sleep(0.3)
            print("THREAD", flush=True)

        threading.Thread(target=late).start()
        exit_without_teardown({code})
        """,
        tmp_path,
    )
    assert proc.returncode == code
    assert proc.stdout.splitlines() == ["THREAD", "ATEXIT"]
    assert "TEARDOWN" in proc.stderr


def test_without_threads_it_skips_the_teardown_with_the_code_given(tmp_path):
    proc = _python(
        "from hyperdryrun.compat.process import exit_without_teardown\nexit_without_teardown(7)\n", tmp_path
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (7, "ATEXIT\n", "")


def test_a_flush_that_fails_ends_as_the_interpreter_ends_it(tmp_path):
    """A stdout whose flush fails at exit (a full disk): the interpreter's own exit reports it and exits 120; so
    does this (it hands the exit back to the interpreter)."""
    code = textwrap.dedent(
        """
        class Full:
            def write(self, text):
                return len(text)

            def flush(self):
                raise OSError(28, "No space left on device")

        sys.stdout = Full()
        from hyperdryrun.compat.process import exit_without_teardown
        {}(3)
        """
    )
    usual = _python(code.format("sys.exit"), tmp_path)
    ours = _python(code.format("exit_without_teardown"), tmp_path)
    assert usual.returncode == 120, usual.stderr
    assert (ours.returncode, ours.stderr.count("No space left on device")) == (120, 1), ours.stderr
    assert "TEARDOWN" in ours.stderr


def test_a_profiler_gets_the_usual_exit(tmp_path):
    """``python -m cProfile -o FILE -m hyperdryrun ...`` writes FILE after the command returns: it must be written."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else SRC
    result = tmp_path / "result.prof"
    proc = subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", str(result), "-m", "hyperdryrun", *RUN, "--tp", "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "parallel.tp (--tp)" in proc.stderr  # (the exit code is cProfile's: it swallows the SystemExit)
    assert result.stat().st_size > 0


def test_a_tracer_gets_the_usual_exit(tmp_path):
    """A trace function (a debugger, ``trace``, coverage's tracer) may have work to do after the command."""
    proc = _python(
        "tracer = {}\n"
        "exec('def trace(*args): return None', tracer)\n"  # not a closure over this module: it would outlive the teardown
        "sys.settrace(tracer['trace'])\n"
        "from hyperdryrun.compat.process import exit_without_teardown\n"
        "exit_without_teardown(5)\n",
        tmp_path,
    )
    assert proc.returncode == 5
    assert "TEARDOWN" in proc.stderr


def test_a_worker_ends_with_its_atexit_functions_and_no_teardown(tmp_path):
    """``end_worker``: what a compiled job's Inductor registered (a semaphore's finalizer) runs, so the resource
    tracker has nothing to report leaked; exit code 0; no teardown."""
    proc = _python(
        "import multiprocessing\n"
        "lock = multiprocessing.get_context('spawn').Lock()  # a named semaphore, registered with the tracker\n"
        "from hyperdryrun.compat.process import end_worker\n"
        "end_worker()\n",
        tmp_path,
    )
    assert (proc.returncode, proc.stdout) == (0, "ATEXIT\n")
    assert "TEARDOWN" not in proc.stderr and "leaked semaphore" not in proc.stderr, proc.stderr
