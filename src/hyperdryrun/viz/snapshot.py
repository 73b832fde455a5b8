"""A step's blocks -> a CUDA memory snapshot pickle, the format of ``torch.cuda.memory._snapshot()`` (torch 2.13).

PyTorch's own tooling opens it: ``python -m torch.cuda._memory_viz trace_plot|segment_plot|stats|trace`` and the web
viewer (pytorch.org/memory_viz). What goes in:

- ``device_traces[d]``: the step as the allocator would have recorded it with ``_record_memory_history`` started
  after the model was built (as a measured run records it): what existed before the step (``initialization``
  blocks: parameters, buffers, optimizer states, and the segments they opened) has no ``alloc`` or
  ``segment_alloc`` entry, only its ``free_requested`` / ``free_completed`` if the step frees it, or its place
  in ``segments``, so a reader sees it as resident before the record, as in a real snapshot, and a report and
  its own snapshot compare equal; ``segment_alloc`` / ``alloc`` when a block starts, ``free_requested`` / ``free_completed`` / ``segment_free`` when it
  ends; within a task, frees before allocations (the timeline rule of :mod:`hyperdryrun.trace.blocks`), so the
  allocated bytes after each task's entries are the live bytes of that task. ``size`` is the requested bytes (torch
  records ``orig_size``); ``time_us`` is the task index (a dry run has no clock); ``frames`` are the block's Python
  stack, innermost first, after an ``at::_ops::<op>::call`` C++ frame naming the op, as a real trace with C++
  context shows it; ``category`` is the block's category (what torch's ``profile_plot`` puts there).
- ``segments``: the state at the end of the step, each segment's ``blocks`` tiling it exactly
  (``active_allocated`` blocks and ``inactive`` gaps).

Segments come from an allocator model when one is given (:class:`Segment`); otherwise every block is its own
segment, cudaMalloc'd and cudaFree'd with it (what the allocator does with caching off), so reserved bytes equal
allocated bytes.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import pickle
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperdryrun.trace.blocks import ADDRESS_BASE, ALIGNMENT, PERSISTENT_END, Block, Phase, round_size
from hyperdryrun.viz.files import write_atomic

TENSORS_ONLY_KEY = "hyperdryrun_tensors_only"
"""Top-level key of a snapshot HyperDryRun wrote from a report: its blocks are the report's tensors only."""

PICKLE_PROTOCOL = 4
"""The web viewer's JavaScript unpickler (MemoryViz.js) reads protocols 2 to 4 only."""
SMALL_SEGMENT = 2 << 20
"""Segments of the CUDA caching allocator's small pool are 2 MiB (``kSmallBuffer``)."""
UNKNOWN = "unknown"
_OP_NAME = re.compile(r"(?:aten::)?([A-Za-z_]\w*)")


@dataclass(slots=True)
class Segment:
    """One cudaMalloc'd range of an allocator model: reserved over tasks ``[start, end)``, serving ``blocks``
    (every block it held during the step, each with its ``addr`` inside the range)."""

    address: int
    size: int
    stream: int = 0
    blocks: list[Block] = field(default_factory=list)
    start: int = 0
    end: int = PERSISTENT_END


class SnapshotError(ValueError):
    """Blocks or segments that no allocator could have produced (overlapping, outside their segment)."""


def _alive_at_end(end: int, num_tasks: int) -> bool:
    return end > num_tasks


def _before_the_step(s: Segment) -> bool:
    """Whether segment ``s`` was made for blocks that existed before the step (the model's parameters, buffers and
    optimizer states): one of them opened it."""
    return any(b.phase is Phase.INITIALIZATION and b.start == s.start for b in s.blocks)


def _op_frame(op: str) -> list[dict[str, Any]]:
    m = _OP_NAME.fullmatch(op.split(".", 1)[0]) if op else None
    if m is None or op == "initialization":
        return []
    return [{"filename": "", "line": 0, "name": f"at::_ops::{m[1]}::call"}]


def _frames_table(trace: Any) -> Any:
    """Per (stack id, op) one frames list, reused by every entry (pickle memoizes it once)."""
    cache: dict[tuple[int, str], list[dict[str, Any]]] = {}

    def frames(b: Block) -> list[dict[str, Any]]:
        key = (b.stack_id, b.op)
        got = cache.get(key)
        if got is None:
            python = [
                {"filename": f, "line": int(ln), "name": fn} for f, ln, fn in trace.stacks.frames(b.stack_id)
            ]
            got = cache[key] = _op_frame(b.op) + python
        return got

    return frames


def _events(blocks: Sequence[Block], num_tasks: int) -> list[tuple[int, int, int, Block]]:
    """(task, kind, id, block): kind 0 = free at ``end``, 1 = alloc at ``start``; frees first within a task."""
    out = []
    for b in blocks:
        out.append((b.start, 1, b.id, b))
        if not _alive_at_end(b.end, num_tasks):
            out.append((b.end, 0, b.id, b))
    out.sort(key=lambda e: e[:3])
    return out


def _overlap(blocks: Sequence[Block], num_tasks: int) -> Block | None:
    """The first block whose address range meets that of a block alive at the same time (or has no address)."""
    live: list[tuple[int, int]] = []  # (addr, end address), sorted
    for _, kind, _, b in _events(blocks, num_tasks):
        span = (b.addr, b.addr + b.size)
        if kind == 0:
            live.pop(bisect.bisect_left(live, span))
            continue
        if b.addr <= 0:
            return b
        i = bisect.bisect_left(live, span)
        if (i > 0 and live[i - 1][1] > b.addr) or (i < len(live) and live[i][0] < span[1]):
            return b
        live.insert(i, span)
    return None


def _relaid(blocks: Sequence[Block]) -> list[Block]:
    """Copies of ``blocks`` at fresh addresses, never reused (for traces whose addresses are missing or clash)."""
    out, addr = [], ADDRESS_BASE
    for b in blocks:
        out.append(dataclasses.replace(b, addr=addr))
        addr += round_size(max(b.size, 1), ALIGNMENT)
    return out


def _own_segments(blocks: Sequence[Block]) -> list[Segment]:
    return [Segment(b.addr, b.size, 0, [b], b.start, b.end) for b in blocks]


def _check_segments(segments: Sequence[Segment], blocks: Sequence[Block]) -> None:
    wanted = {b.id for b in blocks}
    placed: set[int] = set()
    for s in segments:
        if s.size <= 0:
            raise SnapshotError(f"segment at {s.address:#x}: size {s.size} is not positive")
        for b in s.blocks:
            if not (s.address <= b.addr and b.addr + b.size <= s.address + s.size):
                raise SnapshotError(
                    f"block {b.id} at {b.addr:#x} ({b.size} B) lies outside its segment at {s.address:#x} "
                    f"({s.size} B)"
                )
            if not (s.start <= b.start and b.end <= s.end):
                raise SnapshotError(
                    f"block {b.id} (tasks {b.start}-{b.end}) outlives its segment at {s.address:#x} "
                    f"(tasks {s.start}-{s.end})"
                )
            placed.add(b.id)
    missing = sorted(wanted - placed)
    if missing:
        raise SnapshotError(f"block {missing[0]} is in no segment ({len(missing)} blocks are in none)")


def _segment_type(s: Segment) -> str:
    if len(s.blocks) == 1 and s.size == s.blocks[0].size:
        return "small" if s.blocks[0].small else "large"
    return "small" if s.size <= SMALL_SEGMENT else "large"


def _final_segment(s: Segment, device: int, frames: Any, category: Any, num_tasks: int) -> dict[str, Any]:
    active = sorted((b for b in s.blocks if _alive_at_end(b.end, num_tasks)), key=lambda b: b.addr)
    out_blocks: list[dict[str, Any]] = []
    addr = s.address
    for b in active:
        if b.addr > addr:
            out_blocks.append(
                {
                    "address": addr,
                    "size": b.addr - addr,
                    "requested_size": 0,
                    "state": "inactive",
                    "frames": [],
                }
            )
        out_blocks.append(
            {
                "address": b.addr,
                "size": b.size,
                "requested_size": b.requested,
                "state": "active_allocated",
                "frames": frames(b),
                "category": category(b),
            }
        )
        addr = b.addr + b.size
    if addr < s.address + s.size:
        out_blocks.append(
            {
                "address": addr,
                "size": s.address + s.size - addr,
                "requested_size": 0,
                "state": "inactive",
                "frames": [],
            }
        )
    allocated = sum(b.size for b in active)
    return {
        "device": device,
        "address": s.address,
        "total_size": s.size,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": sum(b.requested for b in active),
        "stream": s.stream,
        "segment_type": _segment_type(s),
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": frames(s.blocks[0]) if len(s.blocks) == 1 else [],
        "blocks": out_blocks,
    }


def build_snapshot(trace: Any, segments: Iterable[Segment] | None = None, device: int = 0) -> dict[str, Any]:
    """The snapshot dict of ``trace`` (a :class:`~hyperdryrun.StepTrace`) on CUDA device ``device``.

    ``segments`` come from an allocator model; without them each block is its own segment. Blocks of zero bytes
    (the allocator hands out nothing) and blocks alive at no task are left out, as they hold no memory.
    Raises :class:`SnapshotError` on segments or addresses no allocator could have produced.
    """
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise SnapshotError(f"device: expected a CUDA device index >= 0 (got {device!r})")
    n = trace.num_tasks
    blocks = [b for b in trace.blocks if b.size > 0 and b.end > b.start]
    if segments is None:
        if _overlap(blocks, n) is not None:
            blocks = _relaid(blocks)
        segs = _own_segments(blocks)
    else:
        segs = list(segments)
        ids = {b.id for b in blocks}
        for s in segs:
            s.blocks = [b for b in s.blocks if b.id in ids]
        _check_segments(segs, blocks)
        clash = _overlap(blocks, n)
        if clash is not None:
            raise SnapshotError(
                f"block {clash.id} at {clash.addr:#x} ({clash.size} B) overlaps a block alive at the same time"
            )
    frames = _frames_table(trace)

    def category(b: Block) -> str:
        return str(b.category) if b.category is not None else UNKNOWN

    # (task, order, tie, entry): within a task, block frees, then segment frees, segment allocs, block allocs.
    timed: list[tuple[int, int, int, dict[str, Any]]] = []
    for s in segs:
        if _before_the_step(s):
            continue  # cudaMalloc'd with the model, before the record began: in ``segments`` only
        first = s.blocks[0] if len(s.blocks) == 1 else None
        seg_frames = frames(first) if first is not None else []
        seg_entry = {"addr": s.address, "size": s.size, "stream": s.stream, "frames": seg_frames}
        if first is not None:
            seg_entry["category"] = category(first)
        timed.append((s.start, 2, s.address, {"action": "segment_alloc", **seg_entry}))
        if not _alive_at_end(s.end, n):
            timed.append((s.end, 1, s.address, {"action": "segment_free", **seg_entry}))
    for task, kind, bid, b in _events(blocks, n):
        entry = {"addr": b.addr, "size": b.requested, "stream": 0, "frames": frames(b)}
        if kind == 1:
            if b.phase is Phase.INITIALIZATION:
                continue  # alive before the step: a free without an alloc, or a block of ``segments``
            timed.append((task, 3, bid, {"action": "alloc", **entry, "category": category(b)}))
        else:
            timed.append((task, 0, 2 * bid, {"action": "free_requested", **entry}))
            timed.append((task, 0, 2 * bid + 1, {"action": "free_completed", **entry}))
    timed.sort(key=lambda t: t[:3])
    entries = [{**e, "time_us": task} for task, _, _, e in timed]
    # The state below is taken after the step. The web viewer (MemoryViz.js, annotate_snapshot) fails on a trace
    # whose entries name categories but not "unknown" (it pushes to a misspelled `snapshot.categores`); the
    # snapshot entry, which holds no tensor, carries that category.
    entries.append(
        {
            "action": "snapshot",
            "addr": 0,
            "size": 0,
            "stream": 0,
            "time_us": n,
            "frames": [],
            "category": UNKNOWN,
        }
    )
    final = [
        _final_segment(s, device, frames, category, n)
        for s in sorted(segs, key=lambda s: s.address)
        if _alive_at_end(s.end, n)
    ]
    return {
        "segments": final,
        "device_traces": [[] for _ in range(device)] + [entries],
        # not in torch's format (its readers ignore it): the blocks are a report's tensors, without the runtime's
        # own allocations (cuBLAS workspaces) that a real snapshot's blocks include
        TENSORS_ONLY_KEY: True,
    }


def write_snapshot(
    trace: Any,
    report: dict[str, Any] | None,
    path: str | os.PathLike,
    segments: Iterable[Segment] | None = None,
) -> Path:
    """Write ``trace``'s snapshot pickle to ``path`` (atomically) and return the path.

    The device index is the rank's ``local_rank`` from the report's (or the trace's) metadata, as that rank's own
    ``torch.cuda.memory._dump_snapshot()`` would name it; 0 when neither says.
    """
    meta = (report or {}).get("metadata") or getattr(trace, "metadata", None) or {}
    local = meta.get("local_rank", 0)
    device = local if isinstance(local, int) and not isinstance(local, bool) and local >= 0 else 0
    data = build_snapshot(trace, segments, device)
    raw = pickle.dumps(data, protocol=PICKLE_PROTOCOL)
    if os.fspath(path).endswith(".gz"):  # what the name says (a stable header: the same bytes every time)
        import gzip

        raw = gzip.compress(raw, mtime=0)
    return write_atomic(path, raw)
