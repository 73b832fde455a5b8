"""Run a job's ranks and write their reports: one rank in this process, or several in worker processes.

The library behind ``hyperdryrun run`` and ``hyperdryrun measure`` (and the place for a layout search or a cluster
executor to start from)::

    from hyperdryrun.config import build_config
    from hyperdryrun.runner import run_ranks

    if __name__ == "__main__":  # workers are spawned: they import the main module again
        cfg = build_config({"model": {"name": "llama-tiny"}, "world": {"world_size": 4}})
        for outcome in run_ranks(cfg, [0, 3], jobs=2):
            print(outcome.rank, outcome.report["summary"]["peak_bytes"], outcome.paths)

A simulation owns process-global state (the process group, torch patches), so the ranks of :func:`run_ranks` run in
spawned worker processes, up to ``jobs`` at a time; a dry-run worker runs rank after rank (:func:`_worker`). Workers
only compute; this process writes every file as each rank finishes, so stopping a run (Ctrl-C, SIGTERM, an
exception, a callback that raises) kills the workers at once and writes nothing after it. A worker also dies with
this process (Linux: ``PR_SET_PDEATHSIG``; elsewhere a watchdog thread).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperdryrun.report.build import one_line
from hyperdryrun.report.reporters import DEFAULT_REPORTERS, RankReport, reporters_named, write_rank_reports

if TYPE_CHECKING:
    from hyperdryrun.config import JobConfig

BAD_INPUT = "bad input"
"""``RankOutcome.error_kind`` of a failure the user can fix: the job, a value rule, the output directory."""
INTERNAL = "internal"
"""``RankOutcome.error_kind`` of any other failure: a bug here or in torch, a worker that died."""
_STOPPED = {"BrokenPipeError": BrokenPipeError, "KeyboardInterrupt": KeyboardInterrupt}
"""What a worker's job raised that stops the whole run as it would in this process (a ``_Computed.kind``): its own
prints into a stdout whose reader went away (``| head``: 141), a KeyboardInterrupt its code raised (130)."""

Execute = Callable[..., Any]
"""``execute(cfg, capture_stacks=...) -> StepTrace``: how a rank's step is run (default: the dry run,
:func:`hyperdryrun.recipe.run_job`; ``measure`` passes the real run). Module level (or a picklable object), so a
worker can import it. One with a ``job_metadata(cfg) -> dict`` method says what an error report states about the job
(default: the built-in recipe's :func:`hyperdryrun.recipe.job_metadata`)."""

OnRankDone = Callable[["RankOutcome", int, int], None]
"""``on_rank_done(outcome, done, total)``, called in this process after each rank's reports are written."""

_START_METHOD = "spawn"
"""How workers start: a fresh interpreter (a fork of a process whose torch runs threads is not safe)."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@dataclass
class RankOutcome:
    """What one rank's run left: its report (ok or error), the files written, and a one-line error if it failed."""

    rank: int
    report: dict[str, Any] = field(default_factory=dict)
    paths: list[str] = field(default_factory=list)
    error: str | None = None
    error_kind: str | None = None
    """:data:`BAD_INPUT` or :data:`INTERNAL` when ``error`` is set."""
    traceback: str | None = None
    """The failure's traceback, formatted where it happened (a worker's too)."""
    trace: Any = None
    """The StepTrace, for a rank run in this process (None from a worker)."""

    @property
    def oom(self) -> bool:
        """Whether the rank's peak is over its target's capacity (False when it failed or there is no capacity)."""
        return self.error is None and bool(self.report.get("summary", {}).get("oom"))

    @property
    def verdict_failed(self) -> bool:
        """Whether the rank's capacity verdict is "OOM" or "at risk" (:mod:`hyperdryrun.allocator.verdict`)."""
        s = self.report.get("summary", {}) if self.error is None else {}
        return bool(s.get("oom") or s.get("at_risk"))


@dataclass
class _Computed:
    """A rank's result before anything is written: what a worker sends back."""

    rank: int
    result: RankReport | None  # None: nothing to write
    error: str | None = None
    kind: str | None = None
    traceback: str | None = None


def error_kind(err: BaseException) -> str:
    """:data:`BAD_INPUT` for what the user can fix (the job description, a value rule the step needs, a job this
    machine cannot measure, caching-allocator settings, a layout the installed torch cannot apply), else
    :data:`INTERNAL`."""
    from hyperdryrun.allocator.options import AllocatorConfigError
    from hyperdryrun.config import ConfigError
    from hyperdryrun.engine import SimulationError
    from hyperdryrun.measure.step import MeasureError
    from hyperdryrun.parallel.options import LayoutUnsupported  # a layout the installed torch cannot apply
    from hyperdryrun.world.simulated import WorldError  # the world's arguments: a script's mesh_shape
    from hyperdryrun.world.values import ValueRuleError

    cause = err.error if isinstance(err, SimulationError) else err
    user_fixable = (
        ConfigError,
        MeasureError,
        ValueRuleError,
        AllocatorConfigError,
        WorldError,
        LayoutUnsupported,
    )
    return BAD_INPUT if isinstance(cause, user_fixable) else INTERNAL


def _formatted(err: BaseException) -> str:
    return "".join(traceback.format_exception(err))


def _simulate(cfg: JobConfig, capture_stacks: bool, execute: Execute | None, mode: str) -> _Computed:
    """Run the rank's step and build its report (or its error report); writes nothing."""
    from hyperdryrun.engine import SimulationError
    from hyperdryrun.recipe import job_metadata, run_job
    from hyperdryrun.report.build import error_report

    rank = cfg.world.rank
    try:
        trace = (execute or run_job)(cfg, capture_stacks=capture_stacks)
    except SimulationError as err:
        message = f"rank {rank}: {err.stage} failed: {type(err.error).__name__}: {err.error}"
        try:
            meta = {**getattr(execute, "job_metadata", job_metadata)(cfg), "mode": mode}
        except Exception:
            meta = {"mode": mode}
        report = error_report(err.stage, err.error, meta)
        return _Computed(rank, RankReport(rank, report), message, error_kind(err), _formatted(err))
    return _Computed(rank, RankReport.from_trace(trace, cfg.target, cfg.live_set_limit))


def _write(done: _Computed, output_dir: str, reporters: Sequence[str]) -> RankOutcome:
    """Write a computed rank with ``reporters``; an unwritable output directory is the user's to fix. A rank that
    failed on bad input writes nothing: its one-line error says all there is, and the report an earlier run left
    there stays (an internal failure writes its error report, the evidence for a bug report)."""
    rank, error, kind, tb = done.rank, done.error, done.kind, done.traceback
    if done.result is None:
        return RankOutcome(rank, error=error, error_kind=kind, traceback=tb)
    if error is not None and kind == BAD_INPUT:
        return RankOutcome(rank, done.result.report, [], error, kind, tb, done.result.trace)
    trace = done.result.trace
    try:
        paths = [str(p) for p in write_rank_reports(done.result, output_dir, reporters)]
    except OSError as err:
        report = done.result.report
        if error is not None:
            error = f"{error} (and the error report could not be written: {err})"
            return RankOutcome(rank, report, [], error, kind, tb, trace)
        error = f"--output-dir {output_dir!r}: cannot write the reports: {err}"
        return RankOutcome(rank, report, [], error, BAD_INPUT, _formatted(err), trace)
    if error is not None and paths:
        error = f"{error} (report: {paths[0]})"
    return RankOutcome(rank, done.result.report, paths, error, kind, tb, trace)  # the report as written


def _died(rank: int, exitcode: int | None, metadata: dict[str, Any]) -> _Computed:
    """A process that ran rank ``rank`` ended without an answer: an error report (stage ``simulation``) naming the
    signal that killed it (or its exit code), written by the process that saw it die."""
    from hyperdryrun.child import ChildDied
    from hyperdryrun.report.build import error_report

    err = ChildDied(-exitcode if exitcode is not None and exitcode < 0 else None, exitcode)
    report = error_report("simulation", err, {**metadata, "rank": rank})
    return _Computed(rank, RankReport(rank, report), f"rank {rank}: {err}", INTERNAL)


def crashed_rank(
    cfg: JobConfig,
    exitcode: int | None,
    *,
    metadata: dict[str, Any] | None = None,
    reporters: Sequence[str] = DEFAULT_REPORTERS,
) -> RankOutcome:
    """``cfg``'s rank ran in a child process that died (``exitcode``: the process's, negative for a signal): write
    its error report naming the signal and return the outcome, an internal error."""
    meta = {"mode": "dry-run", "world_size": cfg.world.world_size, **(metadata or {})}
    return _write(_died(cfg.world.rank, exitcode, meta), cfg.output_dir, reporters)


def run_rank(
    cfg: JobConfig,
    *,
    capture_stacks: bool = True,
    execute: Execute | None = None,
    mode: str = "dry-run",
    reporters: Sequence[str] = DEFAULT_REPORTERS,
) -> RankOutcome:
    """Run ``cfg``'s rank in this process and write its reports with ``reporters`` (an error report if the step
    fails). ``mode`` is the error report's ``metadata.mode``. Errors outside the step propagate."""
    reporters_named(reporters)  # an unknown name fails before the run
    return _write(_simulate(cfg, capture_stacks, execute, mode), cfg.output_dir, reporters)


def run_ranks(
    cfg: JobConfig,
    ranks: Sequence[int],
    jobs: int | None = None,
    *,
    capture_stacks: bool = True,
    execute: Execute | None = None,
    mode: str = "dry-run",
    reporters: Sequence[str] = DEFAULT_REPORTERS,
    on_rank_done: OnRankDone | None = None,
    show_progress: bool | None = None,
) -> list[RankOutcome]:
    """Run ``ranks`` of ``cfg``'s job in up to ``jobs`` worker processes at a time (default: :func:`usable_cpus`;
    the built-in dry run's workers take rank after rank, a measured or front door's rank gets a fresh process:
    :func:`_worker`), and write each rank's reports here as it finishes; outcomes in the order of ``ranks``.

    ``on_rank_done`` is called after each rank; without it, ranks done/total are drawn on stderr when stderr is a
    terminal (``show_progress`` True/False forces it on/off)."""
    reporters_named(reporters)
    ranks = list(ranks)
    if jobs is not None and jobs < 1:
        raise ValueError(f"jobs: must be >= 1 (got {jobs})")
    for i, r in enumerate(ranks):
        if not 0 <= r < cfg.world.world_size:
            raise ValueError(f"ranks: rank {r} must satisfy 0 <= rank < world_size={cfg.world.world_size}")
        if r in ranks[:i]:
            raise ValueError(f"ranks: rank {r} is given twice (in {ranks})")
    if not ranks:
        return []
    jobs = min(jobs or usable_cpus(), len(ranks))
    work = (capture_stacks, execute, mode)
    if on_rank_done is None and (sys.stderr.isatty() if show_progress is None else show_progress):
        from hyperdryrun.report.console import rank_progress

        with rank_progress(len(ranks)) as progress:
            return _in_workers(cfg, ranks, jobs, work, reporters, progress)
    return _in_workers(cfg, ranks, jobs, work, reporters, on_rank_done)


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """The CPUs this process may run on, the default of ``--jobs``: its CPU affinity (``taskset``, a cpuset, Slurm's
    binding), capped by the CPU bandwidth limit of its cgroup (``docker --cpus``, a Kubernetes CPU limit):
    ``os.cpu_count()`` counts the host's, and in a container given 2 of a host's 64 CPUs, 64 workers, each
    importing torch (~0.4 GB), would share those 2. What ``loky.cpu_count`` counts; loky itself is not imported
    for it, since importing it replaces ``multiprocessing.synchronize.SemLock._make_name`` in the importing process.
    """
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, NotImplementedError, OSError):  # not Linux
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    return max(1, n if limit is None else min(n, limit))


def cgroup_cpu_limit(
    cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
) -> int | None:
    """The tightest CPU bandwidth limit on this process's cgroup and its ancestors, in CPUs rounded up (quota /
    period: ``cpu.max`` of cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` of v1); None: no limit, or no
    cgroups. A container's own cgroup is its mount's root (a cgroup namespace, or the bind mount of v1), so the walk
    up from the path ``/proc/self/cgroup`` names stops there."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    root = Path(cgroup_root)
    limits: list[int] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: the unified hierarchy (at the root, or under unified/ on a hybrid host)
            mounts = [root if (root / "cgroup.controllers").exists() else root / "unified"]
            files = ("cpu.max",)
        elif "cpu" in controllers.split(","):
            mounts = [root / controllers, root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"]
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        for mount in dict.fromkeys(mounts):
            if mount.is_dir():
                limits += _limits_up_to(mount, path, files)
                break
    return min(limits, default=None)


def _limits_up_to(mount: Path, path: str, files: tuple[str, ...]) -> list[int]:
    out = []
    here = mount / path.lstrip("/")
    while True:
        try:
            values = " ".join(here.joinpath(f).read_text() for f in files).split()
        except OSError:
            values = []
        if len(values) == 2 and values[0] not in ("max", "-1"):
            quota, period = int(values[0]), int(values[1])
            if quota > 0 and period > 0:
                out.append(-(-quota // period))
        if here == mount or here == here.parent:
            return out
        here = here.parent


def _in_workers(
    cfg: JobConfig,
    ranks: list[int],
    jobs: int,
    work: tuple[bool, Execute | None, str],
    reporters: Sequence[str],
    on_rank_done: OnRankDone | None,
) -> list[RankOutcome]:
    import multiprocessing
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context(_START_METHOD)
    data = cfg.model_dump()
    reuse = work[1] is None  # the built-in dry run: see _worker
    metadata = {"mode": work[2], "world_size": cfg.world.world_size}
    waiting = list(ranks)
    running: dict[Any, tuple[int, Any]] = {}  # the pipe to a worker -> (the rank it runs, the process)
    outcomes: dict[int, RankOutcome] = {}
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                rank = waiting.pop(0)
                _start_worker(ctx, running, rank, (data, *work))
            for conn in wait(list(running)):
                rank, proc = running[conn]
                done = _receive(conn, proc, rank, metadata)
                if done.kind in _STOPPED:  # every worker, this one too, is killed below; nothing more written
                    raise _STOPPED[done.kind]()
                outcomes[rank] = _write(done, cfg.output_dir, reporters)
                if on_rank_done is not None:
                    on_rank_done(outcomes[rank], len(outcomes), len(ranks))
                if (
                    reuse
                    and waiting
                    and done.error is None
                    and not _warned(outcomes[rank])
                    and _give(conn, waiting[0])
                ):
                    running[conn] = (waiting.pop(0), proc)  # the same worker runs the next rank
                else:
                    _retire(conn, proc)
                    del running[conn]
    except BaseException:
        _kill(running)
        raise
    return [outcomes[r] for r in ranks]


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while a worker starts: the child inherits the mask, so a Ctrl-C cannot hit it before it
    ignores SIGINT, and here the signal arrives (not lost) once the worker is registered to be killed."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _start_worker(ctx: Any, running: dict[Any, tuple[int, Any]], rank: int, args: tuple) -> None:
    here, there = ctx.Pipe()
    proc = ctx.Process(
        target=_worker, args=(there, os.getpid(), rank, *args), name=f"hyperdryrun-worker-{rank}", daemon=True
    )
    try:
        with stop_signals_blocked():
            proc.start()
            running[here] = (rank, proc)
    except BaseException:
        here.close()
        raise
    finally:
        there.close()  # the worker holds the only other end: its death reads as end of file here, and ours there


def _receive(conn: Any, proc: Any, rank: int, metadata: dict[str, Any]) -> _Computed:
    """The answer of the worker running ``rank``; one that died first: reaped, its error report."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        conn.close()
        proc.join()
        return _died(rank, proc.exitcode, metadata)


def _warned(outcome: RankOutcome) -> bool:
    """Whether the rank's step raised warnings (its report's :data:`~hyperdryrun.trace.step.WARNED` limitations):
    torch logs some once per process (``warning_once``), so a next rank in the same worker would lack them."""
    from hyperdryrun.trace.step import WARNED

    return any(line.startswith(WARNED) for line in outcome.report.get("limitations", ()))


def _give(conn: Any, rank: int) -> bool:
    """Send a worker the next rank; False if it is gone."""
    try:
        conn.send(rank)
    except OSError:
        return False
    return True


def _retire(conn: Any, proc: Any) -> None:
    """Let a worker go (None for a next rank: it exits; one that exited already does not read it) and reap it."""
    with contextlib.suppress(OSError):
        conn.send(None)
    conn.close()
    proc.join()


def _kill(running: dict[Any, tuple[int, Any]]) -> None:
    """SIGKILL every running worker, then reap them: they write nothing, so nothing is left half-written."""
    for _, proc in running.values():
        with contextlib.suppress(Exception):
            proc.kill()
    for conn, (_, proc) in running.items():
        proc.join()
        conn.close()
    running.clear()


def _worker(
    conn: Any,
    parent_pid: int,
    rank: int,
    data: dict[str, Any],
    capture_stacks: bool,
    execute: Execute | None,
    mode: str,
) -> None:
    """A worker process: run ``rank`` of the job ``data`` and send its report back (it never writes a file); then,
    for the built-in dry run (``execute`` None), each further rank the parent sends, until it sends None or closes
    the pipe. A rank after the first finds torch imported and its caches warm (the fake-tensor dispatch cache,
    DTensor's sharding propagation) and writes the bytes a fresh process writes (``tests/test_runner.py``,
    ``tests/test_determinism.py``): a simulation leaves the process's globals as it found them. But for torch's
    once-per-process warnings: after a rank whose step warned (:func:`_warned`), as after a failed rank, the parent
    retires the worker. A measured rank or a front door's own code (``execute``) gets a process of its own: a real
    device's caching allocator keeps what an earlier rank reserved, and a user's code may keep state of its own."""
    from hyperdryrun.startup import import_torch_stack, owned_process

    bind_to_parent(parent_pid)
    with owned_process():
        while True:
            try:
                from hyperdryrun.config import build_config

                import_torch_stack()
                one = build_config({**data, "world": {**data["world"], "rank": rank}})
                done = _simulate(one, capture_stacks, execute, mode)
                if done.result is not None:
                    done.result.trace = None  # the parent writes from the report and the CSV
            except (BrokenPipeError, KeyboardInterrupt) as err:  # as in the parent's own process: 141, 130
                done = _Computed(rank, None, f"rank {rank}: {type(err).__name__}", type(err).__name__)
            except Exception as err:
                done = _Computed(
                    rank, None, one_line(f"rank {rank}: {type(err).__name__}: {err}"), error_kind(err)
                )
                done.traceback = _formatted(err)
            try:
                conn.send(done)
                rank = conn.recv() if execute is None else None
            except (EOFError, OSError):
                rank = None
            if rank is None:
                break
    conn.close()
    from hyperdryrun.compat.process import end_worker

    end_worker()


def bind_to_parent(parent_pid: int) -> None:
    """In a worker process: ignore Ctrl-C (the parent stops the run) and die with the parent, then let the signals
    the parent held while it started (:func:`stop_signals_blocked`) in."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not _die_with_parent():
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    if os.getppid() != parent_pid:  # it died before the line above took effect
        os._exit(1)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def _die_with_parent() -> bool:
    """Linux: the kernel sends this process SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)
