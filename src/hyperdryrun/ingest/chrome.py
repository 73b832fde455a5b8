"""PyTorch profiler Chrome trace (``export_chrome_trace`` with ``profile_memory=True``) -> allocation events.

Each ``[memory]`` instant event is one allocation (``Bytes > 0``) or free (``Bytes < 0``) of the storage at ``Addr``
(the trace has no allocation id, so a storage is identified by its address; a free closes it, so reuse is safe).
The ``X`` events of the same thread that enclose it give the rest: the op (innermost ``aten::``-style op, skipping
the ``empty``/``resize_`` helpers a kernel allocates through), the Python frames (``python_function`` events,
``with_stack=True``), the module path (``nn.Module: Linear_2`` events, instance names rather than FQNs: the trace
does not record attribute names) and the phase (optimizer > recompute > backward > forward). Without
``with_stack=True`` there are no Python frames: recompute (found by ``torch/utils/checkpoint.py`` frames inside
backward) then reads as backward, and stacks are empty.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from hyperdryrun.ingest.events import AllocEvent, implicit_residents, normalize_device, trace_from_events
from hyperdryrun.ingest.files import SPAN_DEPTH, IngestError, user_file
from hyperdryrun.trace.blocks import Phase
from hyperdryrun.trace.stacks import Frame
from hyperdryrun.trace.step import StepTrace

# c10::DeviceType (c10/core/DeviceType.h), the integer a Chrome trace stores in "Device Type".
DEVICE_TYPES = {
    0: "cpu",
    1: "cuda",
    2: "mkldnn",
    3: "opengl",
    4: "opencl",
    5: "ideep",
    6: "hip",
    7: "fpga",
    8: "maia",
    9: "xla",
    10: "vulkan",
    11: "metal",
    12: "xpu",
    13: "mps",
    14: "meta",
    15: "hpu",
    16: "ve",
    17: "lazy",
    18: "ipu",
    19: "mtia",
    20: "privateuse1",
}
MEMORY_EVENT = "[memory]"
RESIDENT_OP = "resident before trace"
"""``op`` of the one block standing for bytes the allocator held before the trace began ("Total Allocated")."""
_HELPER_OPS = frozenset(
    {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided"}
    | {"aten::resize_"}
)
_SPAN_CATS = frozenset({"cpu_op", "python_function", "user_annotation"})
_PY_FRAME = re.compile(r"^(?P<file>.*)\((?P<line>\d+)\): (?P<func>.*)$")
MODULE_PREFIX = "nn.Module: "


def device_name(device_type: Any, device_id: Any) -> str:
    """``(1, 0)`` -> ``cuda:0``, ``(0, -1)`` -> ``cpu``, ``(20, 3)`` -> ``npu:3`` (also accepts type names)."""
    kind = (
        DEVICE_TYPES.get(device_type, str(device_type)) if isinstance(device_type, int) else str(device_type)
    )
    index = int(device_id) if isinstance(device_id, int | float) else -1
    return normalize_device(f"{kind}:{index}" if index >= 0 else kind)


def parse_frame(name: str) -> Frame | None:
    """``model.py(12): forward`` -> ``("model.py", 12, "forward")``; None for C functions and module events."""
    m = _PY_FRAME.match(name)
    if m is None:
        return None
    return (m["file"], int(m["line"]), m["func"])


@dataclass(slots=True)
class _Span:
    start: int
    end: int
    name: str
    cat: str
    idx: int
    frame: Frame | None


def _ns(ts: Any) -> int:
    return round(float(ts) * 1000)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, int | float | str | bool | None) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def check_event(e: dict[str, Any], idx: int, source: str) -> None:
    """Raise a one-line :class:`IngestError` unless the fields a reader uses have the types PyTorch writes: the
    time stamp and duration numbers, thread ids plain values, a ``[memory]`` event's byte counts and address
    integers (other events are not read and not checked)."""
    memory = e.get("name") == MEMORY_EVENT
    what = "[memory] event" if memory else "event"
    if not memory:
        if e.get("ph") != "X":
            return
        if not isinstance(e.get("cat"), str | None):
            raise IngestError(source, f"event #{idx}: cat must be a string (got {_shown(e['cat'])})")
        if e.get("cat") not in _SPAN_CATS:
            return
    for key in ("ts", "dur"):
        if key in e and not _is_number(e[key]):
            raise IngestError(source, f"{what} #{idx}: {key} must be a finite number (got {_shown(e[key])})")
    for key in ("pid", "tid"):
        if key in e and not isinstance(e[key], int | float | str | None):
            raise IngestError(
                source, f"{what} #{idx}: {key} must be a number or a string (got {_shown(e[key])})"
            )
    if what == "event":
        return
    args = e.get("args")
    if not isinstance(args, dict) or "Bytes" not in args or "Addr" not in args or "ts" not in e:
        raise IngestError(source, f"[memory] event #{idx} lacks ts, args.Bytes or args.Addr")
    for key in ("Bytes", "Addr", "Total Allocated", "Device Id"):
        if key in args and not _is_int(args[key]):
            raise IngestError(
                source, f"[memory] event #{idx}: {key} must be an integer (got {_shown(args[key])})"
            )
    if "Device Type" in args and not isinstance(args["Device Type"], int | str):
        raise IngestError(
            source,
            f"[memory] event #{idx}: Device Type must be an integer or a name (got {_shown(args['Device Type'])})",
        )


def trace_events(data: Any, source: str) -> list[dict[str, Any]]:
    """The ``traceEvents`` list of a Chrome trace (object or bare array form), checked for shape."""
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise IngestError(source, "not a Chrome trace (no 'traceEvents' list of event objects)")
    return events


@dataclass(frozen=True)
class _Context:
    op: str
    op_id: int | None
    phase: Phase
    module: str
    frames: tuple[Frame, ...]


def _context(stack: list[_Span]) -> _Context:
    """What the enclosing spans (outermost first) say about an allocation inside them."""
    ops = [s for s in stack if s.cat == "cpu_op"]
    named = [s for s in ops if "::" in s.name and not s.name.startswith(("autograd::", "torch::autograd::"))]
    chosen = next((s for s in reversed(named) if s.name not in _HELPER_OPS), None)
    chosen = chosen or (named[-1] if named else (ops[-1] if ops else None))
    frames = [s.frame for s in stack if s.frame is not None]
    backward = any(
        s.cat == "cpu_op" and s.name.startswith("autograd::engine::evaluate_function") for s in stack
    )
    backward = backward or any(
        (f[0].endswith("torch/autograd/__init__.py") and f[2] == "backward") or f[2] == "_engine_run_backward"
        for f in frames
    )
    if any(s.name.startswith("Optimizer.step#") for s in stack):
        phase = Phase.OPTIMIZER
    elif backward and any(f[0].endswith("torch/utils/checkpoint.py") for f in frames):
        phase = Phase.RECOMPUTE
    elif backward:
        phase = Phase.BACKWARD
    else:
        phase = Phase.FORWARD
    modules = [s.name[len(MODULE_PREFIX) :] for s in stack if s.name.startswith(MODULE_PREFIX)]
    user = tuple(f for f in reversed(frames) if user_file(f[0]))
    return _Context(
        op=chosen.name if chosen else "",
        op_id=chosen.idx if chosen else None,
        phase=phase,
        module=".".join(modules),
        frames=user,
    )


def choose_device(devices: Counter[str], wanted: str | None, source: str) -> str:
    """``wanted`` if given (checked), else the accelerator with the most events, else the CPU."""
    if wanted is not None:
        wanted = normalize_device(wanted)
        matching = sorted(d for d in devices if d == wanted or d.partition(":")[0] == wanted)
        have = ", ".join(sorted(devices)) or "none"
        if not matching:
            raise IngestError(source, f"no memory events on device {wanted!r} (devices: {have})")
        if len(matching) > 1:
            raise IngestError(
                source, f"device {wanted!r} is ambiguous (devices: {have}); name one with its index"
            )
        return matching[0]
    accel = [(n, d) for d, n in devices.items() if not d.startswith("cpu")]
    if accel:
        return sorted(accel, key=lambda nd: (-nd[0], nd[1]))[0][1]
    return "cpu"


def chrome_events(
    data: Any, source: str, device: str | None = None
) -> tuple[list[AllocEvent], dict[str, Any]]:
    """The allocation events of one device in a Chrome trace, and facts about them (device, baseline bytes)."""
    events = trace_events(data, source)
    spans: dict[tuple[Any, Any], list[_Span]] = defaultdict(list)
    memory: list[tuple[int, int, dict[str, Any]]] = []
    for idx, e in enumerate(events):
        check_event(e, idx, source)
        if e.get("name") == MEMORY_EVENT:
            memory.append((idx, _ns(e["ts"]), e))
        elif e.get("ph") == "X" and e.get("cat") in _SPAN_CATS and "ts" in e:
            start = _ns(e["ts"])
            name = str(e.get("name", ""))
            frame = parse_frame(name) if e["cat"] == "python_function" else None
            spans[(e.get("pid"), e.get("tid"))].append(
                _Span(start, start + _ns(e.get("dur", 0)), name, e["cat"], idx, frame)
            )
    if not memory:
        raise IngestError(source, "no [memory] events (export a trace profiled with profile_memory=True)")
    devices = Counter(
        device_name(e["args"].get("Device Type", 0), e["args"].get("Device Id", -1)) for _, _, e in memory
    )
    chosen = choose_device(devices, device, source)

    def on_device(e: dict[str, Any]) -> bool:
        return device_name(e["args"].get("Device Type", 0), e["args"].get("Device Id", -1)) == chosen

    mine = sorted((m for m in memory if on_device(m[2])), key=lambda m: (m[1], m[0]))
    by_thread: dict[tuple[Any, Any], list[tuple[int, int, dict[str, Any]]]] = defaultdict(list)
    for m in mine:
        by_thread[(m[2].get("pid"), m[2].get("tid"))].append(m)
    contexts: dict[int, _Context] = {}
    depth = SPAN_DEPTH.of(source)
    for thread, mems in by_thread.items():
        ordered = sorted(spans.get(thread, ()), key=lambda s: (s.start, -s.end, s.idx))
        stack: list[_Span] = []
        k = 0
        for idx, t, _ in mems:
            while k < len(ordered) and ordered[k].start <= t:
                stack = [s for s in stack if s.end >= ordered[k].start]
                stack.append(ordered[k])
                k += 1
                if len(stack) > depth:
                    raise IngestError(
                        source, f"spans nest deeper than {depth} on thread {thread} ({SPAN_DEPTH.hint})"
                    )
            stack = [s for s in stack if s.end >= t]
            contexts[idx] = _context(stack)
    out: list[AllocEvent] = []
    for idx, t, e in mine:
        args = e["args"]
        nbytes = int(args["Bytes"])
        ctx = contexts[idx]
        out.append(
            AllocEvent(
                time_ns=t,
                key=int(args["Addr"]),
                nbytes=nbytes,
                op=ctx.op,
                op_id=ctx.op_id,
                phase=ctx.phase,
                module=ctx.module,
                frames=ctx.frames,
                device=chosen,
            )
        )
    first = mine[0][2]["args"]
    baseline = None
    if "Total Allocated" in first:
        baseline = int(first["Total Allocated"]) - int(first["Bytes"])
    peak_reported = max((int(m[2]["args"].get("Total Allocated", -1)) for m in mine), default=-1)
    info = {"device": chosen, "baseline_bytes": baseline, "reported_peak_bytes": peak_reported}
    return out, info


def _unallocated_frees(events: list[AllocEvent]) -> int:
    """Bytes freed in the window of storages the window never allocated (they were alive when it began)."""
    return sum(e.nbytes for e in implicit_residents(events, set()))


def trace_from_chrome(
    data: Any, source: str = "<trace>", device: str | None = None, alignment: int = 1
) -> StepTrace:
    """A :class:`StepTrace` of one device's memory in a Chrome trace (``data``: the parsed JSON).

    Bytes alive before the trace that it never frees are one ``resident before trace`` block (from the first
    event's ``Total Allocated`` less its ``Bytes``), so the peak counts them as the allocator did. ``alignment``
    rounds sizes (1: the bytes as recorded; CUDA's allocator records already-rounded block sizes).
    """
    events, info = chrome_events(data, source, device)
    resident: list[AllocEvent] = []
    limitations = [
        "from a profiler Chrome trace: module names are instance names (nn.Module: Class_n), not FQNs; "
        "storages alive before the trace are not attributed (one 'resident before trace' block or none)"
    ]
    if info["baseline_bytes"] is not None:
        residual = info["baseline_bytes"] - _unallocated_frees(events)
        if residual > 0:
            resident.append(AllocEvent(-1, ("resident",), residual, RESIDENT_OP, device=info["device"]))
        elif residual < 0:
            limitations.append(
                f"'Total Allocated' does not account for {-residual} B freed in the trace: residents unknown"
            )
    meta = {
        "mode": "ingested",
        "source_kind": "chrome_trace",
        "source": source,
        "target_device": info["device"],
        "reported_peak_bytes": info["reported_peak_bytes"],
    }
    return trace_from_events(
        events, resident=resident, metadata=meta, limitations=limitations, alignment=alignment, device=None
    )
