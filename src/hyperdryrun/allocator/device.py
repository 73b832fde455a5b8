"""Device memory of a step: its blocks and the runtime's own allocations through the caching allocator, plus what
the runtime holds outside it, against a capacity.

Three figures, each comparable to what a real run shows::

    allocated  tensors as the allocator sizes them + cuBLAS workspaces   torch.cuda.max_memory_allocated()
    reserved   the segments the allocator holds (allocated + cached)     torch.cuda.max_memory_reserved()
    device     reserved + NCCL buffers + CUDA context                    nvidia-smi "memory used" of the process

Usage::

    dm = device_memory(trace.blocks, trace.peak, workspaces, outside, AllocatorOptions(), capacity=80 * 2**30)
    dm.peak_reserved, dm.peak_device, dm.breakdown(), dm.lines(), dm.oom
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hyperdryrun.allocator.model import Segment
from hyperdryrun.allocator.options import AllocatorOptions
from hyperdryrun.allocator.replay import AllocatorOOM, AllocatorReplay, replay, steady_state_events
from hyperdryrun.trace.blocks import Block, Category, Phase

TENSORS = "tensors"
WORKSPACES = "cuBLAS workspaces"
ALLOCATOR = "caching allocator"
UNSPLIT = "blocks handed out unsplit"
CACHED = "cached free blocks"
PENDING = "freed, waiting for other streams"


@dataclass(frozen=True)
class Workspace:
    """A runtime allocation through the caching allocator on ``stream``, kept: ``task`` is its thread's first
    matmul of the step; in the steady state it is already allocated when the step starts (:func:`workspace_blocks`)."""

    label: str
    stream: int
    task: int
    size: int


@dataclass(frozen=True)
class OutsideCost:
    """Device memory the runtime holds outside the caching allocator (NCCL buffers, the CUDA context)."""

    line: str
    size: int
    source: str


@dataclass
class DeviceMemory:
    """What the caching allocator and the runtime make of a step's blocks (see the module docstring)."""

    replay: AllocatorReplay
    """The replay the figures come from: under the capacity if it fits there, else without a capacity (what the
    step would need)."""
    tensor_peak: int
    workspaces: list[Workspace]
    outside: list[OutsideCost]
    capacity: int | None
    oom: AllocatorOOM | None
    """The first request the allocator cannot serve under the capacity (net of ``outside``); None: it fits."""
    tensor_sizes: dict[int, int] = field(default_factory=dict)
    """Block id -> the block's size in the trace (512-rounded); ids not here are workspaces."""
    workspace_ids: dict[int, Workspace] = field(default_factory=dict)

    @property
    def peak_reserved(self) -> int:
        return self.replay.peak_reserved

    @property
    def peak_allocated(self) -> int:
        return self.replay.peak_allocated

    @property
    def fragmentation(self) -> int:
        """Reserved but not allocated at the reserved peak."""
        return self.replay.fragmentation

    @property
    def outside_bytes(self) -> int:
        return sum(c.size for c in self.outside)

    @property
    def peak_device(self) -> int:
        return self.peak_reserved + self.outside_bytes

    @property
    def workspace_bytes(self) -> int:
        return sum(w.size for w in self.workspaces)

    @property
    def segments(self) -> list[Segment]:
        """The segments at the reserved peak."""
        return self.replay.segments_at_peak

    def lines(self) -> list[dict[str, Any]]:
        """Peak device bytes as lines that add up to it, in the order a verdict accumulates them: the tensors'
        peak, the cuBLAS workspaces, what the caching allocator reserves beyond both (its caching, rounding and
        fragmentation at its own peak), then each cost outside the allocator."""
        beyond = self.peak_reserved - self.tensor_peak - self.workspace_bytes
        out = [
            {"line": TENSORS, "bytes": self.tensor_peak, "inside_allocator": True},
            {"line": WORKSPACES, "bytes": self.workspace_bytes, "inside_allocator": True},
            {"line": ALLOCATOR, "bytes": beyond, "inside_allocator": True},
        ]
        out += [
            {"line": c.line, "bytes": c.size, "inside_allocator": False, "source": c.source}
            for c in self.outside
        ]
        return out

    def tipping_line(self) -> str | None:
        """The line whose bytes take the running total past the capacity (None: no capacity, or it fits)."""
        if self.capacity is None or self.oom is None:
            return None
        total = 0
        for row in self.lines():
            total += row["bytes"]
            if total > self.capacity:
                return str(row["line"])
        return ALLOCATOR  # the allocator could not get a segment although the lines fit: fragmentation

    def breakdown(self) -> list[dict[str, Any]]:
        """Reserved bytes at the reserved peak by cause; the rows add up to :attr:`peak_reserved` exactly.

        ``tensors``: the blocks' trace sizes; ``blocks handed out unsplit``: what the allocator gave beyond them
        (a cached block larger than the request, not split; power-of-two rounding); ``cuBLAS workspaces``;
        ``cached free blocks`` and ``freed, waiting for other streams`` per stream and pool.
        """
        sums: dict[tuple[str, int | None, str | None], int] = {}

        def add(cause: str, nbytes: int, stream: int | None = None, pool: str | None = None) -> None:
            key = (cause, stream, pool)
            sums[key] = sums.get(key, 0) + nbytes

        add(TENSORS, 0)
        add(UNSPLIT, 0)
        add(WORKSPACES, 0)
        for seg in self.segments:
            for b in seg.blocks:
                if b.state == "allocated":
                    if b.block in self.workspace_ids:
                        add(WORKSPACES, b.size)
                    else:
                        traced = self.tensor_sizes[b.block]  # type: ignore[index]
                        add(TENSORS, traced)
                        add(UNSPLIT, b.size - traced)
                elif b.state == "pending":
                    add(PENDING, b.size, seg.stream, seg.pool)
                else:
                    add(CACHED, b.size, seg.stream, seg.pool)
        return [
            {"cause": cause, "stream": stream, "pool": pool, "bytes": nbytes}
            for (cause, stream, pool), nbytes in sorted(
                sums.items(), key=lambda kv: (_CAUSE_ORDER[kv[0][0]], kv[0][1] or 0, kv[0][2] or "")
            )
        ]

    def pools(self) -> list[dict[str, Any]]:
        """The segments at the reserved peak by stream and pool: how many, their bytes and their blocks' states."""
        rows: dict[tuple[int, str], dict[str, Any]] = {}
        for seg in self.segments:
            row = rows.setdefault(
                (seg.stream, seg.pool),
                {
                    "stream": seg.stream,
                    "pool": seg.pool,
                    "segments": 0,
                    "bytes": 0,
                    "allocated_bytes": 0,
                    "free_bytes": 0,
                    "pending_bytes": 0,
                },
            )
            row["segments"] += 1
            row["bytes"] += seg.size
            for b in seg.blocks:
                row[f"{b.state}_bytes"] += b.size
        return [rows[k] for k in sorted(rows)]


_CAUSE_ORDER = {TENSORS: 0, UNSPLIT: 1, WORKSPACES: 2, CACHED: 3, PENDING: 4}


def workspace_blocks(workspaces: Iterable[Workspace], first_id: int) -> list[Block]:
    """Blocks for ``workspaces`` (ids from ``first_id``), alive before the steady-state step and kept: a handle's
    workspace is made at its thread's first matmul of step 1 (:func:`device_memory` replays that history) and kept
    with the handle. So a peak before the autograd thread's first matmul of the step holds both, as an H200 showed
    (../shared/gpu, p1: the loss backward)."""
    return [
        Block(
            id=first_id + i,
            size=w.size,
            requested=w.size,
            start=0,
            op=w.label,
            phase=Phase.INITIALIZATION,
            module="",
            stack_id=0,
            stream=w.stream,
        )
        for i, w in enumerate(workspaces)
    ]


def made_in_step_one(
    blocks: list[Block], workspaces: list[tuple[Block, Workspace]]
) -> list[tuple[Block, int]]:
    """Blocks alive before the step that step 1 made, with the task it made them at: the optimizer's states at its
    first task (torch's optimizers create them lazily in their first ``step``, before its other work) and each
    workspace at its thread's first matmul."""
    optimizer = [b.start for b in blocks if b.phase == Phase.OPTIMIZER]
    first = min(optimizer) if optimizer else max((b.start + 1 for b in blocks), default=0)
    states = [
        (b, first) for b in blocks if b.phase == Phase.INITIALIZATION and b.category == Category.OPTSTATE
    ]
    return states + [(b, w.task) for b, w in workspaces]


def device_memory(
    blocks: list[Block],
    tensor_peak: int,
    workspaces: list[Workspace] | None = None,
    outside: list[OutsideCost] | None = None,
    options: AllocatorOptions | None = None,
    capacity: int | None = None,
) -> DeviceMemory:
    """Replay ``blocks`` and ``workspaces`` through the caching allocator, under ``capacity`` less ``outside``: the
    steady-state step after the step before it (:func:`hyperdryrun.allocator.replay.steady_state_events`), whose
    cache it starts from; the figures are the step's.

    When the step fits, the figures are those of the replay under the capacity (where the allocator may have had
    to release its cache, ``alloc_retries``); when it does not, those of a replay without a capacity (what the
    step would need), with the first request that failed as ``oom``.
    """
    workspaces = list(workspaces or [])
    outside = list(outside or [])
    options = options or AllocatorOptions()
    first_id = max((b.id for b in blocks), default=-1) + 1
    extra = workspace_blocks(workspaces, first_id)
    made = made_in_step_one(blocks, list(zip(extra, workspaces, strict=True)))
    events, start = steady_state_events([*blocks, *extra], made)
    oom = None
    result = None
    if capacity is not None:
        limited = replay(events, options, max(capacity - sum(c.size for c in outside), 0), step_start=start)
        oom = limited.oom
        if oom is None:
            result = limited
    if result is None:
        result = replay(events, options, step_start=start)
    return DeviceMemory(
        replay=result,
        tensor_peak=tensor_peak,
        workspaces=workspaces,
        outside=outside,
        capacity=capacity,
        oom=oom,
        tensor_sizes={b.id: b.size for b in blocks},
        workspace_ids={b.id: w for b, w in zip(extra, workspaces, strict=True)},
    )


__all__ = [
    "DeviceMemory",
    "OutsideCost",
    "Workspace",
    "device_memory",
    "made_in_step_one",
    "workspace_blocks",
]
