"""Atomic report files: ``<output_dir>/rank_<r>/rank_<r>_memory.{json,csv}``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hyperdryrun.report.schema import CSV_FILE_KEY


def rank_paths(output_dir: str | os.PathLike, rank: int) -> tuple[Path, Path]:
    d = Path(output_dir) / f"rank_{rank}"
    return d / f"rank_{rank}_memory.json", d / f"rank_{rank}_memory.csv"


def segments_path(output_dir: str | os.PathLike, rank: int) -> Path:
    """Where a CUDA target's segment CSV goes, beside the rank's JSON and CSV."""
    return Path(output_dir) / f"rank_{rank}" / f"rank_{rank}_segments.csv"


def error_path(output_dir: str | os.PathLike, rank: int) -> Path:
    """Where a failed run's error report goes when the rank's JSON holds a good report: beside it."""
    return Path(output_dir) / f"rank_{rank}" / f"rank_{rank}_error.json"


_ERROR_HEAD = re.compile(rb'\A\{\s*"schema_version":\s*(?:"[^"\\]*"|[0-9.]+),\s*"status":\s*"error"')
"""How an error report this writer wrote begins (:func:`to_json` keeps the keys in order)."""


def holds_error_report(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an error report (its first bytes say so; nothing else is read)."""
    try:
        with open(path, "rb") as f:
            return bool(_ERROR_HEAD.match(f.read(256)))
    except OSError:
        return False


def replaceable(path: str | os.PathLike) -> None:
    """Raise ``OSError`` unless a new file may be renamed over ``path``: nothing there, or a regular file. A rename
    over a device, a pipe or a socket would replace the node itself (``-o /dev/null`` run as root turned
    /dev/null into a regular file for every process on the machine), over a directory it fails half-way."""
    if os.path.lexists(path) and not os.path.isfile(path):
        raise (
            IsADirectoryError(f"{os.fspath(path)}: exists and is not a regular file")
            if os.path.isdir(path)
            else OSError(f"{os.fspath(path)}: exists and is not a regular file (a device, pipe or socket)")
        )


def _write_temp(path: Path, text: str | bytes) -> Path:
    """``text`` (UTF-8 when a str) in a new temporary file beside ``path``, with the usual file mode; nothing is left
    if it fails."""
    replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8") if isinstance(text, str) else text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; a report should have the usual mode
    except BaseException:
        _unlink(tmp)
        raise
    return Path(tmp)


def _unlink(path: str | os.PathLike) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to a temp file next to ``path`` and rename it over ``path``; no partial file on failure."""
    write_together([(path, text)])


def write_together(files: Sequence[tuple[Path, str | bytes]]) -> None:
    """Replace several files as one: every file goes to a temporary beside its target first, and only when all are
    complete are they renamed, in the order given (the last rename is the commit point). A failure at any step
    leaves the previous files as they were and no temporary file."""
    temps: list[tuple[Path, Path]] = []
    try:
        for path, text in files:
            temps.append((path, _write_temp(path, text)))
        _rename_all(temps)
    finally:
        for _, tmp in temps:
            _unlink(tmp)  # those renamed are gone already


def _rename_all(temps: list[tuple[Path, Path]]) -> None:
    """Rename each temporary over its target; if one fails, put back what the earlier renames replaced."""
    done: list[tuple[Path, Path | None]] = []  # (target, hard link to the file it replaced, or None)
    try:
        for i, (path, tmp) in enumerate(temps):
            last = i == len(temps) - 1
            backup = None if last else _backup(path)  # after the last rename nothing is left to fail
            try:
                os.replace(tmp, path)
            except BaseException:
                if backup is not None:
                    _unlink(backup)
                raise
            done.append((path, backup))
    except BaseException:
        for path, backup in reversed(done):
            with contextlib.suppress(OSError):
                if backup is None:
                    os.unlink(path)
                else:
                    os.replace(backup, path)
        raise
    finally:
        for _, backup in done:
            if backup is not None:
                _unlink(backup)  # absent when it was put back


def _backup(path: Path) -> Path | None:
    """A hard link to ``path`` under a temporary name (None if there is no file), so a rename over it can be
    undone; failing to make one fails the write before anything was replaced."""
    if not os.path.isfile(path):
        return None
    for _ in range(100):
        link = path.parent / f".{path.name}.{secrets.token_hex(4)}.bak.tmp"
        try:
            os.link(path, link)
        except FileExistsError:
            continue
        return link
    raise FileExistsError(f"{path}: no free name for a backup link")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=False, allow_nan=False) + "\n"


def with_csv_file(report: dict[str, Any], csv_name: str, csv_text: str) -> dict[str, Any]:
    """``report`` with :data:`~hyperdryrun.report.schema.CSV_FILE_KEY`: the name, byte size and sha256 of the CSV
    ``csv_text`` as written (UTF-8), so a reader can tell whether the CSV beside the JSON is its own."""
    data = csv_text.encode("utf-8")
    return {
        **report,
        CSV_FILE_KEY: {"name": csv_name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()},
    }


def write_reports(
    report: dict[str, Any],
    csv_text: str,
    output_dir: str | os.PathLike,
    rank: int,
    segments_text: str | None = None,
) -> list[Path]:
    """The files of one rank, written together: the CSVs are renamed into place first and the JSON last, so a JSON
    with ``status: ok`` always has its own block CSV beside it (named, sized and hashed in the JSON), and a failure
    leaves the previous files as they were. Without ``segments_text`` (not a CUDA target) a segment CSV left by an
    earlier run goes."""
    json_path, csv_path = rank_paths(output_dir, rank)
    seg_path = segments_path(output_dir, rank)
    # serialise before touching the disk: a bad value fails with nothing written
    text = to_json(with_csv_file(report, csv_path.name, csv_text))
    files = [(csv_path, csv_text)] + ([(seg_path, segments_text)] if segments_text is not None else [])
    if segments_text is None and seg_path.exists():
        seg_path.unlink()
    write_together([*files, (json_path, text)])
    stale = error_path(output_dir, rank)  # a failure of an earlier run, beside the good report it kept
    if stale.exists():
        stale.unlink()
    return [json_path, csv_path] + ([seg_path] if segments_text is not None else [])


def write_error_report(report: dict[str, Any], output_dir: str | os.PathLike, rank: int) -> Path:
    """A failed run's error JSON. It never replaces a good file (issue 30): where the rank's JSON holds anything but
    an earlier error report (a good report), the error report goes beside it as ``rank_<r>_error.json`` and the good
    report and its CSVs stay as they were. Otherwise it is the rank's JSON, and a CSV of an earlier run, which would
    contradict it, goes (as does an error report beside)."""
    json_path, csv_path = rank_paths(output_dir, rank)
    text = to_json(report)  # serialise before touching the disk: a bad value fails with nothing written
    if os.path.lexists(json_path) and not holds_error_report(json_path):
        beside = error_path(output_dir, rank)
        atomic_write(beside, text)
        return beside
    atomic_write(json_path, text)
    for stale in (csv_path, segments_path(output_dir, rank), error_path(output_dir, rank)):
        if stale.exists():
            stale.unlink()
    return json_path
