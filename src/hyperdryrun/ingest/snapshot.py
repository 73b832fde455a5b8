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
            if e["action"] in ("alloc", "free_requested", "free_completed") and not (
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
        "reserved_bytes": sum(
            int(s.get("total_size", 0))
            for s in data["segments"]
            if isinstance(s, dict) and s.get("device", d) == d
        ),
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
    }
    return trace_from_events(
        events, resident=resident, metadata=meta, limitations=limitations, alignment=ALIGNMENT
    )
