"""Blocks -> report: the summary, per-phase and per-module figures, the peak live set and the CSV rows.

Everything here reads a :class:`~hyperdryrun.engine.StepTrace` (plain data) and returns plain data; nothing here
depends on when or how fast the run happened, so identical inputs give byte-identical reports.
"""

from __future__ import annotations

import csv
import io
import math
from typing import Any

from hyperdryrun.report.schema import CSV_COLUMNS, GIB, NOT_MODELLED, SCHEMA_VERSION, human_bytes
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


def summarize(trace: Any, device_memory_gib: float | None = None) -> dict[str, Any]:
    """Peak and what it consists of, bytes after the step, and the capacity verdict."""
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
    if device_memory_gib is not None:
        capacity = int(round(device_memory_gib * GIB))
        headroom = capacity - trace.peak
        s["capacity_bytes"] = capacity
        s["capacity_gib"] = device_memory_gib
        s["headroom_bytes"] = headroom
        s["headroom_gib"] = gib(headroom)
        s["oom"] = headroom < 0
        s["verdict"] = (
            f"OOM: peak {human_bytes(trace.peak)} exceeds {device_memory_gib:g} GiB by {human_bytes(-headroom)}"
            if headroom < 0
            else f"fits: peak {human_bytes(trace.peak)} of {device_memory_gib:g} GiB, "
            f"{human_bytes(headroom)} headroom (allocated bytes; see limitations)"
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
    trace: Any, device_memory_gib: float | None = None, live_set_limit: int = 50
) -> dict[str, Any]:
    """The JSON report of one rank (see :mod:`hyperdryrun.report.schema`)."""
    at_peak = alive_at(trace.blocks, trace.peak_task) if trace.peak_task >= 0 else []
    return {
        "schema_version": SCHEMA_VERSION,
        "status": "ok",
        "metadata": trace.metadata,
        "summary": summarize(trace, device_memory_gib),
        "phases": phases(trace),
        "modules": modules(trace, at_peak),
        "peak_live_set": peak_live_set(trace, live_set_limit),
        "limitations": [*trace.limitations, *NOT_MODELLED],
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
                0,
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
