"""Hand-worked allocation sequences: each expected byte count is derived in a comment from the C++ rules of
c10/cuda/CUDACachingAllocator.cpp (function named), not from the model."""

from __future__ import annotations

from hyperdryrun.allocator import AllocatorEvent, AllocatorOptions, CachingAllocatorModel, replay

KiB, MiB = 1 << 10, 1 << 20


def alloc(block: int, size: int, stream: int = 0, task: int = 0) -> AllocatorEvent:
    return AllocatorEvent("alloc", block, size=size, stream=stream, task=task)


def free(block: int, task: int = 0, uses: tuple[int, ...] = (), done: int | None = None) -> AllocatorEvent:
    return AllocatorEvent("free", block, task=task, use_streams=frozenset(uses), uses_done=done)


def run(*events: AllocatorEvent, conf: str = "", capacity: int | None = None):
    result = replay(events, AllocatorOptions.parse(conf), capacity)
    # The segments at the peak are exactly what is reserved then.
    assert sum(s.size for s in result.segments_at_peak) == result.peak_reserved
    return result


def layout(result) -> list[list[tuple[int, str]]]:
    """(size, state) of each block of each segment at the reserved peak (the first event that reaches it)."""
    return [[(b.size, b.state) for b in s.blocks] for s in result.segments_at_peak]


def end_layout(
    *events: AllocatorEvent, conf: str = "", capacity: int | None = None
) -> list[list[tuple[int, str]]]:
    """(size, state) of each block of each segment after the last event."""
    model = CachingAllocatorModel(AllocatorOptions.parse(conf), capacity)
    for ev in events:
        if ev.kind == "alloc":
            model.malloc(ev.block, ev.size, ev.stream, ev.task)
        else:
            model.free(ev.block, ev.use_streams, ev.uses_done, ev.task)
    return [[(b.size, b.state) for b in s.blocks] for s in model.segments()]


# ------------------------------------------------------------------ rounding and segment sizes
def test_a_100_byte_request_reserves_one_2_mib_small_segment():
    # round_size(100) = kMinBlockSize = 512; get_allocation_size(512 <= kSmallSize) = kSmallBuffer = 2 MiB;
    # should_split (small pool): remaining 2 MiB - 512 >= 512, so the rest stays a free block.
    r = run(alloc(0, 100))
    assert r.reserved == [2 * MiB]
    assert r.allocated == [512]
    assert layout(r) == [[(512, "allocated"), (2 * MiB - 512, "free")]]
    assert r.segments_at_peak[0].pool == "small"
    assert r.device_allocs == 1


def test_two_600_kib_requests_share_one_small_segment():
    # 600 KiB = 614400 is a multiple of 512. The first gets a new 2 MiB segment and splits it (free rest
    # 2097152 - 614400 = 1482752); get_free_block finds that rest for the second (best fit), which splits again
    # (1482752 - 614400 = 868352 >= 512): one segment, no second cudaMalloc.
    events = (alloc(0, 600 * KiB), alloc(1, 600 * KiB))
    r = run(*events)
    assert r.reserved == [2 * MiB, 2 * MiB]
    assert r.device_allocs == 1
    assert end_layout(*events) == [[(614400, "allocated"), (614400, "allocated"), (868352, "free")]]


def test_one_to_ten_mib_requests_get_a_20_mib_segment_and_larger_ones_their_size_rounded_to_2_mib():
    # 5 MiB: kSmallSize < 5 MiB < kMinLargeAlloc -> get_allocation_size = kLargeBuffer (large_segment_size) 20 MiB,
    # split (remaining 15 MiB > kSmallSize). 12 MiB: get_free_block finds the free 15 MiB rest (best fit) and
    # splits it (3 MiB > 1 MiB): still 20 MiB. 16 MiB: no free block that large -> a 16 MiB segment (>= 10 MiB:
    # rounded to kRoundLarge 2 MiB, already a multiple): 36 MiB.
    r = run(alloc(0, 5 * MiB), alloc(1, 12 * MiB), alloc(2, 16 * MiB))
    assert r.reserved == [20 * MiB, 20 * MiB, 36 * MiB]
    assert layout(r) == [
        [(5 * MiB, "allocated"), (12 * MiB, "allocated"), (3 * MiB, "free")],
        [(16 * MiB, "allocated")],
    ]


def test_a_request_over_10_mib_gets_a_segment_rounded_up_to_2_mib():
    # round_size(11 MiB + 1) = 11 MiB + 512; get_allocation_size: >= kMinLargeAlloc -> ceil to 2 MiB = 12 MiB.
    # should_split: remaining 1 MiB - 512 is not > kSmallSize, so the block is the whole 12 MiB.
    r = run(alloc(0, 11 * MiB + 1))
    assert r.reserved == [12 * MiB]
    assert r.allocated == [12 * MiB]
    assert layout(r) == [[(12 * MiB, "allocated")]]


def test_1_mib_is_small_and_one_byte_more_is_large():
    # get_pool: round_size(1 MiB) = 1 MiB <= kSmallSize -> small pool, 2 MiB segment;
    # round_size(1 MiB + 1) = 1 MiB + 512 > kSmallSize -> large pool, 20 MiB segment.
    r = run(alloc(0, MiB), alloc(1, MiB + 1))
    assert r.reserved == [2 * MiB, 22 * MiB]
    assert [s.pool for s in r.segments_at_peak] == ["small", "large"]
    assert r.allocated == [MiB, MiB + MiB + 512]


def test_roundup_power2_divisions_rounds_1200_mib_with_4_divisions_to_1280_mib():
    # round_size: divisions(1200 MiB) = 4 (index log2(1200 MiB) - 20 = 10); 1200 MiB > 512 * 4, so
    # roundup_power2_next_division: floor 1024 MiB, step 1024 / 4 = 256 MiB -> 1024 + 256 = 1280 MiB;
    # get_allocation_size(1280 MiB) = 1280 MiB (already a 2 MiB multiple).
    r = run(alloc(0, 1200 * MiB), conf="roundup_power2_divisions:4")
    assert r.reserved == [1280 * MiB]
    assert r.allocated == [1280 * MiB]
    # Without the option, round_size only rounds to 512 B: a 1200 MiB segment.
    assert run(alloc(0, 1200 * MiB)).reserved == [1200 * MiB]


def test_roundup_power2_divisions_list_form_picks_the_divisions_of_the_size_interval():
    # [256:1,512:2,>:8]: sizes in [256 MiB, 512 MiB) get 1 (no roundup), [512 MiB, 1 GiB) 2, from 1 GiB 8.
    # 300 MiB: 1 division -> 300 MiB. 600 MiB: floor 512, step 256 -> 768 MiB. 1100 MiB: floor 1024, step 128
    # -> 1152 MiB. Each in its own segment (no free block fits the next): 300 + 768 + 1152 = 2220 MiB.
    r = run(
        alloc(0, 300 * MiB),
        alloc(1, 600 * MiB),
        alloc(2, 1100 * MiB),
        conf="roundup_power2_divisions:[256:1,512:2,>:8]",
    )
    assert r.reserved == [300 * MiB, 1068 * MiB, 2220 * MiB]


# ------------------------------------------------------------------ splitting
def test_large_pool_splits_only_a_remainder_over_1_mib():
    # 5 MiB in a 20 MiB segment: remaining 15 MiB > kSmallSize -> split. 14 MiB takes the 15 MiB rest: remaining
    # exactly 1 MiB is not > kSmallSize -> not split, the block stays 15 MiB (memory_allocated counts it whole).
    # 1 MiB + 512 (large pool): no free block left -> a new 20 MiB segment, split.
    r = run(alloc(0, 5 * MiB), alloc(1, 14 * MiB), alloc(2, MiB + 512))
    assert r.reserved == [20 * MiB, 20 * MiB, 40 * MiB]
    assert r.allocated == [5 * MiB, 20 * MiB, 21 * MiB + 512]
    assert layout(r)[0] == [(5 * MiB, "allocated"), (15 * MiB, "allocated")]


def test_small_pool_splits_a_remainder_of_512_bytes():
    # 1 MiB: 2 MiB segment, free rest 1 MiB. 1 MiB - 512 takes it: remaining 512 >= kMinBlockSize -> split.
    # 512 B: best fit is the exact 512 B block (get_free_block), remaining 0 -> no split. All in one segment.
    events = (alloc(0, MiB), alloc(1, MiB - 512), alloc(2, 512))
    assert run(*events).reserved == [2 * MiB] * 3
    assert end_layout(*events) == [[(MiB, "allocated"), (MiB - 512, "allocated"), (512, "allocated")]]


# ------------------------------------------------------------------ reuse and best fit
def test_a_freed_block_is_reused_without_a_new_segment():
    # free_block returns the 12 MiB block to the pool; get_free_block finds it for the next 12 MiB request.
    r = run(alloc(0, 12 * MiB), free(0), alloc(1, 12 * MiB))
    assert r.reserved == [12 * MiB] * 3
    assert r.allocated == [12 * MiB, 0, 12 * MiB]
    assert r.device_allocs == 1 and r.device_frees == 0


def test_a_freed_small_block_merges_back_and_stays_reserved():
    # free_block -> try_merge_blocks with the free 2 MiB - 512 rest: one free 2 MiB block, still cached.
    r = run(alloc(0, 100), free(0))
    assert r.reserved == [2 * MiB, 2 * MiB]
    assert r.allocated == [512, 0]


def test_best_fit_picks_the_smallest_free_block_that_fits():
    # Three segments of 12, 14 and 16 MiB (each >= 10 MiB: its own size), all freed. 13 MiB: the pool is ordered
    # by (size, segment, address) and lower_bound gives the 14 MiB block; remaining 1 MiB is not split.
    events = (
        alloc(0, 12 * MiB),
        alloc(1, 14 * MiB),
        alloc(2, 16 * MiB),
        free(0),
        free(1),
        free(2),
        alloc(3, 13 * MiB),
    )
    r = run(*events)
    assert r.reserved[-1] == 42 * MiB
    assert r.allocated[-1] == 14 * MiB
    assert end_layout(*events) == [[(12 * MiB, "free")], [(14 * MiB, "allocated")], [(16 * MiB, "free")]]


# ------------------------------------------------------------------ oversize blocks (max_split_size_mb)
def test_an_oversize_block_is_not_split_and_serves_only_requests_within_the_rounding_limit():
    # max_split_size 200 MiB. 300 MiB: a 300 MiB segment. Freed; 290 MiB: get_free_block allows an oversize block
    # for a request >= max_split_size if block < request + max_non_split_rounding (20 MiB): 300 < 310 -> reused,
    # and should_split is false (request >= max_split_size): 300 MiB allocated. Freed; 250 MiB: 300 >= 270 ->
    # refused, new 250 MiB segment: 550 MiB. 100 MiB: the free 300 MiB block is oversize and 100 MiB is below
    # max_split_size -> refused, new 100 MiB segment: 650 MiB.
    events = (
        alloc(0, 300 * MiB),
        free(0),
        alloc(1, 290 * MiB),
        free(1),
        alloc(2, 250 * MiB),
        alloc(3, 100 * MiB),
    )
    r = run(*events, conf="max_split_size_mb:200")
    assert r.reserved == [300 * MiB] * 4 + [550 * MiB, 650 * MiB]
    assert r.allocated == [300 * MiB, 0, 300 * MiB, 0, 250 * MiB, 350 * MiB]
    # Without max_split_size nothing is oversize: 290 MiB reuses and splits the 300 MiB block (10 MiB > 1 MiB
    # rest), 250 MiB too (50 MiB rest); 100 MiB fits no free block: a new 100 MiB segment -> 400 MiB.
    d = run(*events)
    assert d.reserved == [300 * MiB] * 5 + [400 * MiB]
    assert d.allocated == [300 * MiB, 0, 290 * MiB, 0, 250 * MiB, 350 * MiB]


# ------------------------------------------------------------------ expandable segments
def test_expandable_segments_grow_one_segment_in_place():
    # expandable_segments: 5 MiB maps one 20 MiB large-pool page (try_allocate_expandable_block, map_block);
    # 12 MiB takes the free 15 MiB (should_split: remaining 3 MiB >= 512). 10 MiB: the free 3 MiB block is
    # followed by unmapped space (find_expandable_block), so one more 20 MiB page is mapped right after it and
    # merged (try_merge_blocks): reserved 40 MiB, one segment, 10 MiB at offset 17 MiB, 13 MiB free after it.
    conf = "expandable_segments:True"
    r = run(alloc(0, 5 * MiB), alloc(1, 12 * MiB), alloc(2, 10 * MiB), conf=conf)
    assert r.reserved == [20 * MiB, 20 * MiB, 40 * MiB]
    assert layout(r) == [
        [(5 * MiB, "allocated"), (12 * MiB, "allocated"), (10 * MiB, "allocated"), (13 * MiB, "free")]
    ]
    seg = r.segments_at_peak[0]
    assert seg.expandable and seg.blocks[2].address == seg.address + 17 * MiB
    assert r.device_allocs == 2  # two page mappings
    # Without it, 10 MiB fits no free block: a separate 10 MiB segment, 30 MiB in two segments.
    plain = run(alloc(0, 5 * MiB), alloc(1, 12 * MiB), alloc(2, 10 * MiB))
    assert plain.reserved[-1] == 30 * MiB and len(plain.segments_at_peak) == 2


def test_expandable_small_pool_maps_2_mib_pages():
    # Small pool pages are kSmallBuffer: 100 B maps one 2 MiB page; 1.5 MiB more of small requests (three 512 KiB)
    # fit in it; the fourth 512 KiB needs a second page: 4 MiB.
    events = [alloc(0, 100)] + [alloc(i, 512 * KiB) for i in range(1, 5)]
    r = run(*events, conf="expandable_segments:True")
    assert r.reserved == [2 * MiB] * 4 + [4 * MiB]
    assert len(r.segments_at_peak) == 1


# ------------------------------------------------------------------ streams
def test_a_free_block_on_one_stream_cannot_serve_another_stream():
    # get_free_block looks only at blocks of the request's stream (the pool is ordered by stream first).
    # Stream 0: 5 MiB -> 20 MiB segment, freed. Stream 1: 5 MiB -> its own 20 MiB segment: 40 MiB.
    # Stream 0 again: reuses its free block, still 40 MiB.
    r = run(alloc(0, 5 * MiB, stream=0), free(0), alloc(1, 5 * MiB, stream=1), alloc(2, 5 * MiB, stream=0))
    assert r.reserved == [20 * MiB, 20 * MiB, 40 * MiB, 40 * MiB]
    assert r.device_allocs == 2
    assert sorted(s.stream for s in r.segments_at_peak) == [0, 1]


def test_a_block_used_on_another_stream_returns_to_its_pool_only_after_that_use():
    # Block 0 (12 MiB, stream 0) was used on stream 1 (recordStream); its free at task 0 records an event there
    # (insert_events) that completes at task 1. Block 1 (12 MiB) at task 0: block 0 is not back yet -> a second
    # 12 MiB segment: 24 MiB. Block 2 at task 1: process_events returns block 0 to the pool -> reused, 24 MiB.
    events = (alloc(0, 12 * MiB), free(0, task=0, uses=(1,)), alloc(1, 12 * MiB), alloc(2, 12 * MiB, task=1))
    r = run(*events)
    assert r.reserved == [12 * MiB, 12 * MiB, 24 * MiB, 24 * MiB]
    assert r.allocated == [12 * MiB, 0, 12 * MiB, 24 * MiB]
    at_block_1 = run(*events[:3])
    assert layout(at_block_1) == [[(12 * MiB, "pending")], [(12 * MiB, "allocated")]]
    # The same free without the other stream's use: block 1 reuses block 0's segment, 12 MiB.
    assert run(alloc(0, 12 * MiB), free(0), alloc(1, 12 * MiB)).reserved[-1] == 12 * MiB
    # A use on the block's own stream needs no event (recordStream ignores it).
    assert run(alloc(0, 12 * MiB), free(0, uses=(0,)), alloc(1, 12 * MiB)).reserved[-1] == 12 * MiB


# ------------------------------------------------------------------ fragmentation
def test_fragmentation_reserved_exceeds_allocated_by_the_free_holes():
    # Four 512 KiB blocks fill one 2 MiB small segment (the fourth takes the exact 512 KiB rest). Freeing the
    # first and third leaves two 512 KiB holes that cannot merge (their neighbours are allocated). 1 MiB
    # (small pool) fits neither -> a new 2 MiB segment, split. Peak reserved 4 MiB; allocated 2 x 512 KiB + 1 MiB
    # = 2 MiB; fragmentation = the two holes + the new segment's 1 MiB rest = 2 MiB.
    events = [alloc(i, 512 * KiB) for i in range(4)] + [free(0), free(2), alloc(4, MiB)]
    r = run(*events)
    assert r.peak_reserved == 4 * MiB
    assert r.allocated_at_peak == 2 * MiB
    assert r.fragmentation == 2 * MiB
    assert layout(r) == [
        [(512 * KiB, "free"), (512 * KiB, "allocated"), (512 * KiB, "free"), (512 * KiB, "allocated")],
        [(MiB, "allocated"), (MiB, "free")],
    ]


# ------------------------------------------------------------------ capacity: release and retry, OOM
def test_release_and_retry_frees_cached_segments_when_the_request_does_not_fit_otherwise():
    # Capacity 100 MiB. 60 MiB segment, freed (cached). 70 MiB: no free block that large; alloc_block fails
    # (60 + 70 > 100); release_available_cached_blocks does nothing without max_split_size; release_cached_blocks
    # cudaFrees the unsplit 60 MiB block; the retry succeeds: 70 MiB reserved, one retry.
    r = run(alloc(0, 60 * MiB), free(0), alloc(1, 70 * MiB), capacity=100 * MiB)
    assert r.oom is None
    assert r.reserved == [60 * MiB, 60 * MiB, 70 * MiB]
    assert (r.device_allocs, r.device_frees, r.alloc_retries) == (2, 1, 1)
    # Without a capacity the cache is kept: 130 MiB.
    assert run(alloc(0, 60 * MiB), free(0), alloc(1, 70 * MiB)).reserved[-1] == 130 * MiB


def test_a_request_that_does_not_fit_even_after_releasing_the_cache_is_an_oom():
    # Capacity 100 MiB: 60 MiB stays allocated; 50 MiB: 60 + 50 > 100, nothing cached to release -> OOM there.
    r = run(alloc(0, 60 * MiB), alloc(1, 50 * MiB, task=3), capacity=100 * MiB)
    assert r.oom is not None
    assert (r.oom.event, r.oom.block, r.oom.task, r.oom.alloc_size) == (1, 1, 3, 50 * MiB)
    assert (r.oom.reserved, r.oom.allocated) == (60 * MiB, 60 * MiB)
    assert r.reserved == [60 * MiB]  # the replay stops at the OOM
    assert r.alloc_retries == 1


def test_a_free_hole_in_a_split_segment_cannot_be_released_and_the_request_ooms():
    # Two 5 MiB blocks share a 20 MiB segment; freeing the first leaves a 5 MiB hole in a split segment, which
    # release_cached_blocks cannot cudaFree (release_blocks frees only unsplit blocks). 25 MiB needs a 26 MiB
    # segment: 20 + 26 > 40 MiB capacity -> OOM with 20 MiB reserved, 5 MiB allocated.
    r = run(alloc(0, 5 * MiB), alloc(1, 5 * MiB), free(0), alloc(2, 25 * MiB), capacity=40 * MiB)
    assert r.oom is not None and r.oom.block == 2 and r.oom.alloc_size == 26 * MiB
    assert (r.oom.reserved, r.oom.allocated) == (20 * MiB, 5 * MiB)


def test_with_max_split_size_only_enough_oversize_blocks_are_released():
    # max_split_size 100 MiB, capacity 350 MiB. Segments of 50, 120 and 130 MiB, all freed (300 MiB cached).
    # 200 MiB: none fits; 300 + 200 > 350; release_available_cached_blocks: no single block >= 200 MiB, so it
    # cudaFrees oversize blocks from the largest down until 200 MiB are freed: 130 (130 < 200), then 120 (250);
    # the 50 MiB block is kept. The first attempt after that succeeds: 50 + 200 = 250 MiB, no retry counted.
    events = (
        alloc(0, 50 * MiB),
        alloc(1, 120 * MiB),
        alloc(2, 130 * MiB),
        free(0),
        free(1),
        free(2),
        alloc(3, 200 * MiB),
    )
    r = run(*events, conf="max_split_size_mb:100", capacity=350 * MiB)
    assert r.reserved[-1] == 250 * MiB
    assert (r.device_frees, r.alloc_retries) == (2, 0)
    assert end_layout(*events, conf="max_split_size_mb:100", capacity=350 * MiB) == [
        [(50 * MiB, "free")],
        [(200 * MiB, "allocated")],
    ]
    # Without max_split_size, release_cached_blocks frees all three and retries: 200 MiB.
    d = run(*events, capacity=350 * MiB)
    assert d.reserved[-1] == 200 * MiB
    assert (d.device_frees, d.alloc_retries) == (3, 1)


def test_release_and_retry_first_completes_the_pending_frees():
    # Capacity 24 MiB. Block 0 (12 MiB) freed at task 0 after a use on stream 1 that completes only at task 5.
    # Block 1 (12 MiB, task 1): block 0 is pending -> a second segment, 24 MiB; then freed. Block 2 (20 MiB,
    # task 2): no fit; 24 + 20 > 24; release_cached_blocks synchronizes (synchronize_and_free_events: block 0
    # returns), cudaFrees both unsplit 12 MiB blocks, and the retry maps 20 MiB.
    events = (
        alloc(0, 12 * MiB),
        free(0, task=0, uses=(1,), done=5),
        alloc(1, 12 * MiB, task=1),
        free(1, task=1),
        alloc(2, 20 * MiB, task=2),
    )
    r = run(*events, capacity=24 * MiB)
    assert r.oom is None
    assert r.reserved == [12 * MiB, 12 * MiB, 24 * MiB, 24 * MiB, 20 * MiB]
    assert (r.device_frees, r.alloc_retries) == (2, 1)


def test_expandable_segments_unmap_free_pages_to_serve_another_stream():
    # expandable_segments, capacity 60 MiB. Stream 0: 30 MiB maps two 20 MiB pages (40 MiB), freed. Stream 1:
    # 30 MiB needs its own segment and two pages: 40 + 40 > 60 -> the mapping fails; release_cached_blocks unmaps
    # stream 0's free pages (unmap_block; the empty segment is released) and the retry maps stream 1's: 40 MiB.
    events = (alloc(0, 30 * MiB, stream=0), free(0), alloc(1, 30 * MiB, stream=1))
    r = run(*events, conf="expandable_segments:True", capacity=60 * MiB)
    assert r.oom is None
    assert r.reserved == [40 * MiB, 40 * MiB, 40 * MiB]
    assert (r.device_allocs, r.device_frees, r.alloc_retries) == (2, 1, 1)
    assert [s.stream for s in r.segments_at_peak] == [0]  # the peak: first reached after the first event
    assert end_layout(*events, conf="expandable_segments:True", capacity=60 * MiB) == [
        [(30 * MiB, "allocated"), (10 * MiB, "free")]
    ]


def test_per_process_memory_fraction_limits_what_can_be_reserved():
    # Fraction 0.25 of 100 MiB: allowed_memory_maximum 25 MiB (setMemoryFraction). 20 MiB fits; 10 MiB more:
    # alloc_block refuses 20 + 10 > 25 even though the device has room -> OOM.
    r = run(
        alloc(0, 20 * MiB), alloc(1, 10 * MiB), conf="per_process_memory_fraction:0.25", capacity=100 * MiB
    )
    assert r.oom is not None and r.oom.block == 1
    assert run(alloc(0, 20 * MiB), alloc(1, 10 * MiB), capacity=100 * MiB).oom is None


def test_garbage_collection_releases_the_oldest_cached_blocks_above_the_threshold():
    # Fraction 0.5 of 200 MiB: 100 MiB allowed; threshold 0.5 -> collect above 50 MiB reserved. Each
    # get_free_block on the large pool counts a call (the blocks' age clock).
    # 1. s0 40 MiB (call 1): new segment. 2. freed: cached at count 1. 3. s1 30 MiB (call 2): new, 70 MiB.
    # 4. freed at count 2. 5. s1 30 MiB (call 3): reuses it. 6. freed again at count 3. 7. s0 50 MiB (call 4): no
    # fit; garbage_collect_cached_blocks: 70 > 50, target 20; ages 4-1 = 3 and 4-3 = 1, average 2: the 40 MiB
    # block (age 3) is released, which reclaims enough; then 30 + 50 = 80 <= 100 is reserved without a retry.
    events = (
        alloc(0, 40 * MiB, stream=0),
        free(0),
        alloc(1, 30 * MiB, stream=1),
        free(1),
        alloc(2, 30 * MiB, stream=1),
        free(2),
        alloc(3, 50 * MiB, stream=0),
    )
    cap = 200 * MiB
    r = run(*events, conf="per_process_memory_fraction:0.5,garbage_collection_threshold:0.5", capacity=cap)
    assert r.reserved[-1] == 80 * MiB
    assert (r.device_frees, r.alloc_retries) == (1, 0)
    # Without garbage collection: 70 + 50 > 100 -> release_cached_blocks frees both, retry: 50 MiB.
    d = run(*events, conf="per_process_memory_fraction:0.5", capacity=cap)
    assert d.reserved[-1] == 50 * MiB
    assert (d.device_frees, d.alloc_retries) == (2, 1)
    # The threshold alone does nothing: torch collects only under a memory fraction.
    assert run(*events, conf="garbage_collection_threshold:0.5", capacity=cap).reserved[-1] == 120 * MiB
