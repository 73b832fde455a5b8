"""The events -> blocks core, on hand-worked allocation sequences."""

from __future__ import annotations

import csv
import io

import pytest

from hyperdryrun.ingest.events import AllocEvent, normalize_device, same_device, trace_from_events
from hyperdryrun.report import blocks_csv, build_report
from hyperdryrun.trace.blocks import PERSISTENT_END, Category, Phase, live_bytes_by_task


def ev(t, key, nbytes, op="", op_id=None, **kw):
    return AllocEvent(time_ns=t, key=key, nbytes=nbytes, op=op, op_id=op_id, **kw)


def test_tasks_follow_ops_and_frees_end_at_next_task():
    # op1 allocates a (100) and b (50); op2 allocates c (30) and frees a; free of b between ops; op3 allocates d.
    events = [
        ev(1, "a", 100, "mm", 1),
        ev(2, "b", 50, "mm", 1),
        ev(3, "c", 30, "add", 2),
        ev(4, "a", -100, "add", 2),
        ev(5, "b", -50),
        ev(6, "d", 10, "relu", 3),
    ]
    tr = trace_from_events(events)
    assert tr.task_op == ["mm", "add", "relu"]
    a, b, c, d = tr.blocks
    assert (a.start, a.end, b.start, b.end) == (0, 2, 0, 2)
    assert (c.start, c.end, d.start, d.end) == (1, PERSISTENT_END, 2, PERSISTENT_END)
    # live: task0 150, task1 180 (a freed after c was allocated), task2 40
    assert live_bytes_by_task(tr.blocks, tr.num_tasks) == [150, 180, 40]
    assert (tr.peak, tr.peak_task, tr.current, tr.initial) == (180, 1, 40, 0)
    assert [blk.used_after_alloc for blk in tr.blocks] == [100, 150, 180, 40]


def test_free_then_alloc_inside_one_op_splits_the_task_so_the_peak_is_exact():
    # One op: scratch 64 allocated, freed, then output 32: the real peak is 64, not 96.
    events = [ev(1, "s", 64, "conv", 7), ev(2, "s", -64, "conv", 7), ev(3, "o", 32, "conv", 7)]
    tr = trace_from_events(events)
    assert tr.task_op == ["conv", "conv"]
    assert live_bytes_by_task(tr.blocks, tr.num_tasks) == [64, 32]
    assert tr.peak == 64 and tr.peak_task == 0


def test_a_kernels_scratch_event_makes_a_block_marked_scratch_and_nothing_else_is():
    events = [
        ev(1, "s", 64, "mm", 7, scratch=True),
        ev(2, "s", -64, "mm", 7),
        ev(3, "o", 32, "mm", 7),
        ev(4, "t", 16, "add", 8),
    ]
    tr = trace_from_events(events)
    assert [(blk.requested, blk.scratch) for blk in tr.blocks] == [(64, True), (32, False), (16, False)]


def test_residents_and_storages_freed_before_being_seen_are_initialization_blocks():
    param = ev(0, "w", 400, category=Category.PARAMETER, module="lin")
    events = [ev(5, "old_grad", -80), ev(6, "x", 20, "mul", 1)]
    tr = trace_from_events(events, resident=[param])
    w, old, x = tr.blocks
    assert (w.phase, w.category, w.module, w.persistent, w.op) == (
        Phase.INITIALIZATION,
        Category.PARAMETER,
        "lin",
        True,
        "initialization",
    )
    assert (old.phase, old.category, old.size, old.start, old.end) == (
        Phase.INITIALIZATION,
        Category.OTHER,
        80,
        0,
        0,
    )
    assert tr.initial == 480
    assert (tr.peak, tr.current) == (420, 420)


def test_default_categories_follow_the_phase_like_the_dry_run():
    events = [
        ev(1, "a", 8, "mm", 1, phase=Phase.FORWARD),
        ev(2, "b", 8, "mm", 2, phase=Phase.BACKWARD),
        ev(3, "c", 8, "mm", 3, phase=Phase.OPTIMIZER),
        ev(4, "d", 8, "mm", 4, phase=Phase.BACKWARD, category=Category.GRADIENT),
    ]
    cats = [blk.category for blk in trace_from_events(events).blocks]
    assert cats == [Category.ACTIVATION, Category.TEMP, Category.TEMP, Category.GRADIENT]


def test_reused_key_without_a_free_closes_the_old_block():
    tr = trace_from_events([ev(1, 0xA0, 16, "x", 1), ev(2, 0xA0, 24, "y", 2)])
    first, second = tr.blocks
    assert first.end == 1 and second.start == 1 and tr.current == 24 and tr.peak == 24


def test_alignment_rounds_sizes_and_keeps_requested_bytes():
    tr = trace_from_events([ev(1, "a", 100, "x", 1)], alignment=512)
    assert (tr.blocks[0].size, tr.blocks[0].requested, tr.peak) == (512, 100, 512)


def test_events_are_ordered_by_time_and_filtered_by_device():
    events = [
        ev(3, "b", 5, "y", 2, device="cuda:0"),
        ev(1, "a", 7, "x", 1, device="cuda:0"),
        ev(2, "h", 999, "x", 1, device="cpu"),
    ]
    tr = trace_from_events(events, device="cuda")
    assert [blk.requested for blk in tr.blocks] == [7, 5]


def test_device_names_are_normalised():
    assert normalize_device("PrivateUse1:1") == "npu:1"
    assert normalize_device("privateuseone") == "npu"
    assert same_device("cuda:1", "cuda") and not same_device("cuda:1", "cuda:0")


def test_reports_have_the_dry_run_schema_and_stacks():
    frames = (("model.py", 12, "forward"), ("train.py", 3, "step"))
    tr = trace_from_events(
        [ev(1, "a", 100, "mm", 1, frames=frames, module="layers.0"), ev(2, "a", -100)],
        metadata={"mode": "measured"},
    )
    report = build_report(tr)
    assert report["metadata"]["mode"] == "measured"
    assert report["summary"]["peak_bytes"] == 100
    assert report["peak_live_set"]["blocks"][0]["stack"][0] == {
        "file": "model.py",
        "line": 12,
        "function": "forward",
    }
    rows = list(csv.DictReader(io.StringIO(blocks_csv(tr))))
    assert (
        rows[0]["python_stack"] == "File:model.py;Line:12;Function:forward|File:train.py;Line:3;Function:step"
    )
    assert rows[0]["graph_name"] == "layers.0" and rows[0]["end_time_stamp"] == "1"


def test_duplicate_residents_are_rejected():
    with pytest.raises(ValueError, match="listed twice"):
        trace_from_events([], resident=[ev(0, "w", 4), ev(0, "w", 4)])


def test_empty_window_has_no_tasks_and_the_resident_bytes_as_peak():
    tr = trace_from_events([], resident=[ev(0, "w", 4)])
    assert (tr.num_tasks, tr.peak, tr.peak_task, tr.current) == (0, 4, -1, 4)
