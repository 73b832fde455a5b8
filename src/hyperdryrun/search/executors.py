"""Where rank-class simulations run: in this process, in local worker processes, or on a Ray cluster.

A task is one rank class of one candidate: the job config of the class's representative rank (plain data), whether
the exact shortcut may be used, and where samples may be cached. Its result is the rank's step figures
(:class:`hyperdryrun.search.extrapolate.StepFigures` as a dict, with the method and versions that produced it) or a
one-line error. Every executor has ``imap(tasks)``: it pulls tasks lazily (so a search can stop asking), runs up to
``jobs`` at once and yields results as they finish, in any order; closing the iterator stops the work. A task
source may yield :data:`WAIT` while tasks are in flight: it has nothing to start until one of them answers (the
search's next task may depend on it), and is asked again after the next result.

Local workers are persistent spawned processes (imports, fake-tensor and DTensor caches stay warm from one task to
the next); a worker ignores Ctrl-C (this process stops it) and dies with this process. On Ray each task is one
remote call of :func:`run_task` (``num_cpus=1``): the cluster's workers need the same hyperdryrun and torch
installed (``pip install 'hyperdryrun[ray]'``); a result reports the versions it was computed with, and a mismatch
with this process is an error rather than a cached wrong answer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hyperdryrun.report.build import one_line
from hyperdryrun.runner import bind_to_parent, stop_signals_blocked, usable_cpus


class _Wait:
    def __repr__(self) -> str:
        return "WAIT"


WAIT = _Wait()
"""Yielded by a task source in place of a task: nothing to start until a task in flight answers."""


class _Source:
    """A task source as every executor reads it: :meth:`take` the next task to start, :meth:`end` once nothing
    is in flight."""

    def __init__(self, tasks: Iterable[SimTask | _Wait]) -> None:
        self._tasks = iter(tasks)
        self._exhausted = False

    def take(self) -> SimTask | None:
        """The next task, or None: the source is exhausted, or it waits (it is asked again after the next result)."""
        if self._exhausted:
            return None
        task = next(self._tasks, None)
        if task is None:
            self._exhausted = True
        return None if task is WAIT else task

    def end(self) -> None:
        """Called with nothing in flight, where the executor stops: a source that is not exhausted waits, and would
        wait forever."""
        if not self._exhausted:
            raise RuntimeError("a task source waited with no task in flight")


@dataclass(frozen=True)
class SimTask:
    """One rank-class simulation."""

    key: str
    """The figures' cache key (also how a result is matched to its task)."""
    job: dict[str, Any]
    """The representative rank's job config, as a dict."""
    shortcut: bool = True
    cache_dir: str | None = None
    """Where sample tables may be read and written (None: not cached)."""


@dataclass
class TaskResult:
    key: str
    figures: dict[str, Any] | None = None
    error: str | None = None
    error_kind: str | None = None
    seconds: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)


def run_task(task: SimTask) -> TaskResult:
    """Run one task here: the rank's step figures (extrapolated when the shortcut holds), or its error."""
    from hyperdryrun.config import build_config
    from hyperdryrun.runner import error_kind
    from hyperdryrun.search.cache import ResultCache, versions
    from hyperdryrun.search.shortcut import step_figures

    t0 = time.perf_counter()
    try:
        cfg = build_config(task.job)
        figures = step_figures(cfg, task.shortcut, sample=cached_samples(ResultCache(task.cache_dir)))
        return TaskResult(task.key, figures.to_dict(), seconds=time.perf_counter() - t0, versions=versions())
    except Exception as err:
        message = one_line(f"{type(err).__name__}: {err}")
        return TaskResult(task.key, None, message, error_kind(err), time.perf_counter() - t0, versions())


def cached_samples(cache: Any) -> Any:
    """A sample source that answers from ``cache`` first and stores what it runs."""
    from hyperdryrun.search.cache import job_key
    from hyperdryrun.search.extrapolate import SampleTable, run_sample

    def get(cfg: Any) -> SampleTable:
        key = job_key(cfg, "sample")
        hit = cache.get("samples", key)
        if hit is not None:
            return SampleTable.from_dict(hit)
        table = run_sample(cfg)
        cache.put("samples", key, table.to_dict())
        return table

    return get


class InlineExecutor:
    """Every task in this process, one after the other (a simulation restores every global it touches)."""

    jobs = 1

    def imap(self, tasks: Iterable[SimTask | _Wait]) -> Iterator[TaskResult]:
        source = _Source(tasks)
        while (task := source.take()) is not None:
            yield run_task(task)
        source.end()  # nothing is ever in flight here when the source is asked


class LocalExecutor:
    """Up to ``jobs`` persistent worker processes on this machine."""

    def __init__(self, jobs: int) -> None:
        if jobs < 1:
            raise ValueError(f"jobs: must be >= 1 (got {jobs})")
        self.jobs = jobs

    def imap(self, tasks: Iterable[SimTask | _Wait]) -> Iterator[TaskResult]:
        import multiprocessing
        from multiprocessing.connection import wait

        ctx = multiprocessing.get_context("spawn")
        source = _Source(tasks)
        idle: list[Any] = []
        busy: dict[Any, tuple[Any, SimTask]] = {}  # connection -> (process, task)
        procs: dict[Any, Any] = {}
        try:
            while True:
                while idle or len(procs) < self.jobs:
                    task = source.take()
                    if task is None:
                        break
                    conn = idle.pop() if idle else self._start(ctx, procs)
                    conn.send(task)
                    busy[conn] = (procs[conn], task)
                if not busy:
                    source.end()
                    return
                for conn in wait(list(busy)):
                    proc, task = busy.pop(conn)
                    try:
                        result = conn.recv()
                        idle.append(conn)
                    except (EOFError, OSError):
                        proc.join()
                        del procs[conn]
                        conn.close()
                        how = f"exit code {proc.exitcode}"
                        if proc.exitcode is not None and proc.exitcode < 0:
                            how = f"killed by {signal.Signals(-proc.exitcode).name}"
                        result = TaskResult(
                            task.key, error=f"the worker process died ({how})", error_kind="internal"
                        )
                    yield result
        finally:
            for conn, proc in procs.items():
                with contextlib.suppress(Exception):
                    proc.kill()
                proc.join()
                conn.close()

    @staticmethod
    def _start(ctx: Any, procs: dict[Any, Any]) -> Any:
        here, there = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=_worker, args=(there, os.getpid()), name="hyperdryrun-fit-worker", daemon=True
        )
        try:
            with stop_signals_blocked():
                proc.start()
        finally:
            there.close()
        procs[here] = proc
        return here


def _worker(conn: Any, parent_pid: int) -> None:
    """A worker: run tasks until the parent closes the pipe; ignores Ctrl-C and dies with the parent."""
    from hyperdryrun.startup import import_torch_stack, owned_process

    bind_to_parent(parent_pid)
    with owned_process():
        with contextlib.suppress(Exception):  # a failed import fails again in run_task: the task's error
            import_torch_stack()
        while True:
            try:
                task = conn.recv()
            except (EOFError, OSError):
                break
            try:
                result = run_task(task)
            except BaseException as err:  # pragma: no cover - run_task catches Exception
                result = TaskResult(
                    task.key, error=one_line(f"{type(err).__name__}: {err}"), error_kind="internal"
                )
                traceback.print_exc()
            conn.send(result)
    from hyperdryrun.compat.process import end_worker

    end_worker()


class RayExecutor:
    """Tasks as remote calls on a Ray cluster: the one ``ray.init`` already made in this process, else the cluster
    at ``address`` (else ``$RAY_ADDRESS``). ``jobs``: tasks in flight (default: the cluster's CPUs)."""

    def __init__(self, address: str | None = None, jobs: int | None = None) -> None:
        try:
            import ray
        except ImportError:
            from hyperdryrun.config import ConfigError

            raise ConfigError(  # bad input (exit 2), as a missing matplotlib for --plot
                "--executor ray needs Ray: pip install 'hyperdryrun[ray]' (on this machine and on the cluster)"
            ) from None
        self._ray = ray
        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS")
            if not address:
                raise ValueError(
                    "--executor ray: give --ray-address HOST:PORT (or set RAY_ADDRESS) of a running cluster"
                )
            try:
                ray.init(address=address, log_to_driver=False)
            except Exception as err:
                raise ValueError(
                    f"--ray-address {address!r}: cannot connect to the Ray cluster: {one_line(str(err))}"
                ) from None
        self.jobs = jobs or max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._remote = ray.remote(num_cpus=1, max_retries=0)(run_task)

    def imap(self, tasks: Iterable[SimTask | _Wait]) -> Iterator[TaskResult]:
        ray = self._ray
        source = _Source(tasks)
        in_flight: dict[Any, SimTask] = {}
        try:
            while True:
                while len(in_flight) < self.jobs:
                    task = source.take()
                    if task is None:
                        break
                    in_flight[self._remote.remote(task)] = task
                if not in_flight:
                    source.end()
                    return
                ready, _ = ray.wait(list(in_flight), num_returns=1)
                for ref in ready:
                    task = in_flight.pop(ref)
                    try:
                        yield ray.get(ref)
                    except Exception as err:
                        yield TaskResult(
                            task.key,
                            error=one_line(f"ray: {type(err).__name__}: {err}"),
                            error_kind="internal",
                        )
        finally:
            for ref in in_flight:
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)


def executor_for(kind: str, jobs: int | None, ray_address: str | None = None) -> Any:
    """``local`` (``jobs`` workers, default :func:`~hyperdryrun.runner.usable_cpus`; in this process when 1) or
    ``ray``."""
    if kind == "ray":
        return RayExecutor(ray_address, jobs)
    if kind != "local":
        raise ValueError(f"--executor {kind!r}: choose local or ray")
    n = jobs or usable_cpus()
    return InlineExecutor() if n == 1 else LocalExecutor(n)
