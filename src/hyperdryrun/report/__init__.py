"""Reports: blocks -> summary / JSON / CSV. The schema lives in :mod:`hyperdryrun.report.schema`."""

from hyperdryrun.report.build import blocks_csv, build_report, error_report
from hyperdryrun.report.schema import CSV_COLUMNS, SCHEMA_VERSION
from hyperdryrun.report.writer import rank_paths, write_error_report, write_reports

__all__ = [
    "CSV_COLUMNS",
    "SCHEMA_VERSION",
    "blocks_csv",
    "build_report",
    "error_report",
    "rank_paths",
    "write_error_report",
    "write_reports",
]
