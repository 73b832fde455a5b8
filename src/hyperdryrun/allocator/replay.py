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

EVENT_KINDS = ("alloc", "free")


class AllocatorEventError(ValueError):
    """An event sequence the allocator cannot replay (a double allocation, a free of nothing, a bad field)."""


@dataclass(frozen=True, slots=True)
class AllocatorEvent:
    """One request to the allocator: ``alloc`` of ``size`` requested bytes (the model rounds), or ``free``."""

    kind: Literal["alloc", "free"]
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
            raise AllocatorEventError(f"allocator event kind: must be alloc or free (got {self.kind!r})")
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
    keyed: list[tuple[tuple[int, int, int], AllocatorEvent]] = []
    for b in blocks:
        if b.requested <= 0:
            continue
        stream = getattr(b, "stream", 0) or 0
        before_step = b.phase == Phase.INITIALIZATION
        alloc = AllocatorEvent("alloc", b.id, size=b.requested, stream=stream, task=b.start)
        keyed.append(((-1 if before_step else b.start, 1, b.id), alloc))
        if b.end != PERSISTENT_END:
            if b.end <= b.start:
                raise AllocatorEventError(f"block {b.id}: end must be after start {b.start} (got {b.end})")
            uses = frozenset(getattr(b, "use_streams", None) or ())
            keyed.append(((b.end, 0, b.id), AllocatorEvent("free", b.id, task=b.end, use_streams=uses)))
    keyed.sort(key=lambda ke: ke[0])
    return [e for _, e in keyed]


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
    """Index of the first event after which reserved bytes are at their peak (-1: no events)."""
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

    @property
    def fragmentation(self) -> int:
        """Reserved but not allocated at the reserved peak: cached free blocks and the remainders of segments."""
        return self.peak_reserved - self.allocated_at_peak


def replay(
    events: Iterable[AllocatorEvent],
    options: AllocatorOptions | None = None,
    capacity: int | None = None,
) -> AllocatorReplay:
    """Replay ``events`` in order through ``CachingAllocatorModel``; ``capacity``: device bytes, None: unlimited."""
    events = list(events)
    options = options or AllocatorOptions()
    model = CachingAllocatorModel(options, capacity)
    tasks: list[int] = []
    reserved: list[int] = []
    allocated: list[int] = []
    oom = None
    peak, peak_event = 0, -1
    malloc, free = model.malloc, model.free
    for n, ev in enumerate(events):
        try:
            if ev.kind == "alloc":
                malloc(ev.block, ev.size, ev.stream, ev.task)
            else:
                free(ev.block, ev.use_streams, ev.uses_done, ev.task)
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
        if model.reserved > peak:
            peak, peak_event = model.reserved, n
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
        peak_allocated=model.peak_allocated,
        segments_at_peak=segments,
        device_allocs=model.device_allocs,
        device_frees=model.device_frees,
        alloc_retries=model.alloc_retries,
        oom=oom,
    )


def _apply(model: CachingAllocatorModel, ev: AllocatorEvent) -> None:
    if ev.kind == "alloc":
        model.malloc(ev.block, ev.size, ev.stream, ev.task)
    else:
        model.free(ev.block, ev.use_streams, ev.uses_done, ev.task)
