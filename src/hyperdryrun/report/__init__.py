"""Reports: blocks -> summary / JSON / CSV. The schema lives in :mod:`hyperdryrun.report.schema`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hyperdryrun.report.build import blocks_csv, build_report, device_memory_of, error_report, segments_csv
from hyperdryrun.report.schema import CSV_COLUMNS, SCHEMA_VERSION
from hyperdryrun.report.writer import rank_paths, write_error_report, write_reports


def save_reports(
    trace: Any,
    output_dir: str | os.PathLike,
    *,
    device_memory_gib: float | None = None,
    live_set_limit: int = 50,
) -> list[Path]:
    """Write ``<output_dir>/rank_<r>/rank_<r>_memory.{json,csv}`` for a trace (atomically), and
    ``rank_<r>_segments.csv`` for a CUDA target; returns the paths."""
    device = device_memory_of(trace, device_memory_gib)
    report = build_report(trace, device_memory_gib, live_set_limit, device)
    segments = segments_csv(trace, device) if device is not None else None
    return write_reports(report, blocks_csv(trace), output_dir, trace.metadata.get("rank", 0), segments)


__all__ = [
    "CSV_COLUMNS",
    "SCHEMA_VERSION",
    "blocks_csv",
    "build_report",
    "device_memory_of",
    "error_report",
    "rank_paths",
    "save_reports",
    "segments_csv",
    "write_error_report",
    "write_reports",
]
