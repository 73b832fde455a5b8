"""What the pictures read: a rank's report dict and its trace (blocks), loaded from the files HyperDryRun writes.

Inputs are the public readers' outputs only: :func:`hyperdryrun.report.reader.load_any` gives a report dict for a JSON
report (the CSV beside it gives the trace) and a StepTrace for a CSV, a profiler trace or a CUDA snapshot, so
dry-run, measured and ingested pictures draw alike.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperdryrun.trace.blocks import CATEGORY_ORDER, Category, Phase

RANK_DIR = re.compile(r"rank_(\d+)")


class VizInputError(ValueError):
    """An input the pictures cannot be drawn from: ``<path>: <what is wrong>`` on one line."""


@dataclass(slots=True)
class Side:
    """One memory picture: a rank of a run, or one side of a comparison.

    ``trace`` is None for a JSON report without its CSV (no timeline then, the live set from the JSON).
    ``series`` holds optional extra lines over the tasks, bytes per task, e.g. ``reserved`` and ``device`` from the
    allocator model.
    """

    label: str
    report: dict[str, Any]
    trace: Any | None
    source: str = ""
    series: dict[str, list[int]] = field(default_factory=dict)


def as_sides(items: Sequence[Side | tuple[dict[str, Any], Any]]) -> list[Side]:
    """Sides from Sides or ``(report, trace)`` pairs (what a reporter holds after a run), labelled by rank."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, Side):
            out.append(item)
            continue
        report, trace = item
        rank = (report.get("metadata") or {}).get("rank")
        out.append(Side(f"rank {rank}" if isinstance(rank, int) else f"side {i}", report, trace))
    return out


def load_side(path: str | os.PathLike, label: str | None = None, device: str | None = None) -> Side:
    """A report JSON (with its CSV beside it when there), or a CSV / profiler trace / snapshot as a Side.

    A CSV named like a report's (``rank_0_memory.csv``) with its JSON beside it loads as that report.
    """
    from hyperdryrun.ingest.files import IngestError
    from hyperdryrun.report.build import build_report
    from hyperdryrun.report.reader import load_any

    p = Path(path)
    if p.suffix == ".csv" and p.with_suffix(".json").is_file():
        p = p.with_suffix(".json")
    try:
        loaded = load_any(p, device)
        if isinstance(loaded, dict):
            csv_path = p.with_suffix(".csv")
            trace = load_any(csv_path) if csv_path.is_file() else None
            report = loaded
        else:
            trace, report = loaded, build_report(loaded)
    except IngestError as err:
        raise VizInputError(str(err)) from None
    if trace is not None and isinstance(trace, dict):
        raise VizInputError(f"{p.with_suffix('.csv')}: not a memory-block CSV")
    side = Side(label or _default_label(report, p), report, trace, str(p))
    side.series = allocator_series(report, trace)
    return side


def allocator_series(report: dict[str, Any], trace: Any | None) -> dict[str, list[int]]:
    """``reserved`` and ``device`` bytes per task for a CUDA dry run's report (its blocks replayed through the
    allocator model as the report's own figures were, under the report's capacity): the most at any event of the
    task. Empty for other pictures (measured, ingested, a CPU target, a JSON without its CSV)."""
    if trace is None or not isinstance((report.get("metadata") or {}).get("cuda"), dict):
        return {}
    from hyperdryrun.report.build import device_memory_of

    if not (trace.metadata or {}).get("cuda"):
        trace.metadata = {**(trace.metadata or {}), **report["metadata"]}
    capacity = (report.get("summary") or {}).get("capacity_bytes")
    device = device_memory_of(trace, capacity or None)
    if device is None:
        return {}
    reserved = [0] * trace.num_tasks
    seen = [False] * trace.num_tasks
    after = [0] * trace.num_tasks  # reserved after the task's last event
    r = device.replay
    for task, value in zip(r.tasks[r.step_start :], r.reserved[r.step_start :]):  # the step, not its history
        if 0 <= task < len(reserved):
            reserved[task] = max(reserved[task], value) if seen[task] else value
            seen[task], after[task] = True, value
    for i in range(1, len(reserved)):  # a task without allocator events holds what the one before left
        if not seen[i]:
            reserved[i] = after[i] = after[i - 1]
    return {"reserved": reserved, "device": [r + device.outside_bytes for r in reserved]}


def _default_label(report: dict[str, Any], path: Path) -> str:
    rank = (report.get("metadata") or {}).get("rank")
    return f"rank {rank}" if isinstance(rank, int) else path.name


def load_output_dir(output_dir: str | os.PathLike) -> list[Side]:
    """Every rank under ``output_dir`` (``rank_<r>/rank_<r>_memory.json``, else its ``.csv``), by rank."""
    root = Path(output_dir)
    if not root.is_dir():
        raise VizInputError(f"{root}: no such directory")
    found: list[tuple[int, Path]] = []
    for d in root.iterdir():
        m = RANK_DIR.fullmatch(d.name)
        if not m or not d.is_dir():
            continue
        stem = d / f"rank_{m[1]}_memory"
        for suffix in (".json", ".csv"):
            if stem.with_suffix(suffix).is_file():
                found.append((int(m[1]), stem.with_suffix(suffix)))
                break
    if not found:
        raise VizInputError(f"{root}: no rank_<r>/rank_<r>_memory.json or .csv under it")
    return [load_side(p, f"rank {r}") for r, p in sorted(found)]


def category_timeline(trace: Any) -> dict[str, list[int]]:
    """Live bytes of each category at each task (every category, zeros included, in the category order).

    The same sweep as :func:`hyperdryrun.trace.blocks.live_bytes_by_task`, split by category: the categories of a
    task add up to its live bytes.
    """
    n = trace.num_tasks
    delta = {c: [0] * (n + 1) for c in CATEGORY_ORDER}
    for b in trace.blocks:
        if b.start > n:
            continue
        d = delta[b.category or Category.OTHER]
        d[b.start] += b.size
        if b.end <= n:
            d[b.end] -= b.size
    out = {}
    for c in CATEGORY_ORDER:
        cur, live, d = 0, [], delta[c]
        for t in range(n):
            cur += d[t]
            live.append(cur)
        out[str(c)] = live
    return out


def phase_spans(trace: Any) -> list[tuple[str, int, int]]:
    """Runs of consecutive tasks in one phase: ``(phase, first task, last task + 1)``."""
    spans: list[tuple[str, int, int]] = []
    for t, ph in enumerate(trace.task_phase):
        name = str(ph if ph is not None else Phase.INITIALIZATION)
        if spans and spans[-1][0] == name and spans[-1][2] == t:
            spans[-1] = (name, spans[-1][1], t + 1)
        else:
            spans.append((name, t, t + 1))
    return spans
