"""Blocks -> report: the summary, per-phase and per-module figures, the peak live set and the CSV rows.

Everything here reads a :class:`~hyperdryrun.engine.StepTrace` (plain data) and returns plain data; nothing here
depends on when or how fast the run happened, so identical inputs give byte-identical reports.
"""

from __future__ import annotations

import csv
import io
import math
from typing import TYPE_CHECKING, Any

from hyperdryrun.allocator import AllocatorOptions, DeviceMemory, OutsideCost, Workspace, device_memory
from hyperdryrun.allocator.verdict import AT_RISK, OOM, Margin, verdict_fields
from hyperdryrun.report.schema import (
    CSV_COLUMNS,
    GIB,
    NOT_MODELLED,
    NOT_MODELLED_CUDA,
    SCHEMA_VERSION,
    SEGMENT_CSV_COLUMNS,
    human_bytes,
)
from hyperdryrun.trace.blocks import (
    CATEGORY_ORDER,
    PERSISTENT_END,
    STEP_PHASES,
    Block,
    Category,
    Phase,
    live_bytes_by_task,
)
from hyperdryrun.trace.stacks import format_stack

if TYPE_CHECKING:
    from hyperdryrun.world.target import DeviceTarget


def gib(nbytes: int) -> float:
    return round(nbytes / GIB, 6)


def breakdown(blocks: list[Block]) -> dict[str, int]:
    """Bytes per category, every category present (zero included), in the category order."""
    out = {str(c): 0 for c in CATEGORY_ORDER}
    for b in blocks:
        out[str(b.category or Category.OTHER)] += b.size
    return out


def alive_at(blocks: list[Block], task: int) -> list[Block]:
    return [b for b in blocks if b.start <= task < b.end]


def _stack(trace: Any, b: Block) -> list[dict[str, Any]]:
    return [{"file": f, "line": ln, "function": fn} for f, ln, fn in trace.stacks.frames(b.stack_id)]


def block_record(trace: Any, b: Block, with_stack: bool = True) -> dict[str, Any]:
    rec = {
        "id": b.id,
        "size": b.size,
        "requested": b.requested,
        "category": str(b.category),
        "op": b.op,
        "module": b.module,
        "phase": str(b.phase),
        "micro_batch": b.micro_batch,
        "start": b.start,
        "end": None if b.persistent else b.end,
        "persistent": b.persistent,
        "device_addr": b.addr,
    }
    if with_stack:
        rec["stack"] = _stack(trace, b)
    return rec


RECORDED_RESERVED_KEYS = (
    "peak_reserved_bytes",
    "allocated_at_reserved_peak_bytes",
    "fragmentation_bytes",
    "segments_by_pool",
)
"""Summary keys an ingested CUDA snapshot gives from its own segments (``metadata.reserved``)."""
NCCL_LINE = "NCCL buffers"
CONTEXT_LINE = "CUDA context"


def device_memory_of(trace: Any, capacity: int | None = None) -> DeviceMemory | None:
    """The allocator stage for a dry run of a CUDA target (``metadata.cuda``): the step's blocks and cuBLAS
    workspaces through the caching allocator under the job's settings, NCCL buffers and the CUDA context beside
    it, against ``capacity`` bytes (:attr:`DeviceTarget.capacity_bytes <hyperdryrun.world.target.DeviceTarget>`;
    None: no capacity). None for other traces."""
    cuda = (trace.metadata or {}).get("cuda")
    if not cuda:
        return None
    alloc = cuda["allocator"]
    ws = cuda["cublas_workspace"]
    workspaces = [
        Workspace(
            f"cuBLAS workspace ({h['thread']} thread)", h["stream"], h["first_task"], ws["bytes_per_handle"]
        )
        for h in ws["handles"]
    ]
    outside = [
        OutsideCost(NCCL_LINE, cuda["nccl"]["bytes"], cuda["nccl"]["formula"]),
        OutsideCost(CONTEXT_LINE, cuda["cuda_context"]["bytes"], cuda["cuda_context"]["source"]),
    ]
    options = AllocatorOptions.parse(alloc["settings"], source=alloc["source"])
    return device_memory(trace.blocks, trace.peak, workspaces, outside, options, capacity)


def _stream_names(trace: Any) -> dict[int, str]:
    cuda = (trace.metadata or {}).get("cuda") or {}
    return {s["id"]: s["name"] for s in cuda.get("streams", [])}


def _replay_phase(trace: Any, r: Any) -> str | None:
    """The phase of the replay's reserved peak: that of its task in the step (the cache the step starts from is
    the step before's, so the tensors from before the step are no event of it)."""
    task = r.peak_task
    return str(trace.task_phase[task]) if 0 <= task < len(trace.task_phase) else None


def device_summary(trace: Any, dm: DeviceMemory) -> dict[str, Any]:
    """The keys ``summary`` gains for a CUDA target (:data:`hyperdryrun.report.schema.SUMMARY_DEVICE_KEYS`)."""
    r = dm.replay
    names = _stream_names(trace)
    task = r.peak_task
    cuda = trace.metadata["cuda"]
    return {
        "peak_allocated_bytes": dm.peak_allocated,
        "peak_reserved_bytes": dm.peak_reserved,
        "peak_device_bytes": dm.peak_device,
        "peak_reserved_task": task,
        "peak_reserved_phase": _replay_phase(trace, r),
        "allocated_at_reserved_peak_bytes": r.allocated_at_peak,
        "fragmentation_bytes": dm.fragmentation,
        "reserved_breakdown": [
            {**row, "stream_name": names.get(row["stream"])} if row["stream"] is not None else row
            for row in dm.breakdown()
        ],
        "segments_by_pool": [{**row, "stream_name": names.get(row["stream"])} for row in dm.pools()],
        "device_lines": dm.lines(),
        "allocator": {
            "settings": cuda["allocator"]["settings"],
            "source": cuda["allocator"]["source"],
            "device_allocs": r.device_allocs,
            "device_frees": r.device_frees,
            "alloc_retries": r.alloc_retries,
        },
    }


def _margin_text(v: dict[str, Any]) -> str:
    return f"margin {human_bytes(v['margin_bytes'])}"


def _device_verdict(
    trace: Any, dm: DeviceMemory, capacity: int, gib_text: str, margin: Margin
) -> dict[str, Any]:
    headroom = capacity - dm.peak_device
    figures = (
        f"allocated {human_bytes(dm.peak_allocated)}, reserved {human_bytes(dm.peak_reserved)}, "
        f"device {human_bytes(dm.peak_device)}"
    )
    v = verdict_fields(dm.peak_device, capacity, margin, oom=dm.oom is not None)
    if v["fit"] == OOM:
        o = dm.oom
        verdict = (
            f"OOM: the device peak {human_bytes(dm.peak_device)} exceeds {gib_text} GiB by "
            f"{human_bytes(-headroom)}, {dm.tipping_line()} tips it ({figures})"
        )
        if o is not None:
            op = trace.task_op[o.task] if 0 <= o.task < len(trace.task_op) else "?"
            verdict += (
                f"; the caching allocator cannot get {human_bytes(o.alloc_size)} at task {o.task} ({op}) with "
                f"{human_bytes(o.reserved)} reserved"
            )
        if -headroom <= v["margin_bytes"]:
            verdict += f" (within the model's error, {_margin_text(v)}: the real step may still fit)"
    else:
        verdict = (
            f"{v['fit']}: device peak {human_bytes(dm.peak_device)} of {gib_text} GiB, "
            f"{human_bytes(headroom)} headroom, {_margin_text(v)} ({figures})"
        )
        if v["fit"] == AT_RISK:
            verdict += "; within the model's error of the capacity: the real step may not fit"
        if dm.replay.alloc_retries:
            verdict += f"; the allocator had to release its cache {dm.replay.alloc_retries} time(s) to fit"
    return {
        "headroom_bytes": headroom,
        "headroom_gib": gib(headroom),
        **v,
        "verdict": verdict,
        "verdict_line": dm.tipping_line(),
    }


def summarize(
    trace: Any, target: DeviceTarget | None = None, device: DeviceMemory | None = None
) -> dict[str, Any]:
    """Peak and what it consists of, bytes after the step, the device figures of a CUDA target (``device``: its
    allocator stage) and the verdict against ``target``'s capacity (on device bytes where the allocator stage ran;
    its margin: how far under the capacity "fits" starts, :mod:`hyperdryrun.allocator.verdict`)."""
    margin = target.margin if target is not None else Margin()
    device_memory_gib = target.device_memory_gib if target is not None else None
    blocks = trace.blocks
    peak_task = trace.peak_task
    at_peak = alive_at(blocks, peak_task) if peak_task >= 0 else []
    after = [b for b in blocks if b.persistent]
    s: dict[str, Any] = {
        "peak_bytes": trace.peak,
        "peak_gib": gib(trace.peak),
        "peak_task": peak_task,
        "peak_phase": str(trace.task_phase[peak_task]) if peak_task >= 0 else None,
        "peak_op": trace.task_op[peak_task] if peak_task >= 0 else None,
        "peak_micro_batch": max((b.micro_batch for b in at_peak if b.start == peak_task), default=None),
        "breakdown_at_peak": breakdown(at_peak),
        "initial_bytes": trace.initial,
        "current_bytes": trace.current,
        "current_gib": gib(trace.current),
        "breakdown_after_step": breakdown(after),
        "num_tasks": trace.num_tasks,
        "num_blocks": len(blocks),
    }
    creators = [b for b in at_peak if b.start == peak_task]
    s["peak_module"] = creators[-1].module if creators else None
    recorded = (trace.metadata or {}).get("reserved")  # an ingested CUDA snapshot's own segments
    if device is None and recorded:
        s.update({k: recorded[k] for k in RECORDED_RESERVED_KEYS})
    if device is not None:
        s.update(device_summary(trace, device))
        if device.capacity is not None:
            gib_value = device_memory_gib if device_memory_gib is not None else device.capacity / GIB
            s["capacity_bytes"] = device.capacity
            s["capacity_gib"] = gib_value
            # the user's figure as given; a preset's (torch's total_memory) to two decimals
            gib_text = f"{device_memory_gib:g}" if device_memory_gib is not None else f"{gib_value:.2f}"
            s.update(_device_verdict(trace, device, device.capacity, gib_text, margin))
    elif device_memory_gib is not None:
        capacity = int(round(device_memory_gib * GIB))
        headroom = capacity - trace.peak
        s["capacity_bytes"] = capacity
        s["capacity_gib"] = device_memory_gib
        s["headroom_bytes"] = headroom
        s["headroom_gib"] = gib(headroom)
        v = verdict_fields(trace.peak, capacity, margin)
        s.update(v)
        s["verdict"] = (
            f"OOM: peak {human_bytes(trace.peak)} exceeds {device_memory_gib:g} GiB by {human_bytes(-headroom)}"
            if v["fit"] == OOM
            else f"{v['fit']}: peak {human_bytes(trace.peak)} of {device_memory_gib:g} GiB, "
            f"{human_bytes(headroom)} headroom, {_margin_text(v)} (allocated bytes; see limitations)"
        )
    return s


def phases(trace: Any) -> dict[str, Any]:
    """Per phase: the peak of live bytes over the phase's allocating tasks, where it is and what it consists of.

    Computed from the block lifetimes, so each phase peak is exactly reconstructible from the CSV.
    """
    live = live_bytes_by_task(trace.blocks, trace.num_tasks)
    allocating = {b.start for b in trace.blocks}
    best: dict[Phase, tuple[int, int]] = {}
    # At allocating tasks only (live bytes grow only there; see MemoryTracker._end_task); a phase without any
    # allocation falls back to all of its tasks.
    for only_allocating in (True, False):
        found: dict[Phase, tuple[int, int]] = {}
        for t, (phase, nbytes) in enumerate(zip(trace.task_phase, live, strict=True)):
            if (t in allocating or not only_allocating) and (phase not in found or nbytes > found[phase][0]):
                found[phase] = (nbytes, t)
        best = {**found, **best}
    out: dict[str, Any] = {}
    for phase in STEP_PHASES:
        if phase not in best:
            continue
        nbytes, t = best[phase]
        out[str(phase)] = {
            "peak_bytes": nbytes,
            "peak_gib": gib(nbytes),
            "peak_task": t,
            "peak_op": trace.task_op[t],
            "num_tasks": sum(1 for p in trace.task_phase if p is phase),
            "breakdown_at_peak": breakdown(alive_at(trace.blocks, t)),
        }
    return out


def modules(trace: Any, at_peak: list[Block]) -> list[dict[str, Any]]:
    held: dict[str, int] = {}
    for b in at_peak:
        held[b.module] = held.get(b.module, 0) + b.size
    return [
        {
            "fqn": m.fqn,
            "param_bytes": m.param_bytes,
            "buffer_bytes": m.buffer_bytes,
            "input_bytes": m.input_bytes,
            "output_bytes": m.output_bytes,
            "forward_peak_bytes": m.fw_peak,
            "backward_peak_bytes": m.bw_peak,
            "calls": m.calls,
            "bytes_allocated_by_module_at_peak": held.pop(m.fqn, 0),
        }
        for m in trace.modules.values()
    ]


OUTSIDE_MODULES = "<outside modules>"


def top_level(fqn: str) -> str:
    """The model-level unit an FQN belongs to: ``layers.3.attention.wq`` -> ``layers.3``, ``output`` -> ``output``
    (a numbered child of a container counts as its own unit, so each decoder layer is one row)."""
    parts = fqn.split(".")
    if len(parts) > 1 and parts[1].isdigit():
        return ".".join(parts[:2])
    return parts[0]


def peak_live_set(trace: Any, limit: int) -> dict[str, Any]:
    """The blocks alive at the global peak, largest first (ties by allocation order), the first ``limit`` in full."""
    at_peak = alive_at(trace.blocks, trace.peak_task) if trace.peak_task >= 0 else []
    ranked = sorted(at_peak, key=lambda b: (-b.size, b.id))
    by_module: dict[str, int] = {}
    by_block: dict[str, int] = {}
    for b in at_peak:
        key = b.module or OUTSIDE_MODULES
        by_module[key] = by_module.get(key, 0) + b.size
        top = top_level(key)
        by_block[top] = by_block.get(top, 0) + b.size

    def ranked_items(d: dict[str, int]) -> list[dict[str, Any]]:
        return [{"module": m, "bytes": n} for m, n in sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))]

    shown = ranked[:limit]
    return {
        "task": trace.peak_task,
        "num_blocks": len(at_peak),
        "total_bytes": sum(b.size for b in at_peak),
        "shown": len(shown),
        "rest_bytes": sum(b.size for b in ranked[limit:]),
        "by_module": ranked_items(by_module),
        "by_top_level_module": ranked_items(by_block),
        "blocks": [block_record(trace, b) for b in shown],
    }


def build_report(
    trace: Any,
    target: DeviceTarget | None = None,
    live_set_limit: int = 50,
    device: DeviceMemory | None = None,
) -> dict[str, Any]:
    """The JSON report of one rank (see :mod:`hyperdryrun.report.schema`), judged against ``target`` (its capacity
    and the verdict's margin, :class:`~hyperdryrun.world.target.DeviceTarget`; None: no capacity, no verdict);
    ``device``: the allocator stage's result when already computed (:func:`device_memory_of`, also what
    :func:`segments_csv` writes)."""
    at_peak = alive_at(trace.blocks, trace.peak_task) if trace.peak_task >= 0 else []
    if device is None:
        device = device_memory_of(trace, None if target is None else target.capacity_bytes)
    return {
        "schema_version": SCHEMA_VERSION,
        "status": "ok",
        "metadata": trace.metadata,
        "summary": summarize(trace, target, device),
        "phases": phases(trace),
        "modules": modules(trace, at_peak),
        "peak_live_set": peak_live_set(trace, live_set_limit),
        "limitations": [*trace.limitations, *(NOT_MODELLED_CUDA if device is not None else NOT_MODELLED)],
    }


def error_report(stage: str, error: BaseException, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "status": "error",
        "stage": stage,
        "error": {"type": type(error).__name__, "message": one_line(str(error))},
        "metadata": metadata or {},
    }


def one_line(msg: str) -> str:
    return " ".join(msg.split()) or "(no message)"


def _plot(x: float) -> str:
    if not math.isfinite(x) or x >= PERSISTENT_END:
        return str(PERSISTENT_END)
    return f"{x:.12f}"


def csv_rows(trace: Any) -> list[list[Any]]:
    rows = []
    formatted: dict[int, str] = {}
    for b in trace.blocks:
        frames = trace.stacks.frames(b.stack_id)
        stack = formatted.get(b.stack_id)
        if stack is None:
            stack = formatted[b.stack_id] = format_stack(frames)
        rows.append(
            [
                b.start,
                b.end,
                _plot(b.start_plot),
                _plot(b.end_plot),
                b.addr,
                b.stream,
                "small" if b.small else "large",
                b.size,
                b.used_after_alloc,
                b.peak_after_alloc,
                frames[0][0] if frames else "",
                frames[0][1] if frames else "",
                str(b.category),
                b.start,
                str(b.phase),
                b.op,
                b.module,
                "{" + "-".join(map(str, b.users)) + "}",
                b.users[-1] if b.users else "",
                stack,
                b.persistent,
                b.small,
            ]
        )
    return rows


def blocks_csv(trace: Any) -> str:
    """The memory-block CSV: one row per block, in allocation order."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    w.writerows(csv_rows(trace))
    return buf.getvalue()


def segment_rows(trace: Any, device: DeviceMemory) -> list[list[Any]]:
    """One row per block of every segment at the reserved peak, by address (:data:`SEGMENT_CSV_COLUMNS`)."""
    names = _stream_names(trace)
    blocks = {b.id: b for b in trace.blocks}
    rows = []
    for seg in device.segments:
        for b in seg.blocks:
            ws = device.workspace_ids.get(b.block) if b.block is not None else None
            traced = blocks[b.block] if b.block is not None and ws is None else None
            rows.append(
                [
                    seg.address,
                    seg.size,
                    seg.stream,
                    names.get(seg.stream, ""),
                    seg.pool,
                    seg.expandable,
                    b.address,
                    b.size,
                    b.state,
                    traced.id if traced is not None else "",
                    b.requested,
                    str(traced.category) if traced is not None else ("cuBLAS workspace" if ws else ""),
                    traced.op if traced is not None else (ws.label if ws else ""),
                ]
            )
    return rows


def segments_csv(trace: Any, device: DeviceMemory) -> str:
    """The segment CSV of a CUDA target (``rank_<r>_segments.csv``): the caching allocator at its reserved peak."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(SEGMENT_CSV_COLUMNS)
    w.writerows(segment_rows(trace, device))
    return buf.getvalue()
