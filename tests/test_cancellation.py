"""Stopping a run: SIGINT/SIGTERM stop every worker at once and exit 130/143 with one line, a parent killed with
SIGKILL takes its workers with it, and nothing is written after the signal (no report, no temporary file).

Real processes, watched through /proc: ``run --ranks 0,1`` of llama-tiny with 64 layers (a rank's step takes
~15 s alone on two cores), signalled a few seconds after both workers started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLOW_RANKS = [
    "run",
    "--model",
    "llama-tiny",
    "--n-layers",
    "64",
    "--world-size",
    "2",
    "--ranks",
    "0,1",
    "--jobs",
    "2",
]

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="watches processes through /proc"
)


def start(argv: list[str], tmp_path: Path, code: str = "") -> subprocess.Popen:
    """``hyperdryrun <argv>`` in a child interpreter (``code`` runs first), its output in files under tmp_path."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    driver = f"import sys\n{code}\nfrom hyperdryrun.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-c", driver, *argv], cwd=tmp_path, env=env, stdout=out, stderr=err,
            preexec_fn=_default_sigint,
        )  # fmt: skip


def _default_sigint() -> None:
    """The child starts with SIGINT's default action, whatever pytest inherited: a shell without job control starts
    its background jobs (``nohup ... &``) with SIGINT ignored, which Python and so the command keep (as a command
    run that way should), and the SIGINT tests would see it run to its end."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def children(pid: int) -> dict[int, str]:
    """Processes whose parent is ``pid``, with their command lines."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(entry)] = cmdline
    return found


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that never comes counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.1)


def files_under(root: Path) -> list[str]:
    return (
        sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        if root.exists()
        else []
    )


def workers_running(proc: subprocess.Popen, tmp_path: Path) -> dict[int, str]:
    """Wait until both rank workers run, let them get into their steps, and return every child of ``proc``."""
    wait_for(
        lambda: sum("spawn_main" in c for c in children(proc.pid).values()) == 2 or proc.poll() is not None,
        180,
        "two worker processes",
    )
    assert proc.poll() is None, (tmp_path / "stderr").read_text()
    time.sleep(3)
    return children(proc.pid)


@pytest.mark.parametrize(
    ("signum", "code", "line"),
    [
        (signal.SIGINT, 130, "hyperdryrun: interrupted (SIGINT)\n"),
        (signal.SIGTERM, 143, "hyperdryrun: terminated (SIGTERM)\n"),
    ],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_stops_every_worker_at_once_and_writes_nothing(tmp_path, signum, code, line):
    out = tmp_path / "out"
    proc = start([*SLOW_RANKS, "--output-dir", str(out)], tmp_path)
    family = workers_running(proc, tmp_path)
    assert files_under(out) == [], "a rank finished before the signal: make its step longer"
    signalled = time.monotonic()
    os.kill(proc.pid, signum)
    assert proc.wait(timeout=30) == code
    assert time.monotonic() - signalled < 15  # the workers' steps had ~10 s left: killed, not waited for
    assert (tmp_path / "stderr").read_text() == line
    wait_for(lambda: not any(alive(p) for p in family), 15, f"no process left of {family}")
    time.sleep(2)  # a write after the signal would land now
    assert files_under(out) == []


def test_a_parent_killed_with_sigkill_takes_its_workers_with_it(tmp_path):
    out = tmp_path / "out"
    proc = start([*SLOW_RANKS, "--output-dir", str(out)], tmp_path)
    family = workers_running(proc, tmp_path)
    assert len(family) >= 2 and files_under(out) == []
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    # workers and multiprocessing's resource tracker alike; the old pool's workers ran on and wrote their reports
    wait_for(lambda: not any(alive(p) for p in family), 15, f"no process left of {family}")
    time.sleep(2)
    assert files_under(out) == []


@pytest.mark.parametrize(
    ("signum", "code", "line"),
    [
        (signal.SIGINT, 130, "hyperdryrun: interrupted (SIGINT)\n"),
        (signal.SIGTERM, 143, "hyperdryrun: terminated (SIGTERM)\n"),
    ],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_during_a_single_rank_is_one_line_and_writes_nothing(tmp_path, signum, code, line):
    out = tmp_path / "out"
    started = tmp_path / "step-started"
    code_first = f"""
import hyperdryrun.recipe as recipe
real = recipe.run_job
def run_job(*args, **kwargs):
    open({str(started)!r}, "w").close()
    return real(*args, **kwargs)
recipe.run_job = run_job
"""
    argv = ["run", "--model", "llama-tiny", "--n-layers", "64", "--output-dir", str(out)]
    proc = start(argv, tmp_path, code_first)
    wait_for(lambda: started.exists() or proc.poll() is not None, 180, "the step to start")
    time.sleep(1)
    assert proc.poll() is None, (tmp_path / "stderr").read_text()
    os.kill(proc.pid, signum)
    assert proc.wait(timeout=30) == code
    assert (tmp_path / "stderr").read_text() == line
    assert files_under(out) == []
