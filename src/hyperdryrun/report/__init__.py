"""Reports: blocks -> summary / JSON / CSV. The schema lives in :mod:`hyperdryrun.report.schema`; the formats a run
writes are reporters registered by name in :mod:`hyperdryrun.report.reporters`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperdryrun.lazy import lazy_exports

if TYPE_CHECKING:
    from hyperdryrun.report.build import (
        blocks_csv,
        build_report,
        device_memory_of,
        error_report,
        segments_csv,
    )
    from hyperdryrun.report.reporters import (
        DEFAULT_REPORTERS,
        REPORTERS,
        RankReport,
        register_reporter,
        write_rank_reports,
    )
    from hyperdryrun.report.schema import CSV_COLUMNS, SCHEMA_VERSION
    from hyperdryrun.report.writer import rank_paths, write_error_report, write_reports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "hyperdryrun.report.build": (
            "blocks_csv",
            "build_report",
            "device_memory_of",
            "error_report",
            "segments_csv",
        ),
        "hyperdryrun.report.reporters": (
            "DEFAULT_REPORTERS",
            "REPORTERS",
            "RankReport",
            "register_reporter",
            "write_rank_reports",
        ),
        "hyperdryrun.report.schema": ("CSV_COLUMNS", "SCHEMA_VERSION"),
        "hyperdryrun.report.writer": ("rank_paths", "write_error_report", "write_reports"),
    },
)


def save_reports(
    trace: Any,
    output_dir: str | os.PathLike,
    *,
    target: Any = None,
    device_memory_gib: float | None = None,
    live_set_limit: int = 50,
) -> list[Path]:
    """Write ``<output_dir>/rank_<r>/rank_<r>_memory.{json,csv}`` for a trace (atomically), and
    ``rank_<r>_segments.csv`` for a CUDA target; returns the paths. The verdict is against ``target`` (a
    :class:`~hyperdryrun.world.target.DeviceTarget`), or ``device_memory_gib``: a target of that capacity."""
    from hyperdryrun.report.reporters import RankReport, write_rank_reports

    if device_memory_gib is not None:
        from hyperdryrun.world.target import DeviceTarget

        if target is not None:
            raise ValueError("save_reports: give target or device_memory_gib, not both")
        target = DeviceTarget(device_memory_gib=device_memory_gib)
    return write_rank_reports(RankReport.from_trace(trace, target, live_set_limit), output_dir)


__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_REPORTERS",
    "REPORTERS",
    "SCHEMA_VERSION",
    "RankReport",
    "blocks_csv",
    "build_report",
    "device_memory_of",
    "error_report",
    "rank_paths",
    "register_reporter",
    "save_reports",
    "segments_csv",
    "write_error_report",
    "write_rank_reports",
    "write_reports",
]
