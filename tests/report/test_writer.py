"""Atomic report files: nothing partial on failure, the usual file mode, and nothing written for a bad report."""

from __future__ import annotations

import hashlib
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


def csv_file_of(path: Path) -> dict:
    """What a JSON must say of the CSV at ``path``: derived from the bytes on disk."""
    data = path.read_bytes()
    return {"name": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_write_reports_writes_both_files(tmp_path, umask_022):
    paths = write_reports(ok_report(), CSV_TEXT, tmp_path, 3)
    json_path = tmp_path / "rank_3" / "rank_3_memory.json"
    csv_path = tmp_path / "rank_3" / "rank_3_memory.csv"
    assert paths == [json_path, csv_path]
    assert listing(tmp_path) == {"rank_3", "rank_3/rank_3_memory.json", "rank_3/rank_3_memory.csv"}
    assert json.loads(json_path.read_text()) == {**ok_report(), "csv_file": csv_file_of(csv_path)}
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


def test_error_report_goes_beside_a_good_report_and_never_replaces_it(tmp_path):
    # issue 30: no good file is replaced by something else; a later good run takes the stale error report away
    write_reports(ok_report(), CSV_TEXT, tmp_path, 0)
    good = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    err = {"schema_version": 1, "status": "error", "stage": "step", "error": {"type": "X", "message": "m"}}
    path = write_error_report(err, tmp_path, 0)
    assert path == tmp_path / "rank_0" / "rank_0_error.json"
    assert json.loads(path.read_text()) == err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p != path} == good
    write_reports(ok_report(peak_bytes=5), CSV_TEXT, tmp_path, 0)
    assert listing(tmp_path) == {"rank_0", "rank_0/rank_0_memory.json", "rank_0/rank_0_memory.csv"}


def test_error_report_replaces_an_earlier_error_report_and_a_stale_csv(tmp_path):
    err = {
        "schema_version": "1.0",
        "status": "error",
        "stage": "step",
        "error": {"type": "X", "message": "m"},
    }
    json_path = write_error_report(err, tmp_path, 0)
    assert json_path == tmp_path / "rank_0" / "rank_0_memory.json"
    # a CSV the error report would contradict
    (tmp_path / "rank_0" / "rank_0_memory.csv").write_text(CSV_TEXT)
    (tmp_path / "rank_0" / "rank_0_error.json").write_text("{}\n")
    again = {**err, "stage": "parallelize"}
    assert write_error_report(again, tmp_path, 0) == json_path
    assert listing(tmp_path) == {"rank_0", "rank_0/rank_0_memory.json"}
    assert json.loads(json_path.read_text()) == again


def test_error_report_unserialisable_writes_nothing(tmp_path):
    with pytest.raises(ValueError):
        write_error_report({"status": "error", "x": float("nan")}, tmp_path, 0)
    assert listing(tmp_path) == set()


# ---------------------------------------------------------------------------------------------------------
# The pair: both files to temporaries first, renamed CSV first and JSON last; any failure keeps the old pair
# ---------------------------------------------------------------------------------------------------------

OLD_CSV = "old,csv\n1,2\n"


def old_pair(root: Path) -> dict[Path, bytes]:
    """An earlier run's pair for rank 0, as bytes by path."""
    write_reports(ok_report(peak_bytes=1), OLD_CSV, root, 0)
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


PAIR = {"rank_0", "rank_0/rank_0_memory.json", "rank_0/rank_0_memory.csv"}


def test_pair_is_renamed_csv_first_json_last(tmp_path, monkeypatch):
    renamed = []
    real = os.replace

    def recording(src, dst, *args, **kwargs):
        renamed.append(Path(dst).name)
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(writer.os, "replace", recording)
    write_reports(ok_report(), CSV_TEXT, tmp_path, 0)
    assert renamed == ["rank_0_memory.csv", "rank_0_memory.json"]


def _fail_writes_to(monkeypatch, prefix: str, exc: BaseException) -> None:
    """The write of any temporary whose name starts with ``prefix`` raises ``exc`` (e.g. a full disk)."""
    real = os.fdopen

    class Failing:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.f.close()

        def write(self, text):
            raise exc

    def fdopen(fd, *args, **kwargs):
        f = real(fd, *args, **kwargs)
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        return Failing(f) if name.startswith(prefix) else f

    monkeypatch.setattr(writer.os, "fdopen", fdopen)


@pytest.mark.parametrize("which", ["json", "csv"])
def test_full_disk_while_writing_keeps_the_old_pair(tmp_path, monkeypatch, which):
    before = old_pair(tmp_path)
    _fail_writes_to(monkeypatch, f".rank_0_memory.{which}.", OSError(28, "No space left on device"))
    with pytest.raises(OSError, match="No space left"):
        write_reports(ok_report(), CSV_TEXT, tmp_path, 0)
    assert files(tmp_path) == before
    assert listing(tmp_path) == PAIR


def test_full_disk_on_a_first_run_leaves_no_file(tmp_path, monkeypatch):
    _fail_writes_to(monkeypatch, ".rank_0_memory.json.", OSError(28, "No space left on device"))
    with pytest.raises(OSError):
        write_reports(ok_report(), CSV_TEXT, tmp_path, 0)
    assert files(tmp_path) == {}


def test_a_directory_where_the_json_goes_keeps_the_old_csv(tmp_path):
    before = old_pair(tmp_path)
    json_path = tmp_path / "rank_0" / "rank_0_memory.json"
    json_path.unlink()
    json_path.mkdir()
    with pytest.raises(OSError):
        write_reports(ok_report(), CSV_TEXT, tmp_path, 0)
    csv_path = tmp_path / "rank_0" / "rank_0_memory.csv"
    assert csv_path.read_bytes() == before[csv_path] == OLD_CSV.encode()
    assert listing(tmp_path) == PAIR  # the JSON name is still the directory; no temporary or backup left


def test_a_directory_where_the_json_goes_on_a_first_run_leaves_no_csv(tmp_path):
    (tmp_path / "rank_0" / "rank_0_memory.json").mkdir(parents=True)
    with pytest.raises(OSError):
        write_reports(ok_report(), CSV_TEXT, tmp_path, 0)
    assert listing(tmp_path) == {"rank_0", "rank_0/rank_0_memory.json"}


@pytest.mark.parametrize(
    "exc", [OSError(5, "Input/output error"), KeyboardInterrupt()], ids=["oserror", "ctrl-c"]
)
def test_failed_json_rename_puts_the_old_csv_back(tmp_path, monkeypatch, exc):
    before = old_pair(tmp_path)
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(dst).name == "rank_0_memory.json":
            raise exc
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(writer.os, "replace", replace)
    with pytest.raises(type(exc)):
        write_reports(ok_report(), CSV_TEXT, tmp_path, 0)
    monkeypatch.undo()
    assert files(tmp_path) == before
    assert listing(tmp_path) == PAIR


def test_no_backup_link_fails_before_anything_is_replaced(tmp_path, monkeypatch):
    before = old_pair(tmp_path)

    def no_links(src, dst, *args, **kwargs):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(writer.os, "link", no_links)
    with pytest.raises(OSError, match="not permitted"):
        write_reports(ok_report(), CSV_TEXT, tmp_path, 0)
    assert files(tmp_path) == before
    assert listing(tmp_path) == PAIR


def test_a_new_pair_replaces_the_old_one_and_leaves_no_backup(tmp_path):
    old_pair(tmp_path)
    write_reports(ok_report(), CSV_TEXT, tmp_path, 0)
    assert listing(tmp_path) == PAIR
    csv_path = tmp_path / "rank_0" / "rank_0_memory.csv"
    assert csv_path.read_text() == CSV_TEXT
    assert json.loads((tmp_path / "rank_0" / "rank_0_memory.json").read_text()) == {
        **ok_report(),
        "csv_file": csv_file_of(csv_path),
    }


def test_the_json_names_sizes_and_hashes_its_csv_and_the_key_comes_last(tmp_path):
    csv_text = 'start,end\r\n"x\ny",é\n'  # CRLF, a quoted newline, a 2-byte character: bytes, not characters
    json_path, csv_path = write_reports(ok_report(), csv_text, tmp_path, 0)
    written = json.loads(json_path.read_text())
    assert list(written) == [*ok_report(), "csv_file"]
    assert written["csv_file"] == csv_file_of(csv_path)
    assert written["csv_file"]["bytes"] == len(csv_text) + 1 == 20  # 19 characters, é is two bytes in UTF-8
    assert written["csv_file"]["name"] == "rank_0_memory.csv"


def test_an_error_report_carries_no_csv_file(tmp_path):
    err = {"schema_version": 1, "status": "error", "stage": "step", "error": {"type": "X", "message": "m"}}
    assert "csv_file" not in json.loads(write_error_report(err, tmp_path, 0).read_text())


def test_a_device_pipe_or_directory_is_never_renamed_over(tmp_path):
    # A rename over a special file replaces the node: `-o /dev/null` as root once turned /dev/null into a regular
    # file for the whole machine. Every writer refuses such a target and leaves it as it was (a FIFO here: no root
    # needed to make one).
    import stat

    from hyperdryrun.report.writer import write_together
    from hyperdryrun.search.cache import ResultCache
    from hyperdryrun.viz.files import write_atomic

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for write in (lambda: write_together([(fifo, "x")]), lambda: write_atomic(fifo, b"x")):
        with pytest.raises(OSError, match="not a regular file"):
            write()
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    (tmp_path / "dir").mkdir()
    with pytest.raises(IsADirectoryError):
        write_together([(tmp_path / "dir", "x")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "pipe"]  # no temporary left
    cache = ResultCache(tmp_path / "cache")
    target = cache._path("sim", "k")
    target.parent.mkdir(parents=True)
    os.mkfifo(target)
    cache.put("sim", "k", {"a": 1})  # a cache that cannot be written is skipped
    assert stat.S_ISFIFO(os.lstat(target).st_mode)
