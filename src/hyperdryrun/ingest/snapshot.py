"""CUDA caching-allocator snapshot (``torch.cuda.memory._snapshot()`` / ``_dump_snapshot``) -> allocation events.

Format (torch 2.13 ``torch/cuda/memory.py``, ``_snapshot`` docstring): ``segments`` (cudaMalloc'd ranges, each with
``blocks`` in state ``active_allocated`` / ``active_pending_free`` / ``inactive``) is the state when the snapshot
was taken; ``device_traces[d]`` is the recorded history of device ``d`` (``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``/``segment_free``/``segment_map``/``segment_unmap``, ``oom``, ``snapshot``),
each entry with ``addr``, ``size`` (bytes requested), ``stream`` and ``frames`` (innermost first).

Allocated bytes, as ``torch.cuda.memory_allocated`` counts them, drop at ``free_requested`` (the allocator's
``free()`` decrements ``allocated_bytes`` and records that action; ``free_completed`` only makes the block reusable
once other streams are done), so a free is the ``free_requested`` entry, or ``free_completed`` when the trace was
recorded without ``free_requested``. Sizes are rounded to 512 B as the allocator does; a block the allocator hands
out whole (a large cached block not worth splitting) is larger than that, which only ``segments`` would show.

Reserved bytes (``torch.cuda.memory_reserved``) follow the segments: ``segments`` is their state at the snapshot,
and the trace's ``segment_alloc``/``segment_map`` and ``segment_free``/``segment_unmap`` entries (cudaMalloc and
cudaFree, or pages of an expandable segment) say how they got there, so :func:`reserved_history` reconstructs
reserved bytes over the window and the segments at its peak.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import Any

from hyperdryrun.ingest.events import AllocEvent, normalize_device, trace_from_events
from hyperdryrun.ingest.files import IngestError, user_file
from hyperdryrun.trace.blocks import ALIGNMENT, Phase
from hyperdryrun.trace.stacks import Frame
from hyperdryrun.trace.step import StepTrace

RESIDENT_OP = "resident before trace"
SMALL_SEGMENT = 2 << 20
"""kSmallBuffer: the small pool's segments are exactly 2 MiB, the large pool's never are (a 1-10 MiB request gets a
20 MiB segment, a larger one its size rounded to 2 MiB, at least 10 MiB)."""
_SEGMENT_DELTA = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
ACTIVE_STATES = frozenset({"active_allocated"})
_ATEN_FRAME = re.compile(r"at::_ops::(\w+)::")
_BACKWARD_CPP = ("torch::autograd::Engine", "evaluate_function", "torch::autograd::")


def _frames(entry: dict[str, Any]) -> list[tuple[str, int, str]]:
    out = []
    for f in entry.get("frames") or ():
        if isinstance(f, dict):
            out.append((str(f.get("filename", "")), int(f.get("line", 0) or 0), str(f.get("name", ""))))
    return out


def phase_of(frames: list[tuple[str, int, str]], any_python: bool) -> Phase:
    """optimizer (a ``torch/optim`` frame) > recompute (checkpoint's ``unpack_hook``/``recompute_fn`` or a
    reentrant checkpoint's ``backward``) > backward (autograd engine frames, or, when the trace records Python
    frames elsewhere, none at all: the engine's device threads run no Python) > forward."""
    py = [f for f in frames if f[0].endswith(".py")]
    if any("/torch/optim/" in f[0] or f[0].startswith("torch/optim/") for f in py):
        return Phase.OPTIMIZER
    if any(
        f[0].endswith("torch/utils/checkpoint.py") and f[2] in ("unpack_hook", "recompute_fn", "backward")
        for f in py
    ):
        return Phase.RECOMPUTE
    if any(any(k in f[2] for k in _BACKWARD_CPP) for f in frames):
        return Phase.BACKWARD
    if any(f[0].endswith("torch/autograd/__init__.py") and f[2] == "backward" for f in py):
        return Phase.BACKWARD
    if any_python and not py:
        return Phase.BACKWARD
    return Phase.FORWARD


def op_of(frames: list[tuple[str, int, str]]) -> str:
    """The innermost ATen op among C++ frames (``at::_ops::mm::call`` -> ``aten::mm``), else ``""``."""
    for f in frames:
        m = _ATEN_FRAME.search(f[2])
        if m:
            return f"aten::{m[1]}"
    return ""


def check_snapshot(data: Any, source: str) -> None:
    """Raise :class:`IngestError` unless ``data`` has the documented snapshot shape."""
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise IngestError(source, "not a CUDA memory snapshot (no 'segments' list)")
    traces = data.get("device_traces")
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise IngestError(source, "not a CUDA memory snapshot (no 'device_traces' list of lists)")
    for d, t in enumerate(traces):
        for i, e in enumerate(t):
            if not isinstance(e, dict) or "action" not in e:
                raise IngestError(source, f"device_traces[{d}][{i}] is not a trace entry")
            if e["action"] in ("alloc", "free_requested", "free_completed", *_SEGMENT_DELTA) and not (
                isinstance(e.get("addr"), int) and isinstance(e.get("size"), int)
            ):
                raise IngestError(source, f"device_traces[{d}][{i}] ({e['action']}) lacks integer addr/size")


def _pick_device(traces: list[list[dict[str, Any]]], device: str | None, source: str) -> int:
    if device is not None and normalize_device(device) != "cuda":
        name = normalize_device(device)
        kind, _, index = name.partition(":")
        if kind != "cuda" or not index.isdigit() or int(index) >= len(traces) or not traces[int(index)]:
            have = ", ".join(f"cuda:{d}" for d, t in enumerate(traces) if t) or "none"
            raise IngestError(source, f"no trace for device {device!r} (devices with a trace: {have})")
        return int(index)
    counts = [(len(t), -d) for d, t in enumerate(traces)]
    if not counts or max(counts)[0] == 0:
        raise IngestError(
            source, "empty trace: no device has recorded events (enable _record_memory_history)"
        )
    return -max(counts)[1]


def _on_device(seg: Any, d: int) -> bool:
    return isinstance(seg, dict) and seg.get("device", d) == d


def _pool_of(size: int) -> str:
    return "small" if size == SMALL_SEGMENT else "large"


def reserved_history(data: Any, d: int, free_action: str) -> dict[str, Any]:
    """Reserved bytes of device ``d`` over the recorded window: the peak, the allocated bytes and fragmentation
    (reserved minus allocated) at the first point where reserved is at its peak with the most bytes allocated, and
    the segments then by stream and pool. The same point as a dry run's
    (:attr:`hyperdryrun.allocator.replay.AllocatorReplay.peak_event`), so that ``compare`` reads fragmentation at
    the same moment on both sides, not where the peak is first reached on one and fullest on the other.

    The window's start is the snapshot's state with the window's events undone; allocated bytes are the trace's
    sizes rounded to 512 B (a block handed out unsplit is larger on the device, so fragmentation is an upper
    bound). Segments of expandable segments are tracked by mapped range.
    """
    segs = [s for s in data["segments"] if _on_device(s, d)]
    live: dict[int, tuple[int, int, str]] = {
        int(s["address"]): (int(s.get("total_size", 0)), int(s.get("stream", 0)), str(s.get("segment_type")))
        for s in segs
    }
    reserved = sum(size for size, _, _ in live.values())
    allocated = sum(int(s.get("allocated_size", 0)) for s in segs)
    trace = data["device_traces"][d]
    for e in reversed(trace):  # undo the window, newest first
        action = e["action"]
        if action in _SEGMENT_DELTA:
            reserved -= _SEGMENT_DELTA[action] * int(e["size"])
            if _SEGMENT_DELTA[action] > 0:
                live.pop(e["addr"], None)
            else:
                live[e["addr"]] = (int(e["size"]), int(e.get("stream", 0)), _pool_of(int(e["size"])))
        elif action == "alloc":
            allocated -= -(-int(e["size"]) // ALIGNMENT) * ALIGNMENT
        elif action == free_action:
            allocated += -(-int(e["size"]) // ALIGNMENT) * ALIGNMENT
    peak, peak_allocated, at_peak = reserved, allocated, dict(live)
    for e in trace:
        action = e["action"]
        if action in _SEGMENT_DELTA:
            reserved += _SEGMENT_DELTA[action] * int(e["size"])
            if _SEGMENT_DELTA[action] > 0:
                live[e["addr"]] = (int(e["size"]), int(e.get("stream", 0)), _pool_of(int(e["size"])))
            else:
                live.pop(e["addr"], None)
        elif action == "alloc":
            allocated += -(-int(e["size"]) // ALIGNMENT) * ALIGNMENT
        elif action == free_action:
            allocated -= -(-int(e["size"]) // ALIGNMENT) * ALIGNMENT
        if reserved > peak or (reserved == peak and allocated > peak_allocated):
            peak, peak_allocated, at_peak = reserved, allocated, dict(live)
    pools: dict[tuple[int, str], dict[str, Any]] = {}
    for size, stream, pool in at_peak.values():
        row = pools.setdefault((stream, pool), {"stream": stream, "pool": pool, "segments": 0, "bytes": 0})
        row["segments"] += 1
        row["bytes"] += size
    return {
        "peak_reserved_bytes": peak,
        "allocated_at_reserved_peak_bytes": peak_allocated,
        "fragmentation_bytes": peak - peak_allocated,
        "segments_by_pool": [pools[k] for k in sorted(pools)],
        "reserved_at_snapshot_bytes": sum(int(s.get("total_size", 0)) for s in segs),
    }


def snapshot_events(
    data: Any, source: str, device: str | None = None
) -> tuple[list[AllocEvent], list[AllocEvent], dict[str, Any]]:
    """(events of the window, storages alive before it and never freed, facts) for one device of a snapshot."""
    check_snapshot(data, source)
    traces = data["device_traces"]
    d = _pick_device(traces, device, source)
    trace = traces[d]
    dev = f"cuda:{d}"
    free_action = (
        "free_requested" if any(e["action"] == "free_requested" for e in trace) else "free_completed"
    )
    entries = [(i, e, _frames(e)) for i, e in enumerate(trace) if e["action"] in ("alloc", free_action)]
    any_python = any(f[0].endswith(".py") for _, _, fr in entries for f in fr)
    events: list[AllocEvent] = []
    live: set[Hashable] = set()
    for i, e, frames in entries:
        if e["action"] == "alloc":
            user: tuple[Frame, ...] = tuple(f for f in frames if user_file(f[0]))
            events.append(
                AllocEvent(
                    time_ns=i,
                    key=e["addr"],
                    nbytes=e["size"],
                    op=op_of(frames),
                    phase=phase_of(frames, any_python),
                    frames=user,
                    device=dev,
                )
            )
            live.add(e["addr"])
        else:
            events.append(AllocEvent(time_ns=i, key=e["addr"], nbytes=-e["size"], device=dev))
            live.discard(e["addr"])
    resident = []
    for seg in data["segments"]:
        if not isinstance(seg, dict) or seg.get("device", d) != d:
            continue
        for blk in seg.get("blocks") or ():
            if not isinstance(blk, dict) or blk.get("state") not in ACTIVE_STATES:
                continue
            addr = blk.get("address")
            if addr is None or addr in live:
                continue
            resident.append(
                AllocEvent(
                    time_ns=-1,
                    key=addr,
                    nbytes=int(blk["size"]),
                    op=RESIDENT_OP,
                    phase=Phase.INITIALIZATION,
                    frames=tuple(f for f in _frames(blk) if user_file(f[0])),
                    device=dev,
                )
            )
    info = {
        "device": dev,
        "free_action": free_action,
        "ooms": sum(1 for e in trace if e["action"] == "oom"),
        "reserved_bytes": sum(int(s.get("total_size", 0)) for s in data["segments"] if _on_device(s, d)),
        "reserved": reserved_history(data, d, free_action),
    }
    return events, resident, info


def trace_from_snapshot(data: Any, source: str = "<snapshot>", device: str | None = None) -> StepTrace:
    """A :class:`StepTrace` of one device's recorded allocations (default: the device with the longest trace).

    Storages alive at the snapshot that the window never allocated, and storages the window frees without having
    allocated them, existed before it: they are ``initialization`` blocks from task 0. Module names are not in a
    snapshot (``module`` stays empty); ops come from ATen C++ frames when the trace recorded them.
    """
    events, resident, info = snapshot_events(data, source, device)
    if not any(e.nbytes > 0 for e in events) and not resident:
        raise IngestError(source, f"empty trace: no allocations recorded for {info['device']}")
    limitations = [
        "from a CUDA snapshot: no module names; ops only where C++ frames were recorded; sizes rounded to 512 B "
        "(a large block handed out unsplit is larger on the device)",
    ]
    if info["free_action"] == "free_completed":
        limitations.append("trace has no free_requested entries: frees taken at free_completed (later)")
    if info["ooms"]:
        limitations.append(f"the trace records {info['ooms']} out-of-memory event(s)")
    meta = {
        "mode": "ingested",
        "source_kind": "cuda_snapshot",
        "source": source,
        "target_device": info["device"],
        "reserved_bytes_at_snapshot": info["reserved_bytes"],
        "reserved": info["reserved"],
        # a real snapshot's blocks are the allocator's (max_memory_allocated); one HyperDryRun wrote from a report
        # holds that report's tensors only
        "allocator_blocks": not (isinstance(data, dict) and data.get("hyperdryrun_tensors_only")),
    }
    return trace_from_events(
        events, resident=resident, metadata=meta, limitations=limitations, alignment=ALIGNMENT
    )
