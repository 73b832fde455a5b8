"""Executors: local worker processes and a local Ray instance give the results of running the tasks here."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from hyperdryrun.search.executors import WAIT, InlineExecutor, LocalExecutor, SimTask, executor_for, run_task
from tests.conftest import job


def _tasks() -> list[SimTask]:
    out = []
    for rank in (0, 2):
        cfg = job(world__world_size=3, world__rank=rank)
        out.append(SimTask(f"rank{rank}", cfg.model_dump(), shortcut=True))
    return out


@pytest.fixture(scope="module")
def here():
    return {r.key: r.figures for r in InlineExecutor().imap(_tasks())}


def test_run_task_reports_a_bad_job_on_one_line():
    bad = job().model_dump()
    bad["model"]["n_layers"] = 0
    result = run_task(SimTask("bad", bad))
    assert result.figures is None and result.error_kind == "bad input"
    assert "model.n_layers" in result.error and "\n" not in result.error


def test_local_worker_processes_give_the_same_figures(here):
    got = {r.key: r.figures for r in LocalExecutor(2).imap(_tasks())}
    assert got == here
    assert here["rank0"]["peak_bytes"] != here["rank2"]["peak_bytes"]  # uneven shards: two different answers


def _waiting(tasks: list[SimTask], answered: list[str], asked: list[int]):
    """A task source that starts the first task, then waits (WAIT) until it has an answer, then starts the rest;
    ``asked`` records how many answers there were each time it was asked for a task."""
    first, *rest = tasks
    asked.append(len(answered))
    yield first
    while not answered:
        asked.append(len(answered))
        yield WAIT
    for task in rest:
        asked.append(len(answered))
        yield task


def _imap_waiting(executor) -> tuple[dict, list[int]]:
    answered: list[str] = []
    asked: list[int] = []
    got = {}
    for r in executor.imap(_waiting(_tasks(), answered, asked)):
        answered.append(r.key)
        got[r.key] = r.figures
    return got, asked


def test_a_source_that_waits_is_asked_again_after_the_next_answer(here):
    # Two workers, one of them idle: WAIT is not the end of the tasks; the source is asked once more after the
    # first answer and starts the second task then.
    got, asked = _imap_waiting(LocalExecutor(2))
    assert got == here
    assert asked == [0, 0, 1]


def test_a_source_that_waits_with_nothing_in_flight_is_an_error():
    def waits():
        yield WAIT

    with pytest.raises(RuntimeError, match="no task in flight"):
        list(LocalExecutor(2).imap(waits()))
    with pytest.raises(RuntimeError, match="no task in flight"):
        list(InlineExecutor().imap(waits()))


def test_stopping_early_stops_the_workers():
    results = LocalExecutor(2).imap(_tasks())
    first = next(results)
    results.close()  # the generator's cleanup kills and reaps the workers
    assert first.key in ("rank0", "rank2")


def test_executor_names():
    assert isinstance(executor_for("local", 1), InlineExecutor)
    assert isinstance(executor_for("local", 2), LocalExecutor)
    with pytest.raises(ValueError, match="choose local or ray"):
        executor_for("slurm", 1)


def test_ray_executor_on_a_local_ray_instance(here):
    from hyperdryrun.search.executors import RayExecutor

    # importing ray sets RAY_CLIENT_MODE, ray.init writes PYTHONBREAKPOINT and RAY_* variables into os.environ and
    # ray.shutdown leaves them: the test started this instance, so it puts the environment back
    # (tests/conftest.py fails a test that leaks it)
    with mock.patch.dict(os.environ):
        # ray is in the dev extra, so CI runs this test: a missing ray is a failure here, not a skip.
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            executor = RayExecutor()
            assert executor.jobs == 2
            got = {r.key: r.figures for r in executor.imap(_tasks())}
            waited, asked = _imap_waiting(executor)
        finally:
            ray.shutdown()
    assert got == here and waited == here
    assert asked == [0, 0, 1]


def test_ray_needs_an_address_when_not_connected(monkeypatch):
    from hyperdryrun.search.executors import RayExecutor

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="--ray-address"):
        RayExecutor()
