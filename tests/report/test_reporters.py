"""Reporters by name: json and csv are one pair, a new reporter is one registration, unknown names are one line."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path

import pytest

from hyperdryrun.report import save_reports
from hyperdryrun.report.reader import load_any
from hyperdryrun.report.reporters import (
    REPORTERS,
    RankReport,
    register_reporter,
    reporters_named,
    write_rank_reports,
)
from hyperdryrun.report.schema import CSV_COLUMNS

FIXTURE = Path(__file__).parents[1] / "ingest" / "fixtures" / "tiny_step.trace.json.gz"
CSV_TEXT = "a,b\n1,2\n"


def ok(rank: int = 0) -> RankReport:
    return RankReport(rank, {"schema_version": "1.0", "status": "ok", "metadata": {"rank": rank}}, CSV_TEXT)


def listing(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


@pytest.mark.parametrize("names", [("json",), ("csv",), ("json", "csv"), ("csv", "json", "csv")])
def test_json_and_csv_are_one_pair_written_once(tmp_path, names):
    paths = write_rank_reports(ok(2), tmp_path, names)
    d = tmp_path / "rank_2"
    assert paths == [d / "rank_2_memory.json", d / "rank_2_memory.csv"]
    assert listing(tmp_path) == {"rank_2", "rank_2/rank_2_memory.json", "rank_2/rank_2_memory.csv"}
    assert (d / "rank_2_memory.csv").read_text() == CSV_TEXT


def test_after_writing_the_rank_report_is_what_the_json_file_holds(tmp_path):
    rank = ok(1)
    json_path, csv_path = write_rank_reports(rank, tmp_path)
    assert rank.report == json.loads(json_path.read_text())
    data = csv_path.read_bytes()
    assert rank.report["csv_file"] == {
        "name": "rank_1_memory.csv",
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def test_a_new_reporter_is_one_registration(tmp_path, monkeypatch):
    monkeypatch.setattr("hyperdryrun.report.reporters.REPORTERS", dict(REPORTERS))
    seen = []

    @register_reporter("peak-txt")
    def write_peak(rank: RankReport, output_dir: Path) -> list[Path]:
        seen.append((rank.rank, output_dir))
        path = output_dir / f"rank_{rank.rank}" / "peak.txt"
        path.write_text(rank.report["status"] + "\n")
        return [path]

    paths = write_rank_reports(ok(0), tmp_path, ("json", "peak-txt"))
    assert [p.name for p in paths] == ["rank_0_memory.json", "rank_0_memory.csv", "peak.txt"]
    assert seen == [(0, tmp_path)]
    assert (tmp_path / "rank_0" / "peak.txt").read_text() == "ok\n"
    with pytest.raises(ValueError, match="'peak-txt': already registered"):
        register_reporter("peak-txt", lambda rank, output_dir: [])
    register_reporter("peak-txt", write_peak)  # the same function again is harmless


def test_unknown_reporter_is_a_one_line_error_naming_it_and_the_known_ones(tmp_path):
    with pytest.raises(ValueError) as info:
        write_rank_reports(ok(), tmp_path, ("json", "htlm"))
    assert str(info.value) == "reporters: unknown reporter 'htlm' (known: csv, json)"
    assert listing(tmp_path) == set()  # checked before anything is written
    assert reporters_named(["csv"]) == [REPORTERS["json"]]


def test_an_error_report_is_written_beside_a_good_report_never_over_it(tmp_path):
    write_rank_reports(ok(), tmp_path)
    good = listing(tmp_path)
    err = {
        "schema_version": "1.0",
        "status": "error",
        "stage": "step",
        "error": {"type": "X", "message": "m"},
    }
    paths = write_rank_reports(RankReport(0, err), tmp_path)
    assert paths == [tmp_path / "rank_0" / "rank_0_error.json"]
    assert listing(tmp_path) == good | {"rank_0/rank_0_error.json"}
    assert json.loads(paths[0].read_text()) == err


def test_an_error_report_alone_is_the_ranks_json(tmp_path):
    err = {
        "schema_version": "1.0",
        "status": "error",
        "stage": "step",
        "error": {"type": "X", "message": "m"},
    }
    paths = write_rank_reports(RankReport(0, err), tmp_path)
    assert paths == [tmp_path / "rank_0" / "rank_0_memory.json"]
    assert listing(tmp_path) == {"rank_0", "rank_0/rank_0_memory.json"}


def test_an_ok_report_without_its_csv_is_refused(tmp_path):
    with pytest.raises(ValueError, match="rank 0: an ok report needs its block CSV"):
        write_rank_reports(RankReport(0, {"status": "ok"}), tmp_path)
    assert listing(tmp_path) == set()


def test_a_trace_is_a_source_too_and_save_reports_writes_the_same_bytes(tmp_path):
    trace = load_any(FIXTURE)  # an ingested profiler trace: a StepTrace without a simulation
    from_trace = write_rank_reports(trace, tmp_path / "a")
    saved = save_reports(trace, tmp_path / "b")
    assert [p.relative_to(tmp_path / "a") for p in from_trace] == [
        p.relative_to(tmp_path / "b") for p in saved
    ]
    for a, b in zip(from_trace, saved):
        assert a.read_bytes() == b.read_bytes()
    report = json.loads(from_trace[0].read_text())
    rows = list(csv.reader(io.StringIO(from_trace[1].read_text())))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert len(rows) - 1 == len(trace.blocks) == report["summary"]["num_blocks"]
    assert report["summary"]["peak_bytes"] == trace.peak
