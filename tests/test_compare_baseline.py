"""compare prints no relative figure against a side that has no baseline (nothing resident when its record
began), and says why; the figures themselves (``--json``) are unchanged."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from hyperdryrun.cli import main

FIXTURES = Path(__file__).resolve().parent / "ingest" / "fixtures"
TRACE = FIXTURES / "tiny_step.trace.json.gz"  # a CPU step profiled after the model was built: 0 B resident
SNAPSHOT = FIXTURES / "tiny.snapshot.pickle"  # 5 MiB resident at its first task (W and G0)


def compare(argv: list[str], capsys) -> tuple[int, str]:
    rc = main(["compare", *argv])
    return rc, capsys.readouterr().out


def test_no_relative_figure_against_a_side_without_baseline(capsys):
    rc, out = compare([str(TRACE), str(SNAPSHOT)], capsys)
    assert rc == 1
    whole_step = out.split("step only:", 1)[0]  # the step-only figures after it have relative errors
    assert "%" not in whole_step.replace("tolerance 1%", "")
    assert "no relative figures for the whole step: A has no baseline" in " ".join(out.split())
    assert "against 5.00 MiB on B" in " ".join(out.split())


def test_the_json_keeps_every_figure_and_states_each_sides_initial_bytes(capsys):
    rc, out = compare([str(TRACE), str(SNAPSHOT), "--json"], capsys)
    result = json.loads(out)
    assert (result["a"]["initial_bytes"], result["b"]["initial_bytes"]) == (0, 5 << 20)
    # the trace's peak is the most its allocator reported; the snapshot's 14 MiB + 1024 B (hand-worked in
    # tests/ingest/fixtures/make_fixtures.py)
    events = json.loads(gzip.decompress(TRACE.read_bytes()))["traceEvents"]
    a = max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")
    b = (14 << 20) + 1024
    assert result["peak"] == {"a": a, "b": b, "diff": b - a, "rel_error": round((b - a) / a, 9)}


def test_relative_figures_where_both_sides_have_a_baseline(capsys):
    rc, out = compare([str(SNAPSHOT), str(SNAPSHOT)], capsys)
    assert rc == 0
    assert "+0.000%" in out and "no baseline" not in out
