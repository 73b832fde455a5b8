"""The allocator stage over blocks: event order from block lifetimes, the replay result, bad input."""

from __future__ import annotations

import pytest

from hyperdryrun.allocator import (
    AllocatorEvent,
    AllocatorEventError,
    AllocatorOptions,
    events_from_blocks,
    replay,
)
from hyperdryrun.trace.blocks import PERSISTENT_END, Block, Phase
from tests.conftest import dry_run

MiB = 1 << 20


class StreamBlock(Block):
    """A block with the stream attributes another branch adds to ``Block``."""


def block(
    id: int, requested: int, start: int, end: int = PERSISTENT_END, phase: Phase = Phase.FORWARD, **extra
) -> Block:
    b = (StreamBlock if extra else Block)(
        id=id,
        size=requested,
        requested=requested,
        start=start,
        op="op",
        phase=phase,
        module="",
        stack_id=0,
        end=end,
    )
    for name, value in extra.items():
        setattr(b, name, value)
    return b


def test_events_follow_the_block_lifetimes_frees_first_within_a_task():
    blocks = [
        block(0, 100, start=0, end=4),  # an activation of task 0
        block(1, 300, start=0, phase=Phase.INITIALIZATION),  # a parameter: before the step
        block(2, 200, start=2, end=3),
        block(3, 50, start=3),
        block(4, 70, start=2, end=3),
        block(5, 0, start=1, end=2),  # zero bytes: the allocator hands out nothing
    ]
    got = [(e.kind, e.block, e.task) for e in events_from_blocks(blocks)]
    assert got == [
        ("alloc", 1, 0),  # before the step, first
        ("alloc", 0, 0),
        ("alloc", 2, 2),
        ("alloc", 4, 2),
        ("free", 2, 3),  # frees ending at task 3 before its allocations, ties by block id
        ("free", 4, 3),
        ("alloc", 3, 3),
        ("free", 0, 4),
    ]
    sizes = {e.block: e.size for e in events_from_blocks(blocks) if e.kind == "alloc"}
    assert sizes == {0: 100, 1: 300, 2: 200, 3: 50, 4: 70}  # requested bytes, the model rounds


def test_events_take_the_streams_blocks_carry():
    blocks = [block(0, 5 * MiB, start=0, end=2, stream=1, use_streams={0}), block(1, 5 * MiB, start=1)]
    alloc0, alloc1, free0 = events_from_blocks(blocks)
    assert (alloc0.stream, alloc1.stream) == (1, 0)
    assert free0.kind == "free" and free0.use_streams == frozenset({0})
    # Stream 1's 20 MiB segment cannot serve block 1 on stream 0: 40 MiB.
    assert replay(events_from_blocks(blocks)).peak_reserved == 40 * MiB


def test_a_block_that_ends_before_it_starts_is_an_error():
    with pytest.raises(AllocatorEventError, match=r"^block 7: end must be after start 3 \(got 3\)$"):
        events_from_blocks([block(7, 100, start=3, end=3)])


@pytest.mark.parametrize(
    ("events", "message"),
    [
        (
            [AllocatorEvent("alloc", 1, size=10), AllocatorEvent("alloc", 1, size=10)],
            r"^allocator event 1: block 1 is allocated twice$",
        ),
        ([AllocatorEvent("free", 4)], r"^allocator event 0: block 4 is freed but not allocated$"),
    ],
)
def test_an_impossible_sequence_is_an_error_naming_the_event(events, message):
    with pytest.raises(AllocatorEventError, match=message):
        replay(events)


def test_an_event_with_a_bad_field_is_an_error():
    with pytest.raises(AllocatorEventError, match=r"kind: must be alloc, free or sync \(got 'malloc'\)"):
        AllocatorEvent("malloc", 0)
    with pytest.raises(AllocatorEventError, match=r"size: must be >= 0 \(got -1\)"):
        AllocatorEvent("alloc", 0, size=-1)


def test_the_replay_reports_the_peak_when_and_its_segments():
    # 5 MiB (task 0) -> 20 MiB segment; 16 MiB (task 1) -> 16 MiB segment: peak 36 MiB at event 1, task 1; freed
    # at task 2: cached, still 36 MiB reserved, 5 MiB allocated.
    events = [
        AllocatorEvent("alloc", 0, size=5 * MiB, task=0),
        AllocatorEvent("alloc", 1, size=16 * MiB, task=1),
        AllocatorEvent("free", 1, task=2),
    ]
    r = replay(events)
    assert (r.tasks, r.reserved, r.allocated) == (
        [0, 1, 2],
        [20 * MiB, 36 * MiB, 36 * MiB],
        [5 * MiB, 21 * MiB, 5 * MiB],
    )
    assert (r.peak_reserved, r.peak_event, r.peak_task, r.allocated_at_peak) == (36 * MiB, 1, 1, 21 * MiB)
    assert r.fragmentation == 15 * MiB
    assert r.peak_allocated == 21 * MiB
    assert [(s.size, s.allocated, [b.block for b in s.blocks]) for s in r.segments_at_peak] == [
        (20 * MiB, 5 * MiB, [0, None]),
        (16 * MiB, 16 * MiB, [1]),
    ]
    assert r.oom is None


def test_an_empty_replay_reserves_nothing():
    r = replay([])
    assert (r.peak_reserved, r.peak_event, r.segments_at_peak, r.oom) == (0, -1, [], None)


def test_a_dry_run_replays_with_reserved_bytes_covering_the_live_bytes():
    trace = dry_run(world__world_size=2)
    events = events_from_blocks(trace.blocks)
    assert sum(e.kind == "alloc" for e in events) == sum(b.requested > 0 for b in trace.blocks)
    for conf in ("", "expandable_segments:True"):
        r = replay(events, AllocatorOptions.parse(conf))
        assert r.oom is None
        # Every block the allocator hands out is at least the 512-rounded live size: at its peak task the trace
        # holds trace.peak bytes, so the allocator holds at least that, and reserves at least what it hands out.
        assert r.peak_allocated >= trace.peak
        assert all(res >= alloc for res, alloc in zip(r.reserved, r.allocated))
        assert r.peak_reserved >= r.peak_allocated
        assert sum(s.size for s in r.segments_at_peak) == r.peak_reserved
