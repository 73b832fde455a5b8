"""Real allocation events -> the dry run's plain data (:class:`~hyperdryrun.trace.step.StepTrace` with blocks).

Every ingestion path (a live ``torch.profiler`` object, a Chrome trace, a CUDA snapshot, ``hyperdryrun measure``)
reduces its source to a time-ordered list of :class:`AllocEvent` and calls :func:`trace_from_events`, so measured
and dry-run reports share one schema and one set of report functions.

Timeline rule, the tracker's (:mod:`hyperdryrun.trace.tracker`) applied to real events: tasks are ops in time
order; the allocations of an op start at its task ``t``; a free during task ``t`` (or between ops, after ``t``) ends
its block at ``t + 1``. One real op that frees and then allocates again (a kernel's scratch, then its output) is
split into two tasks at that point, so the peak rebuilt from block lifetimes equals the peak of the event sequence
exactly (within a task every allocation precedes every free).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hyperdryrun.trace.blocks import (
    ADDRESS_BASE,
    ALIGNMENT,
    Block,
    Category,
    Phase,
    finalize_blocks,
    live_bytes_by_task,
    round_size,
)
from hyperdryrun.trace.stacks import Frame, StackTable
from hyperdryrun.trace.step import ModuleStats, StepTrace

INITIAL_OP = "initialization"
"""``op`` of blocks that exist before the first event (as the dry run's seeded blocks)."""
_DEVICE_ALIASES = {"privateuse1": "npu", "privateuseone": "npu"}


def normalize_device(name: str) -> str:
    """Lower-case device string with backend aliases unified: ``PrivateUse1:0`` -> ``npu:0``, ``CUDA`` -> ``cuda``."""
    kind, sep, index = str(name).strip().lower().partition(":")
    kind = _DEVICE_ALIASES.get(kind, kind)
    return f"{kind}{sep}{index}"


def same_device(name: str, wanted: str) -> bool:
    """Whether ``name`` is on ``wanted``; a ``wanted`` without an index (``cuda``) matches every index."""
    a, b = normalize_device(name), normalize_device(wanted)
    return a == b if ":" in b else a.partition(":")[0] == b


@dataclass(frozen=True, slots=True)
class AllocEvent:
    """One real allocation (``nbytes > 0``) or free (``nbytes < 0``) of the storage identified by ``key``.

    ``key`` is the allocation id when the source has one (pointers are reused after a free), else the pointer.
    ``op_id`` identifies the op instance the event happened in (``None``: between ops); consecutive events with
    the same ``op_id`` belong to one task. ``op``/``phase``/``module``/``frames``/``category`` describe the
    allocation and are ignored on frees. ``scratch`` marks a kernel's workspace: allocated and freed inside one
    kernel (an op a dry run sees as one task, of which it records only the outputs), on the allocation and its free.
    """

    time_ns: int
    key: Hashable
    nbytes: int
    op: str = ""
    op_id: Hashable | None = None
    phase: Phase = Phase.FORWARD
    module: str = ""
    frames: tuple[Frame, ...] = ()
    category: Category | None = None
    device: str = "cpu"
    micro_batch: int = 0
    scratch: bool = False


class FrameTable(StackTable):
    """A :class:`StackTable` filled from frames a trace recorded, not from live Python frames."""

    def intern(self, frames: Sequence[Frame]) -> int:
        """Stack id of ``frames`` (innermost first); the empty stack is 0."""
        key = ("frames", *frames) if frames else ()
        sid = self._ids.get(key)
        if sid is None:
            sid = len(self._frames)
            self._ids[key] = sid
            self._frames.append(tuple(frames))
        return sid


@dataclass
class _Builder:
    alignment: int
    stacks: FrameTable = field(default_factory=FrameTable)
    blocks: list[Block] = field(default_factory=list)
    task_op: list[str] = field(default_factory=list)
    task_phase: list[Phase] = field(default_factory=list)
    live: dict[Hashable, Block] = field(default_factory=dict)
    current: int = 0
    peak: int = 0
    next_addr: int = ADDRESS_BASE

    def open(self, ev: AllocEvent, task: int, op: str, phase: Phase, category: Category | None) -> Block:
        size = round_size(ev.nbytes, self.alignment)
        blk = Block(
            id=len(self.blocks),
            size=size,
            requested=ev.nbytes,
            start=task,
            op=op,
            phase=phase,
            module=ev.module,
            stack_id=self.stacks.intern(ev.frames),
            addr=self.next_addr,
            category=category,
            micro_batch=ev.micro_batch,
            scratch=ev.scratch,
        )
        self.next_addr += round_size(max(size, 1), ALIGNMENT)
        self.blocks.append(blk)
        self.live[ev.key] = blk
        self.current += size
        self.peak = max(self.peak, self.current)
        blk.used_after_alloc, blk.peak_after_alloc = self.current, self.peak
        return blk

    def close(self, key: Hashable, end: int) -> None:
        blk = self.live.pop(key)
        blk.end = end
        self.current -= blk.size


def _select(events: Iterable[AllocEvent], device: str | None) -> list[AllocEvent]:
    chosen = [e for e in events if e.nbytes != 0 and (device is None or same_device(e.device, device))]
    return sorted(chosen, key=lambda e: e.time_ns)  # stable: simultaneous events keep the source's order


def implicit_residents(events: list[AllocEvent], resident_keys: set[Hashable]) -> list[AllocEvent]:
    """Storages the window frees but never allocates: they were alive when it began."""
    live = set(resident_keys)
    found = []
    for e in events:
        if e.nbytes > 0:
            live.add(e.key)
        elif e.key in live:
            live.discard(e.key)
        else:
            found.append(AllocEvent(e.time_ns, e.key, -e.nbytes, INITIAL_OP, device=e.device))
    return found


def trace_from_events(
    events: Iterable[AllocEvent],
    *,
    resident: Iterable[AllocEvent] = (),
    metadata: dict[str, Any] | None = None,
    limitations: Iterable[str] = (),
    alignment: int = 1,
    device: str | None = None,
    modules: dict[str, ModuleStats] | None = None,
    timings: dict[str, float] | None = None,
) -> StepTrace:
    """Blocks, tasks and peak of a window of real allocation events, as the dry run reports them.

    ``resident`` lists storages alive before the window (parameters, optimizer states...), seeded at task 0 with
    phase ``initialization`` like the dry run's; a free of a storage neither resident nor allocated in the window
    adds one such block too (category ``Other`` unless given). ``alignment`` rounds sizes as the target's
    allocator would (1: bytes as requested, the CPU). ``device`` keeps only that device's events. Block
    addresses are synthetic and sequential (real pointers would make reports differ run to run); ``users`` stays
    empty (allocation events do not say which ops read a storage).
    """
    evs = _select(events, device)
    seeds = [r for r in resident if r.nbytes > 0 and (device is None or same_device(r.device, device))]
    seeds += implicit_residents(evs, {r.key for r in seeds})
    b = _Builder(alignment)
    for r in seeds:
        if r.key in b.live:
            raise ValueError(f"resident storage {r.key!r} listed twice")
        b.open(r, 0, r.op or INITIAL_OP, Phase.INITIALIZATION, r.category or Category.OTHER)
    initial = b.current

    task = -1  # index of the open task
    task_id: Hashable | None = None
    freed_in_task = False
    for e in evs:
        if e.nbytes > 0:
            if e.key in b.live:  # the source missed a free (or reused a key): the old storage died here
                b.close(e.key, task + 1)
                freed_in_task = True
            if task < 0 or e.op_id is None or e.op_id != task_id or freed_in_task:
                task, task_id, freed_in_task = len(b.task_op), e.op_id, False
                b.task_op.append(e.op or "<unknown>")
                b.task_phase.append(e.phase)
            b.open(e, task, e.op or "<unknown>", e.phase, e.category)
        elif e.key in b.live:
            b.close(e.key, task + 1)
            if e.op_id is not None and e.op_id == task_id:
                freed_in_task = True
            else:  # between ops: whatever comes next is a new task
                task_id, freed_in_task = None, True

    num_tasks = len(b.task_op)
    finalize_blocks(b.blocks)  # categories by phase and plot coordinates, by the dry run's rule

    # Within a task every allocation precedes every free, so the live bytes of task t are the most the events
    # held during it and the sweep's maximum is the event sequence's peak (equal to the builder's running peak
    # unless the window only ever shrinks what was resident).
    live = live_bytes_by_task(b.blocks, num_tasks)
    peak, peak_task = (max(live), live.index(max(live))) if live else (initial, -1)
    phase_peak: dict[Phase, int] = {}
    for phase, nbytes in zip(b.task_phase, live, strict=True):
        phase_peak[phase] = max(phase_peak.get(phase, 0), nbytes)
    return StepTrace(
        blocks=b.blocks,
        num_tasks=num_tasks,
        task_phase=b.task_phase,
        task_op=b.task_op,
        peak=peak,
        peak_task=peak_task,
        current=b.current,
        phase_peak=phase_peak,
        modules=dict(modules or {}),
        stacks=b.stacks,
        initial=initial,
        metadata=dict(metadata or {}),
        limitations=list(limitations),
        timings=dict(timings or {}),
    )
