"""Atomic report files: nothing partial on failure, the usual file mode, and nothing written for a bad report."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from hyperdryrun.report import writer
from hyperdryrun.report.writer import atomic_write, write_error_report, write_reports


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def listing(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def test_atomic_write_writes_text_exactly(tmp_path):
    target = tmp_path / "sub" / "dir" / "r.json"
    text = 'a,b\r\n"x\ny",é\n'  # newline="" : no translation of \r\n or \n
    atomic_write(target, text)
    assert target.read_bytes() == text.encode("utf-8")
    assert listing(tmp_path) == {"sub", "sub/dir", "sub/dir/r.json"}


def test_atomic_write_replaces_existing_target(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("old\n")
    atomic_write(target, "new\n")
    assert target.read_text() == "new\n"
    assert listing(tmp_path) == {"r.json"}


def test_file_mode_follows_umask_022(tmp_path, umask_022):
    target = tmp_path / "r.json"
    atomic_write(target, "{}\n")
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_file_mode_follows_umask_077(tmp_path):
    old = os.umask(0o077)
    try:
        atomic_write(tmp_path / "r.json", "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o600


def test_umask_is_left_as_it_was(tmp_path, umask_022):
    atomic_write(tmp_path / "r.json", "{}\n")
    current = os.umask(0o022)
    assert current == 0o022


def _failing_replace(src, dst, *args, **kwargs):
    raise OSError(28, "No space left on device (simulated)")


def test_failed_replace_leaves_no_temp_and_no_target(tmp_path, monkeypatch):
    monkeypatch.setattr(writer.os, "replace", _failing_replace)
    target = tmp_path / "r.json"
    with pytest.raises(OSError, match="simulated"):
        atomic_write(target, "{}\n")
    assert listing(tmp_path) == set()


def test_failed_replace_keeps_existing_target(tmp_path, monkeypatch):
    target = tmp_path / "r.json"
    target.write_text("previous report\n")
    monkeypatch.setattr(writer.os, "replace", _failing_replace)
    with pytest.raises(OSError, match="simulated"):
        atomic_write(target, "new report\n")
    assert target.read_text() == "previous report\n"
    assert listing(tmp_path) == {"r.json"}


def test_write_failing_midway_leaves_nothing(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("previous\n")
    # a lone surrogate cannot be encoded as UTF-8: the write to the temp file fails after it was created
    with pytest.raises(UnicodeEncodeError):
        atomic_write(target, "ok so far \udcff")
    assert target.read_text() == "previous\n"
    assert listing(tmp_path) == {"r.json"}


def test_non_str_text_leaves_nothing(tmp_path):
    target = tmp_path / "r.json"
    with pytest.raises(TypeError):
        atomic_write(target, object())  # type: ignore[arg-type]
    assert listing(tmp_path) == set()


def test_keyboard_interrupt_also_cleans_up(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer.os, "chmod", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "r.json", "{}\n")
    assert listing(tmp_path) == set()


# ---------------------------------------------------------------------------------------------------------
# write_reports / write_error_report
# ---------------------------------------------------------------------------------------------------------

CSV_TEXT = "start,end\n0,1\n"


def ok_report(**summary) -> dict:
    return {
        "schema_version": 1,
        "status": "ok",
        "metadata": {"rank": 3},
        "summary": {"peak_bytes": 10, **summary},
    }


def test_write_reports_writes_both_files(tmp_path, umask_022):
    paths = write_reports(ok_report(), CSV_TEXT, tmp_path, 3)
    json_path = tmp_path / "rank_3" / "rank_3_memory.json"
    csv_path = tmp_path / "rank_3" / "rank_3_memory.csv"
    assert paths == [json_path, csv_path]
    assert listing(tmp_path) == {"rank_3", "rank_3/rank_3_memory.json", "rank_3/rank_3_memory.csv"}
    assert json.loads(json_path.read_text()) == ok_report()
    assert json_path.read_text().endswith("}\n")
    assert csv_path.read_text() == CSV_TEXT
    for p in paths:
        assert stat.S_IMODE(p.stat().st_mode) == 0o644


@pytest.mark.parametrize(
    "bad",
    [float("nan"), float("inf"), float("-inf"), object(), {1, 2}, b"bytes"],
    ids=["nan", "inf", "-inf", "object", "set", "bytes"],
)
def test_write_reports_with_unserialisable_value_writes_nothing(tmp_path, bad):
    with pytest.raises((ValueError, TypeError)):
        write_reports(ok_report(bad=bad), CSV_TEXT, tmp_path, 0)
    assert listing(tmp_path) == set()


def test_write_reports_unserialisable_keeps_previous_files(tmp_path):
    write_reports(ok_report(), CSV_TEXT, tmp_path, 0)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ValueError):
        write_reports(ok_report(bad=float("nan")), "other,csv\n", tmp_path, 0)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_error_report_removes_stale_csv(tmp_path):
    write_reports(ok_report(), CSV_TEXT, tmp_path, 0)
    err = {"schema_version": 1, "status": "error", "stage": "step", "error": {"type": "X", "message": "m"}}
    path = write_error_report(err, tmp_path, 0)
    assert path == tmp_path / "rank_0" / "rank_0_memory.json"
    assert listing(tmp_path) == {"rank_0", "rank_0/rank_0_memory.json"}
    assert json.loads(path.read_text()) == err


def test_error_report_unserialisable_writes_nothing(tmp_path):
    with pytest.raises(ValueError):
        write_error_report({"status": "error", "x": float("nan")}, tmp_path, 0)
    assert listing(tmp_path) == set()
