"""``--jobs``'s default: the CPUs this process may run on (its affinity, capped by its cgroup's CPU bandwidth
limit), not the host's cores that ``os.cpu_count()`` counts. In a container given 2 of a host's 64 CPUs, ``fit``
and ``--all-ranks`` would otherwise start 64 workers, each importing torch, on those 2. The cgroup trees below are
written by hand; each expected count is quota / period rounded up, worked out in the test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyperdryrun.config import build_config
from hyperdryrun.runner import cgroup_cpu_limit, usable_cpus
from hyperdryrun.search.executors import InlineExecutor, LocalExecutor, executor_for

linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")


def tree(root: Path, proc: str, files: dict[str, str]) -> tuple[str, str]:
    """A cgroup mount at ``root`` with ``files`` (path -> text) and a ``/proc/self/cgroup`` of ``proc``."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "self_cgroup").write_text(proc)
    return str(root), str(root / "self_cgroup")


def test_cgroup_v2_quota_in_whole_cpus_rounded_up(tmp_path):
    # docker --cpus=1.5 in a cgroup namespace: "150000 100000" at the namespace's root = 1.5 CPUs -> 2 workers
    args = tree(tmp_path, "0::/\n", {"cgroup.controllers": "cpu\n", "cpu.max": "150000 100000\n"})
    assert cgroup_cpu_limit(*args) == 2


def test_cgroup_v2_no_limit(tmp_path):
    args = tree(tmp_path, "0::/\n", {"cgroup.controllers": "cpu\n", "cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(*args) is None


def test_cgroup_v2_the_tightest_ancestor_limits(tmp_path):
    # a systemd slice limited to 3 CPUs (300000 / 100000) above a job scope without a limit of its own, and a
    # sibling's limit (1 CPU) that is not on this process's path
    files = {
        "cgroup.controllers": "cpu\n",
        "batch.slice/cpu.max": "300000 100000\n",
        "batch.slice/job.scope/cpu.max": "max 100000\n",
        "other.slice/cpu.max": "100000 100000\n",
    }
    args = tree(tmp_path, "0::/batch.slice/job.scope\n", files)
    assert cgroup_cpu_limit(*args) == 3


def test_cgroup_v1_quota_and_a_host_without_one(tmp_path):
    # Kubernetes limit 2500m on cgroup v1: cfs quota 250000 of period 100000 = 2.5 -> 3; a host with quota -1: none
    proc = "4:memory:/kubepods/pod1\n3:cpu,cpuacct:/kubepods/pod1\n0::/\n"
    files = {
        "cpu,cpuacct/kubepods/pod1/cpu.cfs_quota_us": "250000\n",
        "cpu,cpuacct/kubepods/pod1/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "unified/cgroup.procs": "",
    }
    assert cgroup_cpu_limit(*tree(tmp_path / "pod", proc, files)) == 3
    host = {k: v for k, v in files.items() if not k.startswith("cpu,cpuacct/kubepods")}
    assert cgroup_cpu_limit(*tree(tmp_path / "host", proc, host)) is None


def test_a_container_without_a_cgroup_namespace_reads_its_mount_root(tmp_path):
    # docker on cgroup v1 without a cgroup namespace: /proc/self/cgroup names the host's path, which the
    # container's bind mount does not have; its own cgroup is the mount's root (quota 200000 / 100000 = 2)
    proc = "3:cpu,cpuacct:/docker/0123abcd\n"
    files = {"cpu,cpuacct/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}
    assert cgroup_cpu_limit(*tree(tmp_path, proc, files)) == 2


def test_no_cgroups_at_all(tmp_path):
    assert cgroup_cpu_limit(str(tmp_path), str(tmp_path / "missing")) is None


@linux
def test_the_limit_caps_the_affinity_and_never_goes_below_one(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    two = tree(tmp_path / "a", "0::/\n", {"cgroup.controllers": "", "cpu.max": "200000 100000\n"})
    eight = tree(tmp_path / "b", "0::/\n", {"cgroup.controllers": "", "cpu.max": "800000 100000\n"})
    assert usable_cpus(*two) == 2
    assert usable_cpus(*eight) == 4  # the affinity is tighter
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set())
    assert usable_cpus(*eight) == 1


@linux
def test_one_allowed_cpu_gives_one_job_where_the_host_has_more():
    """A process pinned to one CPU (``taskset -c 0``, a cpuset, Slurm's binding) runs the search in this process;
    the host's CPU count, the old default, would have started a worker per host CPU."""
    code = (
        "import os\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from hyperdryrun.runner import usable_cpus\n"
        "from hyperdryrun.search.executors import executor_for\n"
        "print(usable_cpus(), type(executor_for('local', None)).__name__, os.cpu_count())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    cpus, executor, host = out.stdout.split()
    assert (cpus, executor) == ("1", "InlineExecutor")
    if int(host) < 2:
        pytest.skip("a one-CPU host cannot tell the affinity from the host's count")


@linux
def test_this_machine_and_an_explicit_jobs(monkeypatch):
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))
    executor = executor_for("local", 5)
    assert isinstance(executor, LocalExecutor) and executor.jobs == 5
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert isinstance(executor_for("local", None), InlineExecutor)


@linux
def test_run_ranks_runs_as_many_workers_as_allowed_cpus(monkeypatch, tmp_path):
    """Three ranks on a process allowed one CPU: one worker at a time (``--jobs`` not given)."""
    import hyperdryrun.runner as runner

    seen = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1})
    monkeypatch.setattr(runner, "_in_workers", lambda cfg, ranks, jobs, *rest: seen.append(jobs) or [])
    cfg = build_config(
        {"model": {"name": "llama-tiny"}, "world": {"world_size": 4}, "output_dir": str(tmp_path)}
    )
    runner.run_ranks(cfg, [0, 1, 2], show_progress=False)
    runner.run_ranks(cfg, [0, 1, 2], jobs=2, show_progress=False)
    assert seen == [1, 2]
