"""The allocator stage: a rank's allocation and free events, in order, through the caching allocator model.

It reads only events, so it runs on a dry run's blocks and on ingested real traces alike::

    result = replay(events_from_blocks(trace.blocks), AllocatorOptions.from_env(), capacity=80 * 2**30)
    result.peak_reserved, result.fragmentation, result.oom
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from hyperdryrun.allocator.model import CachingAllocatorModel, OutOfMemory, Segment
from hyperdryrun.allocator.options import AllocatorOptions
from hyperdryrun.trace.blocks import PERSISTENT_END, Block, Phase

EVENT_KINDS = ("alloc", "free", "sync")


class AllocatorEventError(ValueError):
    """An event sequence the allocator cannot replay (a double allocation, a free of nothing, a bad field)."""


@dataclass(frozen=True, slots=True)
class AllocatorEvent:
    """One request to the allocator: ``alloc`` of ``size`` requested bytes (the model rounds), or ``free``."""

    kind: Literal["alloc", "free", "sync"]
    """``sync``: every use on another stream has completed (a step boundary); its ``block`` is ignored."""
    block: int
    size: int = 0
    """Requested bytes, not rounded (alloc only)."""
    stream: int = 0
    """Stream the block is allocated on (alloc only; a free is on the block's own stream)."""
    task: int = 0
    use_streams: frozenset[int] = field(default_factory=frozenset)
    """Free only: other streams the block was used on (``Tensor.record_stream``)."""
    uses_done: int | None = None
    """Free only: task by which those uses have completed; None: the next task (``task + 1``)."""

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise AllocatorEventError(
                f"allocator event kind: must be alloc, free or sync (got {self.kind!r})"
            )
        if self.size < 0:
            raise AllocatorEventError(f"allocator event size: must be >= 0 (got {self.size})")


def events_from_blocks(blocks: Iterable[Block]) -> list[AllocatorEvent]:
    """The events of a trace's blocks, in the order the allocator would see them.

    Blocks alive before the step (phase initialization: parameters, buffers, optimizer states) are allocated
    first, in block order. Then by task: the frees that end at task ``t`` come before the allocations that start
    at ``t`` (a storage freed while task ``t - 1`` ran ends at ``t``), ties by block id. The tracker's exact event
    order can replace this rule once blocks carry it. A block's stream is its ``stream`` attribute and the other
    streams it is used on its ``use_streams`` attribute, where blocks have them (default: stream 0, no others).
    Zero-byte blocks are skipped: the CUDA allocator hands out nothing for them.
    """
    keyed = _keyed_events(blocks)
    keyed.sort(key=_key)
    return [e for _, e in keyed]


def _key(keyed: tuple[tuple[int, int, int], AllocatorEvent]) -> tuple[int, int, int]:
    return keyed[0]


def _free_event(b: Block, task: int) -> tuple[tuple[int, int, int], AllocatorEvent]:
    uses = frozenset(getattr(b, "use_streams", None) or ())
    return (task, 0, b.id), AllocatorEvent("free", b.id, task=task, use_streams=uses)


def _keyed_events(blocks: Iterable[Block]) -> list[tuple[tuple[int, int, int], AllocatorEvent]]:
    """:func:`events_from_blocks`'s events, each with its sort key, unsorted."""
    keyed: list[tuple[tuple[int, int, int], AllocatorEvent]] = []
    append = keyed.append
    init = Phase.INITIALIZATION
    for b in blocks:
        if b.requested <= 0:
            continue
        stream = getattr(b, "stream", 0) or 0
        alloc = AllocatorEvent("alloc", b.id, size=b.requested, stream=stream, task=b.start)
        append(((-1 if b.phase == init else b.start, 1, b.id), alloc))
        if b.end != PERSISTENT_END:
            if b.end <= b.start:
                raise AllocatorEventError(f"block {b.id}: end must be after start {b.start} (got {b.end})")
            append(_free_event(b, b.end))
    return keyed


def steady_state_events(
    blocks: Iterable[Block], made_in_step_one: Iterable[tuple[Block, int]] = ()
) -> tuple[list[AllocatorEvent], int]:
    """The events of a steady-state step (step 2) after the history that built its allocator cache, and the index
    of the step's first event.

    The history is what a training job did before: the blocks alive before the step that existed before step 1
    (parameters, buffers) are allocated first; then step 1 runs the step's own events (its persistent blocks freed
    at its end: what step 2 starts with is the blocks alive before it), with ``made_in_step_one`` (blocks alive before step 2 that step 1 made, each with the task it made them
    at: optimizer states at the optimizer's first task, cuBLAS workspaces at their thread's first matmul) allocated
    there and kept. Step 2 is the step itself, on the cache step 1 left (``torch.cuda.max_memory_reserved`` after
    ``reset_peak_memory_stats`` between the steps). On an H200 this gives the measured max reserved of the six
    jobs of ../shared/gpu to the byte on four and within 0.15% on the other two; a step from a cold cache was
    -2.6% to +8.7% off (docs/ACCURACY.md).
    """
    blocks = [b for b in blocks if b.requested > 0]
    made = [(b, t) for b, t in made_in_step_one if b.requested > 0]
    made_ids = {b.id for b, _ in made}
    before = [b for b in blocks if b.phase == Phase.INITIALIZATION and b.id not in made_ids]
    step = [b for b in blocks if b.phase != Phase.INITIALIZATION]
    last = max((b.end for b in step if b.end != PERSISTENT_END), default=0)
    last = max([last, *(b.start + 1 for b in step), *(t + 1 for _, t in made)])
    # Step 1 frees what it would keep (step 2 starts with the blocks alive before it, not with these), and its
    # uses on other streams have completed when step 2 starts: its blocks' ids and tasks can be step 2's. So step
    # 1's events are step 2's (the same immutable objects, made once), plus a free at its end for each persistent
    # block and the allocation (and any free) of each block step 1 made.
    keyed_step = _keyed_events(step)
    keyed_one = keyed_step + [_free_event(b, last) for b in step if b.end == PERSISTENT_END]
    for b, t in made:
        alloc = AllocatorEvent("alloc", b.id, size=b.requested, stream=getattr(b, "stream", 0) or 0, task=t)
        keyed_one.append(((t, 1, b.id), alloc))
        if b.end != PERSISTENT_END:
            if b.end <= t:
                raise AllocatorEventError(f"block {b.id}: end must be after start {t} (got {b.end})")
            keyed_one.append(_free_event(b, b.end))
    keyed_one.sort(key=_key)
    keyed_step.sort(key=_key)
    events = [AllocatorEvent("alloc", b.id, size=b.requested, stream=b.stream, task=0) for b in before]
    events += [e for _, e in keyed_one]
    events.append(AllocatorEvent("sync", -1, task=last))
    start = len(events)
    return events + [e for _, e in keyed_step], start


@dataclass(frozen=True)
class AllocatorOOM:
    """The request that would raise ``CUDA out of memory`` under the capacity."""

    event: int
    block: int
    task: int
    stream: int
    requested: int
    size: int
    """The request rounded (``round_size``)."""
    alloc_size: int
    """The segment it needed ("Tried to allocate" in torch's message)."""
    reserved: int
    allocated: int


@dataclass
class AllocatorReplay:
    """What the caching allocator makes of a rank's events: reserved bytes over time, the peak, its segments."""

    options: AllocatorOptions
    capacity: int | None
    tasks: list[int]
    """Task of each event replayed."""
    reserved: list[int]
    """Reserved bytes (``memory_reserved()``) after each event."""
    allocated: list[int]
    """Allocated bytes (``memory_allocated()``: block sizes, an unsplit remainder included) after each event."""
    peak_reserved: int
    peak_event: int
    """Index of the first event after which reserved bytes are at their peak with the most bytes allocated
    (-1: no events)."""
    peak_task: int
    allocated_at_peak: int
    peak_allocated: int
    segments_at_peak: list[Segment]
    device_allocs: int
    """cudaMalloc calls and page mappings (``num_device_alloc``)."""
    device_frees: int
    """cudaFree calls and page unmappings (``num_device_free``)."""
    alloc_retries: int
    """Allocations that needed every cached block released first (``num_alloc_retries``)."""
    oom: AllocatorOOM | None
    """The first request that fails under the capacity; the replay stops there. None: it fits."""
    step_start: int = 0
    """Index of the traced step's first event: the peaks are the step's (after a history that built the cache,
    :func:`steady_state_events`); ``tasks``, ``reserved`` and ``allocated`` cover every event."""

    @property
    def fragmentation(self) -> int:
        """Reserved but not allocated at the reserved peak: cached free blocks and the remainders of segments."""
        return self.peak_reserved - self.allocated_at_peak


def replay(
    events: Iterable[AllocatorEvent],
    options: AllocatorOptions | None = None,
    capacity: int | None = None,
    step_start: int = 0,
) -> AllocatorReplay:
    """Replay ``events`` in order through ``CachingAllocatorModel``; ``capacity``: device bytes, None: unlimited.
    The peaks are those of the events from ``step_start`` on (what ``reset_peak_memory_stats`` before the step
    and ``max_memory_reserved`` after it measure); an OOM anywhere counts."""
    events = list(events)
    options = options or AllocatorOptions()
    model = CachingAllocatorModel(options, capacity)
    tasks: list[int] = []
    reserved: list[int] = []
    allocated: list[int] = []
    oom = None
    peak, peak_alloc, peak_event = 0, 0, -1
    malloc, free = model.malloc, model.free
    for n, ev in enumerate(events):
        try:
            if ev.kind == "alloc":
                malloc(ev.block, ev.size, ev.stream, ev.task)
            elif ev.kind == "free":
                free(ev.block, ev.use_streams, ev.uses_done, ev.task)
            else:
                model.synchronize()
        except OutOfMemory as err:
            oom = AllocatorOOM(
                n,
                ev.block,
                ev.task,
                ev.stream,
                ev.size,
                err.size,
                err.alloc_size,
                err.reserved,
                model.allocated,
            )
            break
        except ValueError as err:
            raise AllocatorEventError(f"allocator event {n}: {err}") from None
        tasks.append(ev.task)
        reserved.append(model.reserved)
        allocated.append(model.allocated)
        # The reserved peak, and where it is reached with the most allocated (after a history the step's reserved
        # bytes are flat at their peak for long: its breakdown is the most telling where the least is cached).
        if n >= step_start and (model.reserved, model.allocated) > (peak, peak_alloc):
            peak, peak_alloc, peak_event = model.reserved, model.allocated, n
    segments: list[Segment] = []
    if peak_event >= 0:
        # A second pass up to the peak: cheaper than a snapshot at every new peak.
        at_peak = CachingAllocatorModel(options, capacity)
        for ev in events[: peak_event + 1]:
            _apply(at_peak, ev)
        segments = at_peak.segments()
    return AllocatorReplay(
        options=options,
        capacity=capacity,
        tasks=tasks,
        reserved=reserved,
        allocated=allocated,
        peak_reserved=peak,
        peak_event=peak_event,
        peak_task=tasks[peak_event] if peak_event >= 0 else -1,
        allocated_at_peak=allocated[peak_event] if peak_event >= 0 else 0,
        peak_allocated=model.peak_allocated if step_start == 0 else max(allocated[step_start:], default=0),
        segments_at_peak=segments,
        device_allocs=model.device_allocs,
        device_frees=model.device_frees,
        alloc_retries=model.alloc_retries,
        oom=oom,
        step_start=step_start,
    )


def _apply(model: CachingAllocatorModel, ev: AllocatorEvent) -> None:
    if ev.kind == "alloc":
        model.malloc(ev.block, ev.size, ev.stream, ev.task)
    elif ev.kind == "free":
        model.free(ev.block, ev.use_streams, ev.uses_done, ev.task)
    else:
        model.synchronize()
