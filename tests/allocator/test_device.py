"""Allocated, reserved and device bytes of a hand-worked sequence, and the verdict against capacities around it.

Sequence (sizes 512-rounded; the rules of c10/cuda/CUDACachingAllocator.cpp as tests/allocator works them):
  task 0  P   4 MiB on stream 0, kept        no cached block: a 20 MiB large segment, split     reserved 20 MiB
  task 1  S   512 B on stream 3, freed at 3  small pool of stream 3: a 2 MiB segment            reserved 22 MiB
  task 2  W   8 MiB cuBLAS workspace, s0     best fit: P's 16 MiB remainder, split (8 > 1 MiB)   reserved 22 MiB
  task 3  S freed                            back to stream 3's small pool (no other stream's)
  task 4  Q   1 KiB on stream 0, kept        stream 0 has no small segment: a new 2 MiB one      reserved 24 MiB
Live tensor bytes peak at task 4: P + Q = 4 MiB + 1 KiB. Outside the allocator: NCCL 10 MiB, context 6 MiB.
That is step 1 (P from before it, W made in it; Q is freed at its end, since step 2 starts with what was alive
before it). The step itself, step 2, runs on that cache: S and Q reuse the small segments, reserved stays 24 MiB;
its allocated peak is P + W + Q at task 4 and its reserved peak is read there (the most allocated at 24 MiB).
"""

from __future__ import annotations

import pytest

from hyperdryrun.allocator import AllocatorOptions, OutsideCost, Workspace, device_memory
from hyperdryrun.allocator.device import ALLOCATOR, CACHED, TENSORS, UNSPLIT, WORKSPACES
from hyperdryrun.trace.blocks import PERSISTENT_END, Block, Phase

MIB = 1 << 20


def block(i: int, size: int, start: int, end: int, stream: int, phase: Phase = Phase.FORWARD) -> Block:
    return Block(
        id=i, size=size, requested=size, start=start, end=end, op="op", phase=phase, module="", stack_id=0,
        stream=stream,
    )  # fmt: skip


BLOCKS = [
    block(0, 4 * MIB, 0, PERSISTENT_END, 0, Phase.INITIALIZATION),
    block(1, 512, 1, 3, 3),
    block(2, 1024, 4, PERSISTENT_END, 0),
]
TENSOR_PEAK = 4 * MIB + 1024
WORKSPACE = [Workspace("cuBLAS workspace (main thread)", stream=0, task=2, size=8 * MIB)]
OUTSIDE = [
    OutsideCost("NCCL buffers", 10 * MIB, "estimate"),
    OutsideCost("CUDA context", 6 * MIB, "configured"),
]


def run(capacity: int | None = None, options: AllocatorOptions | None = None):
    return device_memory(BLOCKS, TENSOR_PEAK, WORKSPACE, OUTSIDE, options, capacity)


def test_the_three_figures_follow_the_hand_worked_segments():
    dm = run()
    assert dm.peak_allocated == 4 * MIB + 8 * MIB + 1024  # P, W, Q: what max_memory_allocated counts
    assert dm.peak_reserved == 24 * MIB
    assert dm.peak_device == 24 * MIB + 16 * MIB
    assert dm.fragmentation == 24 * MIB - (12 * MIB + 1024)
    assert dm.oom is None and dm.tipping_line() is None


def test_the_reserved_peak_by_cause_adds_up_and_shows_the_side_stream_pool():
    rows = run().breakdown()
    got = {(r["cause"], r["stream"], r["pool"]): r["bytes"] for r in rows}
    assert got == {
        (TENSORS, None, None): 4 * MIB + 1024,
        (UNSPLIT, None, None): 0,
        (WORKSPACES, None, None): 8 * MIB,
        (CACHED, 0, "large"): 8 * MIB,  # what is left of P's segment
        (CACHED, 0, "small"): 2 * MIB - 1024,
        (CACHED, 3, "small"): 2 * MIB,  # S's segment: free, but no use to stream 0
    }
    assert sum(got.values()) == 24 * MIB


def test_segments_by_pool_and_stream():
    assert [
        (r["stream"], r["pool"], r["segments"], r["bytes"], r["allocated_bytes"]) for r in run().pools()
    ] == [
        (0, "large", 1, 20 * MIB, 12 * MIB),
        (0, "small", 1, 2 * MIB, 1024),
        (3, "small", 1, 2 * MIB, 0),
    ]


def test_the_lines_add_up_to_the_device_peak_in_verdict_order():
    lines = run().lines()
    assert [(r["line"], r["bytes"]) for r in lines] == [
        (TENSORS, 4 * MIB + 1024),
        (WORKSPACES, 8 * MIB),
        (ALLOCATOR, 24 * MIB - 4 * MIB - 1024 - 8 * MIB),
        ("NCCL buffers", 10 * MIB),
        ("CUDA context", 6 * MIB),
    ]
    assert sum(r["bytes"] for r in lines) == 40 * MIB


def test_exactly_the_device_peak_fits():
    dm = run(capacity=40 * MIB)
    assert dm.oom is None and dm.peak_device == 40 * MIB and dm.replay.alloc_retries == 0


def test_one_byte_less_fits_by_releasing_the_side_streams_cached_segment():
    # 24 MiB - 1 B to the allocator. Step 1: Q needs a 2 MiB segment with 22 MiB reserved: release_cached_blocks
    # frees stream 3's unsplit 2 MiB segment (S freed at 3; P's is split) and the retry fits (22 MiB). Step 2, on
    # that cache: S needs a stream-3 segment again (24 MiB - 1 B is too little): stream 0's small segment, Q's of
    # step 1 freed at its end, is released (22 MiB); then Q needs one and stream 3's, S freed, goes (22 MiB).
    dm = run(capacity=40 * MIB - 1)
    assert dm.oom is None
    assert dm.replay.alloc_retries == 3
    assert dm.peak_reserved == 22 * MIB and dm.peak_device == 38 * MIB


def test_a_job_that_fits_in_allocated_bytes_but_not_in_device_bytes_is_oom_and_names_the_line():
    capacity = (
        37 * MIB
    )  # 21 MiB for the allocator: S's segment would make 22 MiB, and nothing can be released
    dm = run(capacity=capacity)
    assert dm.peak_allocated < capacity < dm.peak_device
    assert dm.oom is not None
    assert (dm.oom.task, dm.oom.block, dm.oom.alloc_size, dm.oom.reserved) == (1, 1, 2 * MIB, 20 * MIB)
    # running totals: 4 MiB + 1 KiB, 12 MiB + 1 KiB, 24, 34, 40 MiB: the CUDA context crosses 37 MiB
    assert dm.tipping_line() == "CUDA context"
    assert (
        dm.peak_reserved == 24 * MIB
    )  # the figures are what the step would need (the replay without capacity)


def test_with_nothing_outside_the_caching_allocator_itself_tips_it():
    dm = device_memory(BLOCKS, TENSOR_PEAK, WORKSPACE, [], None, capacity=20 * MIB)
    assert (
        dm.tipping_line() == ALLOCATOR
    )  # 12 MiB + 1 KiB of tensors and workspace fit; 24 MiB reserved do not


def test_expandable_segments_map_only_the_pages_needed():
    # large pool pages of 20 MiB (large_segment_size): P maps one page and W fits in it; small pool pages of 2 MiB
    dm = run(options=AllocatorOptions.parse("expandable_segments:True"))
    assert dm.peak_reserved == 20 * MIB + 2 * MIB + 2 * MIB
    assert sum(r["bytes"] for r in dm.breakdown()) == dm.peak_reserved
    assert all(seg.expandable for seg in dm.segments)


@pytest.mark.parametrize("capacity", [None, 40 * MIB, 40 * MIB - 1, 37 * MIB])
def test_every_breakdown_adds_up_to_its_reserved_peak(capacity):
    dm = run(capacity=capacity)
    assert sum(r["bytes"] for r in dm.breakdown()) == dm.peak_reserved
    assert sum(seg.size for seg in dm.segments) == dm.peak_reserved


def test_every_workspace_is_allocated_before_a_steady_state_step_so_an_early_peak_holds_them_all():
    # The traced step is step 2 on: each cuBLAS handle's workspace (the forward thread's, at its first matmul, and
    # the autograd thread's, at the first backward matmul) was made in step 1 and kept. A peak at task 1, before
    # the autograd thread's first matmul of the step (task 5), holds both: 6 MiB of tensors + 2 x 1 MiB. (On an
    # H200 the README's first command peaks in the loss backward, before that matmul, and max_memory_allocated
    # counted both 32 MiB workspaces: ../shared/gpu, p1.)
    blocks = [
        block(0, 4 * MIB, 0, PERSISTENT_END, 0, Phase.INITIALIZATION),
        block(1, 2 * MIB, 1, 2, 0),
        block(2, 512, 6, PERSISTENT_END, 0),
    ]
    ws = [Workspace("main", 0, 0, MIB), Workspace("autograd", 0, 5, MIB)]
    dm = device_memory(blocks, 6 * MIB, ws, [], AllocatorOptions())
    assert dm.peak_allocated == 6 * MIB + 2 * MIB
