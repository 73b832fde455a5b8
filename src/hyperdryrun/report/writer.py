"""Atomic report files: ``<output_dir>/rank_<r>/rank_<r>_memory.{json,csv}``."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def rank_paths(output_dir: str | os.PathLike, rank: int) -> tuple[Path, Path]:
    d = Path(output_dir) / f"rank_{rank}"
    return d / f"rank_{rank}_memory.json", d / f"rank_{rank}_memory.csv"


def segments_path(output_dir: str | os.PathLike, rank: int) -> Path:
    """Where a CUDA target's segment CSV goes, beside the rank's JSON and CSV."""
    return Path(output_dir) / f"rank_{rank}" / f"rank_{rank}_segments.csv"


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to a temp file next to ``path`` and rename it over ``path``; no partial file on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; a report should have the usual mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=False, allow_nan=False) + "\n"


def write_reports(
    report: dict[str, Any],
    csv_text: str,
    output_dir: str | os.PathLike,
    rank: int,
    segments_text: str | None = None,
) -> list[Path]:
    """The files of one rank; the CSVs first, so a JSON with ``status: ok`` always has its CSV beside it. Without
    ``segments_text`` (not a CUDA target) a segment CSV left by an earlier run goes."""
    json_path, csv_path = rank_paths(output_dir, rank)
    seg_path = segments_path(output_dir, rank)
    text = to_json(report)  # serialise before touching the disk: a bad value fails with nothing written
    atomic_write(csv_path, csv_text)
    if segments_text is not None:
        atomic_write(seg_path, segments_text)
    elif seg_path.exists():
        seg_path.unlink()
    atomic_write(json_path, text)
    return [json_path, csv_path] + ([seg_path] if segments_text is not None else [])


def write_error_report(report: dict[str, Any], output_dir: str | os.PathLike, rank: int) -> Path:
    """The error JSON replaces the rank's report; a CSV from an earlier run would contradict it, so it goes."""
    json_path, csv_path = rank_paths(output_dir, rank)
    atomic_write(json_path, to_json(report))
    for stale in (csv_path, segments_path(output_dir, rank)):
        if stale.exists():
            stale.unlink()
    return json_path
