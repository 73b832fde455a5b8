"""``--jobs``'s default: the CPUs this process may run on (its affinity; a container's CPU quota), not the host's
cores that ``os.cpu_count()`` counts. In a container given 2 of a host's 64 CPUs, ``fit`` and ``--all-ranks`` would
otherwise start 64 workers, each importing torch, on those 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hyperdryrun.config import build_config
from hyperdryrun.runner import usable_cpus
from hyperdryrun.search.executors import InlineExecutor, LocalExecutor, executor_for

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")


def test_one_allowed_cpu_gives_one_job_where_the_host_has_more():
    """A process pinned to one CPU (what ``taskset -c 0``, a cpuset or Slurm's binding does) runs the search in
    this process; the host's CPU count, the old default, would have started a worker per host CPU."""
    code = (
        "import os\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from hyperdryrun.runner import usable_cpus\n"
        "from hyperdryrun.search.executors import executor_for\n"
        "print(usable_cpus(), type(executor_for('local', None)).__name__, os.cpu_count())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LOKY_MAX_CPU_COUNT"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    cpus, executor, host = out.stdout.split()
    assert (cpus, executor) == ("1", "InlineExecutor")
    if int(host) < 2:
        pytest.skip("a one-CPU host cannot tell the affinity from the host's count")


def test_the_default_never_exceeds_the_affinity_and_an_explicit_jobs_wins(monkeypatch):
    monkeypatch.delenv("LOKY_MAX_CPU_COUNT", raising=False)
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert usable_cpus() <= 3
    executor = executor_for("local", 5)
    assert isinstance(executor, LocalExecutor) and executor.jobs == 5
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert isinstance(executor_for("local", None), InlineExecutor)


def test_run_ranks_runs_as_many_workers_as_allowed_cpus(monkeypatch, tmp_path):
    """Three ranks on a process allowed one CPU: one worker at a time (``--jobs`` not given)."""
    import hyperdryrun.runner as runner

    seen = []
    monkeypatch.delenv("LOKY_MAX_CPU_COUNT", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1})
    monkeypatch.setattr(runner, "_in_workers", lambda cfg, ranks, jobs, *rest: seen.append(jobs) or [])
    cfg = build_config(
        {"model": {"name": "llama-tiny"}, "world": {"world_size": 4}, "output_dir": str(tmp_path)}
    )
    runner.run_ranks(cfg, [0, 1, 2], show_progress=False)
    runner.run_ranks(cfg, [0, 1, 2], jobs=2, show_progress=False)
    assert seen == [1, 2]
