"""Reading a report back: the JSON names the CSV it was written with, and a reader refuses any other CSV."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hyperdryrun.ingest.files import IngestError
from hyperdryrun.report import save_reports
from hyperdryrun.report.reader import load_any


@pytest.fixture
def pair(tmp_path, tiny_trace):
    json_path, csv_path, *_ = save_reports(tiny_trace, tmp_path / "out")  # the segment CSV too on cuda
    return json_path, csv_path


def test_a_report_loads_with_its_own_csv(pair):
    json_path, csv_path = pair
    report = load_any(json_path)
    # the live set comes from the CSV: every block alive at the peak, summing to the peak
    assert report["peak_live_set"]["total_bytes"] == report["summary"]["peak_bytes"]


def test_a_csv_that_is_not_the_reports_own_is_refused(pair):
    json_path, csv_path = pair
    rows = csv_path.read_text().splitlines(keepends=True)
    csv_path.write_text("".join(rows[:1] + rows[2:] + rows[1:2]))  # same blocks, other order: other bytes
    with pytest.raises(IngestError, match="is not the CSV its report was written with"):
        load_any(json_path)


def test_compare_of_a_mismatched_pair_is_one_line_exit_2(pair, tmp_path):
    json_path, csv_path = pair
    csv_path.write_bytes(csv_path.read_bytes() + b"\n")
    proc = subprocess.run(
        [sys.executable, "-m", "hyperdryrun.cli", "compare", str(json_path), str(json_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "is not the CSV its report was written with" in proc.stderr


def test_a_report_from_before_the_hash_still_loads(pair):
    json_path, _ = pair
    data = json.loads(json_path.read_text())
    del data["csv_file"]
    json_path.write_text(json.dumps(data))
    assert load_any(json_path)["summary"]["peak_bytes"] == data["summary"]["peak_bytes"]
