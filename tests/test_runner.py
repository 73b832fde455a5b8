"""The library runner: one rank here or many in workers, reports written by this process as each rank finishes.

Most cases use an executor that returns an ingested profiler trace (tests/ingest/fixtures), so a worker costs its
start-up only; one case runs the real dry run in workers and in this process and compares the files byte by byte.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from hyperdryrun.config import build_config
from hyperdryrun.engine import SimulationError
from hyperdryrun.runner import BAD_INPUT, INTERNAL, run_rank, run_ranks
from hyperdryrun.world.values import ValueRuleError

FIXTURE = Path(__file__).parent / "ingest" / "fixtures" / "tiny_step.trace.json.gz"


def job(tmp_path: Path, world_size: int = 2, **training) -> object:
    return build_config(
        {
            "model": {"name": "llama-tiny"},
            "world": {"world_size": world_size},
            "training": {"seq_len": 32, **training},
            "output_dir": str(tmp_path / "out"),
        }
    )


# Executors: module level, so a spawned worker imports them by name.


def fixture_trace(cfg, capture_stacks=True):
    """A real (ingested) trace, labelled with the rank asked for."""
    from hyperdryrun.report.reader import load_any

    trace = load_any(FIXTURE)
    trace.metadata = {**trace.metadata, "rank": cfg.world.rank}
    return trace


def slow_on_rank_1(cfg, capture_stacks=True):
    if cfg.world.rank == 1:
        time.sleep(120)
    return fixture_trace(cfg)


def plain_bug(cfg, capture_stacks=True):
    raise RuntimeError("a bug in the step")


def missing_value_rule(cfg, capture_stacks=True):
    raise SimulationError("step", ValueRuleError("aten.nonzero in module 'pick': add a rule"))


def dies(cfg, capture_stacks=True):
    os.kill(os.getpid(), signal.SIGKILL)


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def pair(rank: int, segments: bool = True) -> set[str]:
    """A rank's files: the JSON and its block CSV, and for a cuda dry run the allocator model's segment CSV (an
    ingested trace has none)."""
    names = ("memory.json", "memory.csv") + (("segments.csv",) if segments else ())
    return {f"rank_{rank}/rank_{rank}_{name}" for name in names}


def test_workers_write_the_same_bytes_as_this_process(tmp_path):
    # without stacks: in this process a block's stack also holds the caller's frames (this test), in a worker not
    cfg = job(tmp_path)
    calls = []

    def record(outcome, done, total):
        calls.append((outcome.rank, done, total))

    outcomes = run_ranks(cfg, [1, 0], jobs=2, capture_stacks=False, on_rank_done=record)
    assert [o.rank for o in outcomes] == [1, 0]
    assert sorted(c[1:] for c in calls) == [(1, 2), (2, 2)] and {c[0] for c in calls} == {0, 1}
    for o in outcomes:
        assert o.error is None and o.trace is None and o.report["metadata"]["rank"] == o.rank
        d = tmp_path / "out" / f"rank_{o.rank}"
        assert o.paths == [
            str(d / f"rank_{o.rank}_{n}") for n in ("memory.json", "memory.csv", "segments.csv")
        ]
    many = files(tmp_path / "out")
    assert set(many) == pair(0) | pair(1)
    for rank in (0, 1):
        one = run_rank(
            build_config({**cfg.model_dump(), "world": {"world_size": 2, "rank": rank}}), capture_stacks=False
        )
        assert one.trace is not None and one.report == outcomes[[1, 0].index(rank)].report
        for p in pair(rank):
            assert (tmp_path / "out" / p).read_bytes() == many[p]
        assert one.report == json.loads(many[f"rank_{rank}/rank_{rank}_memory.json"])  # the report as written


def test_reporters_none_writes_nothing_and_still_returns_the_reports(tmp_path):
    cfg = job(tmp_path)
    (inline,) = [run_rank(cfg, execute=fixture_trace, reporters=())]
    (worker,) = run_ranks(cfg, [1], execute=fixture_trace, reporters=())
    assert inline.paths == worker.paths == []
    assert inline.report["summary"]["peak_bytes"] == worker.report["summary"]["peak_bytes"] > 0
    assert not (tmp_path / "out").exists()


def test_a_bug_in_a_worker_is_an_internal_error_with_its_traceback_and_no_file(tmp_path):
    (o,) = run_ranks(job(tmp_path), [1], execute=plain_bug)
    assert o.error == "rank 1: RuntimeError: a bug in the step" and o.error_kind == INTERNAL
    assert "in plain_bug" in o.traceback and o.report == {} and o.paths == []
    assert not (tmp_path / "out").exists()


def test_a_missing_value_rule_is_bad_input_that_keeps_the_earlier_report(tmp_path):
    # issue 23: bad input (the user's to fix) writes no error report, so a good report of an earlier run stays
    path = tmp_path / "out" / "rank_0" / "rank_0_memory.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"earlier": true}\n')
    (o,) = run_ranks(job(tmp_path), [0], execute=missing_value_rule)
    assert o.error_kind == BAD_INPUT
    assert o.error == "rank 0: step failed: ValueRuleError: aten.nonzero in module 'pick': add a rule"
    assert o.report["status"] == "error" and o.paths == []
    assert set(files(tmp_path / "out")) == {"rank_0/rank_0_memory.json"}
    assert path.read_text() == '{"earlier": true}\n'


def test_a_worker_that_dies_is_an_internal_error(tmp_path):
    (o,) = run_ranks(job(tmp_path), [0], execute=dies)
    path = tmp_path / "out" / "rank_0" / "rank_0_memory.json"
    assert o.error == (
        "rank 0: the simulation process was killed by SIGKILL (signal 9) (out of host memory, or killed from "
        f"outside) (report: {path})"
    )
    assert o.error_kind == INTERNAL
    assert o.traceback is None  # nothing to show with --debug: the command line does not offer it
    # the parent, which saw it die, writes the error report naming the signal
    report = json.loads(path.read_text())
    assert (report["status"], report["stage"], report["error"]["type"]) == (
        "error",
        "simulation",
        "ChildDied",
    )
    assert "SIGKILL" in report["error"]["message"] and report["metadata"]["rank"] == 0


def test_an_internal_failure_keeps_an_earlier_good_report_and_writes_its_error_report_beside(tmp_path):
    # issue 30: no good file is replaced by something else (an error report went over the good JSON)
    (good,) = run_ranks(job(tmp_path), [0], execute=fixture_trace)
    before = files(tmp_path / "out")
    (o,) = run_ranks(job(tmp_path), [0], execute=dies)
    beside = tmp_path / "out" / "rank_0" / "rank_0_error.json"
    assert o.error_kind == INTERNAL and o.paths == [str(beside)] and o.error.endswith(f"(report: {beside})")
    assert json.loads(beside.read_text())["error"]["type"] == "ChildDied"
    after = files(tmp_path / "out")
    assert after.pop("rank_0/rank_0_error.json") and after == before


def test_a_callback_that_raises_stops_every_worker_and_nothing_more_is_written(tmp_path):
    def stop(outcome, done, total):
        raise KeyboardInterrupt

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_ranks(job(tmp_path), [0, 1], jobs=2, execute=slow_on_rank_1, on_rank_done=stop)
    assert time.monotonic() - started < 60  # rank 1 sleeps 120 s: it was killed, not waited for
    assert multiprocessing.active_children() == []
    # rank 0 was written before the callback ran; rank 1 never
    assert set(files(tmp_path / "out")) == pair(0, segments=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ranks": [0, 2]}, "ranks: rank 2 must satisfy 0 <= rank < world_size=2"),
        ({"ranks": [1, 1]}, "ranks: rank 1 is given twice (in [1, 1])"),
        ({"ranks": [0], "jobs": 0}, "jobs: must be >= 1 (got 0)"),
        (
            {"ranks": [0], "reporters": ["json", "pdf"]},
            "reporters: unknown reporter 'pdf' (known: csv, json)",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors_before_any_worker_starts(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as info:
        run_ranks(job(tmp_path), **kwargs)
    assert str(info.value) == message
    assert multiprocessing.active_children() == [] and not (tmp_path / "out").exists()


def test_progress_is_silent_when_stderr_is_not_a_terminal(tmp_path, capfd):
    run_ranks(job(tmp_path), [0], execute=fixture_trace)
    assert capfd.readouterr().err == ""


def test_a_dry_run_worker_runs_rank_after_rank_with_the_bytes_of_a_fresh_process(tmp_path, monkeypatch):
    """The built-in dry run: one worker (``jobs=1``) takes the three ranks one after the other (one process
    started), and each rank's files are byte for byte those of the rank alone in a fresh worker. Two pipeline
    stages and two data-parallel ranks: the second rank finds the first's caches warm, the third another stage."""
    from hyperdryrun import runner

    cfg = build_config(
        {
            "model": {"name": "llama-tiny"},
            "world": {"world_size": 4},
            "parallel": {"pp": 2, "dp_shard": 2},
            "training": {"seq_len": 32, "num_micro_batches": 2},
            "output_dir": str(tmp_path / "together"),
        }
    )
    starts = []
    start = runner._start_worker
    monkeypatch.setattr(runner, "_start_worker", lambda *a: starts.append(a[2]) or start(*a))
    together = run_ranks(cfg, [3, 0, 1], jobs=1, capture_stacks=False)
    assert starts == [3] and [o.error for o in together] == [None] * 3
    for rank in (3, 0, 1):
        alone = build_config({**cfg.model_dump(), "output_dir": str(tmp_path / f"alone_{rank}")})
        (outcome,) = run_ranks(alone, [rank], jobs=1, capture_stacks=False)
        assert outcome.error is None
        theirs = files(tmp_path / f"alone_{rank}")
        assert theirs and theirs == {p: b for p, b in files(tmp_path / "together").items() if p in theirs}
    assert starts == [3, 3, 0, 1]  # (each alone: a worker of its own)
    assert set(files(tmp_path / "together")) == pair(3) | pair(0) | pair(1)


def _pid_unless_rank_1(cfg, capture_stacks, execute, mode):
    """The worker's ``_simulate`` in the test below (a forked worker keeps this test's patch): rank 1 fails, rank 3's
    step warned, every rank says which process ran it."""
    from hyperdryrun.report.reporters import RankReport
    from hyperdryrun.runner import _Computed

    rank = cfg.world.rank
    if rank == 1:
        return _Computed(rank, None, "rank 1: RuntimeError: a bug", INTERNAL, str(os.getpid()))
    limitations = ["warned during the simulated step (1 time): UserWarning: once"] if rank == 3 else []
    return _Computed(rank, RankReport(rank, {"limitations": limitations}), None, None, str(os.getpid()))


@pytest.mark.parametrize("execute", [None, fixture_trace], ids=["dry-run", "own-execute"])
def test_a_failed_or_warned_rank_retires_its_worker_and_an_own_execute_gets_a_process_per_rank(
    tmp_path, monkeypatch, execute
):
    from hyperdryrun import runner

    monkeypatch.setattr(runner, "_START_METHOD", "fork")  # the worker keeps the patch below
    monkeypatch.setattr(runner, "_simulate", _pid_unless_rank_1)
    outcomes = run_ranks(
        job(tmp_path, world_size=6), [0, 1, 2, 3, 4, 5], jobs=1, execute=execute, reporters=()
    )
    assert [o.error is not None for o in outcomes] == [False, True, False, False, False, False]
    pid = [o.traceback for o in outcomes]
    if (
        execute is None
    ):  # 0 and 1 in one worker; after 1 failed, 2 and 3 in a new one; after 3 warned, 4 and 5
        assert pid[0] == pid[1] != pid[2] == pid[3] != pid[4] == pid[5] and pid[0] != pid[4]
    else:
        assert len(set(pid)) == 6
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_a_compiled_job_warns_once_per_process_so_its_worker_retires(tmp_path, monkeypatch):
    """torch logs some compile warnings once per process (``warning_once``): the second rank of a worker would lack
    them in its report's limitations. Each rank of a compiled job gets its own worker, and each rank's files are
    those of the rank alone (seen: rank 4's JSON lacked two "warned during the simulated step" lines)."""
    from hyperdryrun import runner

    cfg = build_config(
        {
            "model": {"name": "llama-tiny"},
            "world": {"world_size": 4},
            "parallel": {"pp": 2, "dp_shard": 2},
            "training": {"seq_len": 32, "num_micro_batches": 2, "compile": True},
            "output_dir": str(tmp_path / "together"),
        }
    )
    starts = []
    start = runner._start_worker
    monkeypatch.setattr(runner, "_start_worker", lambda *a: starts.append(a[2]) or start(*a))
    together = run_ranks(cfg, [0, 2], jobs=1, capture_stacks=False)
    assert [o.error for o in together] == [None, None] and starts == [0, 2]
    assert any(x.startswith("warned during the simulated step") for x in together[0].report["limitations"])
    (alone,) = run_ranks(
        build_config({**cfg.model_dump(), "output_dir": str(tmp_path / "alone")}),
        [2],
        jobs=1,
        capture_stacks=False,
    )
    assert files(tmp_path / "alone") == {
        p: b for p, b in files(tmp_path / "together").items() if "rank_2/" in p
    }
