"""Reporters by name: each writes one rank's report in one format and returns the paths it wrote.

A reporter is ``fn(rank_report, output_dir) -> list[Path]``; a new format is one registration::

    @register_reporter("html")
    def write_html(rank: RankReport, output_dir: Path) -> list[Path]: ...

``json`` and ``csv`` are one reporter under two names: the JSON report and its memory-block CSV are written as a
pair (the CSV renamed into place first, the JSON last), so asking for either, or both, writes both once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyperdryrun.report.writer import rank_paths, with_csv_file, write_error_report, write_reports


@dataclass
class RankReport:
    """One rank's report in memory: the JSON report (``status`` ok or error), the block CSV of an ok run, and the
    trace when it is at hand in this process (None when the rank ran in a worker process); for a CUDA target also
    the segment CSV of the allocator model's reserved peak."""

    rank: int
    report: dict[str, Any]
    csv_text: str | None = None
    trace: Any = None
    segments_text: str | None = None

    @property
    def ok(self) -> bool:
        return self.report.get("status") == "ok"

    @classmethod
    def from_trace(cls, trace: Any, target: Any = None, live_set_limit: int = 50) -> RankReport:
        """The report and CSVs of a traced (or ingested) step, judged against ``target`` (the
        :class:`~hyperdryrun.world.target.DeviceTarget` the job was run for: capacity and margin; None: none): for
        a CUDA target the allocator model runs once (reserved and device bytes in the report, its segments in the
        segment CSV)."""
        from hyperdryrun.report.build import blocks_csv, build_report, device_memory_of, segments_csv

        device = device_memory_of(trace, None if target is None else target.capacity_bytes)
        report = build_report(trace, target, live_set_limit, device)
        segments = segments_csv(trace, device) if device is not None else None
        return cls(trace.metadata.get("rank", 0), report, blocks_csv(trace), trace, segments)


Reporter = Callable[[RankReport, Path], list[Path]]

REPORTERS: dict[str, Reporter] = {}
"""Every reporter, by the name a caller asks for."""

DEFAULT_REPORTERS = ("json", "csv")


def register_reporter(name: str, fn: Reporter | None = None) -> Any:
    """Register ``fn`` as reporter ``name`` (usable as a decorator); a name taken by another reporter is an error."""

    def add(f: Reporter) -> Reporter:
        if REPORTERS.get(name, f) is not f:
            raise ValueError(f"reporter {name!r}: already registered ({REPORTERS[name].__qualname__})")
        REPORTERS[name] = f
        return f

    return add if fn is None else add(fn)


def reporters_named(names: Iterable[str]) -> list[Reporter]:
    """The reporters for ``names``, each once, in the order first asked; an unknown name is a one-line error."""
    found: list[Reporter] = []
    for name in names:
        if name not in REPORTERS:
            raise ValueError(f"reporters: unknown reporter {name!r} (known: {', '.join(sorted(REPORTERS))})")
        if REPORTERS[name] not in found:
            found.append(REPORTERS[name])
    return found


def write_rank_reports(
    source: RankReport | Any,
    output_dir: str | os.PathLike,
    names: Sequence[str] = DEFAULT_REPORTERS,
) -> list[Path]:
    """Write a rank's report (a :class:`RankReport`, or a trace) with the reporters ``names`` under
    ``output_dir``; returns every path written."""
    chosen = reporters_named(names)
    rank = source if isinstance(source, RankReport) else RankReport.from_trace(source)
    paths: list[Path] = []
    for fn in chosen:
        paths.extend(fn(rank, Path(output_dir)))
    return paths


def write_json_and_csv(rank: RankReport, output_dir: Path) -> list[Path]:
    """``rank_<r>/rank_<r>_memory.json`` and ``.csv`` as a pair (``rank.report`` then holds the JSON's description
    of its CSV); for a failed run, the error JSON alone (a CSV left from an earlier run would contradict it)."""
    if not rank.ok:
        return [write_error_report(rank.report, output_dir, rank.rank)]
    if rank.csv_text is None:
        raise ValueError(f"rank {rank.rank}: an ok report needs its block CSV (csv_text is None)")
    written = with_csv_file(rank.report, rank_paths(output_dir, rank.rank)[1].name, rank.csv_text)
    paths = write_reports(rank.report, rank.csv_text, output_dir, rank.rank, rank.segments_text)
    rank.report = written  # what the JSON file holds
    return paths


register_reporter("json", write_json_and_csv)
register_reporter("csv", write_json_and_csv)
