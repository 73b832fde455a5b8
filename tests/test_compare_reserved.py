"""compare on the caching allocator's side: a CUDA snapshot's reserved bytes, fragmentation and segments (worked by
hand from the fixture and from a snapshot with segment events) against a CUDA dry run's."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hyperdryrun.cli import main
from hyperdryrun.compare import COMPUTE_STREAMS, SIDE_STREAMS
from hyperdryrun.ingest.snapshot import trace_from_snapshot
from hyperdryrun.report import build_report
from tests.ingest.fixtures.make_fixtures import snapshot

FIXTURE = Path(__file__).parent / "ingest" / "fixtures" / "tiny.snapshot.pickle"
MIB = 1 << 20


def test_the_fixtures_reserved_figures_are_its_segments():
    # no segment events: both segments (20 MiB large, 2 MiB small, stream 0) exist through the window, so reserved
    # is at its peak throughout; read where most is allocated there, as a dry run reads it: after B1, W + A1 + A2
    # (1024 B) + B1 (the hand-worked peak), not at the window's start (W + G0, 5 MiB)
    s = build_report(trace_from_snapshot(snapshot()))["summary"]
    assert s["peak_reserved_bytes"] == 22 * MIB
    assert s["allocated_at_reserved_peak_bytes"] == 14 * MIB + 1024
    assert s["fragmentation_bytes"] == 8 * MIB - 1024
    assert s["segments_by_pool"] == [
        {"stream": 0, "pool": "large", "segments": 1, "bytes": 20 * MIB},
        {"stream": 0, "pool": "small", "segments": 1, "bytes": 2 * MIB},
    ]


def with_segment_events() -> dict:
    """The fixture with a 2 MiB segment on stream 7 cudaMalloc'd after B1's allocation and cudaFree'd before O1's:
    reserved 22 MiB at the start, 24 MiB while it lives, 22 MiB at the snapshot (which no longer lists it)."""
    data = copy.deepcopy(snapshot())
    trace = data["device_traces"][0]
    seg = 0x7F2000000000

    def ev(action: str) -> dict:
        return {"action": action, "addr": seg, "size": 2 * MIB, "stream": 7, "frames": [], "time_us": 0}

    b1 = next(i for i, e in enumerate(trace) if e["action"] == "alloc" and e["size"] == 6 * MIB)
    trace.insert(b1 + 1, ev("segment_alloc"))
    o1 = next(i for i, e in enumerate(trace) if e["action"] == "alloc" and e["size"] == 3 * MIB)
    trace.insert(o1, ev("segment_free"))
    return data


def test_segment_events_give_the_reserved_peak_inside_the_window():
    s = build_report(trace_from_snapshot(with_segment_events()))["summary"]
    assert s["peak_reserved_bytes"] == 24 * MIB
    # allocated when the segment appears: W + A1 + A2 (1024 B) + B1, G0 freed before (the hand-worked peak)
    assert s["allocated_at_reserved_peak_bytes"] == 14 * MIB + 1024
    assert s["fragmentation_bytes"] == 24 * MIB - (14 * MIB + 1024)
    assert s["segments_by_pool"] == [
        {"stream": 0, "pool": "large", "segments": 1, "bytes": 20 * MIB},
        {"stream": 0, "pool": "small", "segments": 1, "bytes": 2 * MIB},
        {"stream": 7, "pool": "small", "segments": 1, "bytes": 2 * MIB},
    ]


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dry")
    assert main(["run", "--model", "llama-tiny", "--seq-len", "32", "--world-size", "2", "--output-dir", str(out),
                 "--quiet"]) == 0  # fmt: skip
    return out / "rank_0" / "rank_0_memory.json"


def test_compare_puts_a_snapshot_beside_a_dry_run_on_reserved_fragmentation_and_pools(dry_report, capsys):
    capsys.readouterr()
    main(["compare", str(FIXTURE), str(dry_report), "--json"])
    res = json.loads(capsys.readouterr().out)["reserved"]
    dry = json.loads(dry_report.read_text())["summary"]
    assert res["peak_reserved"] == {
        "a": 22 * MIB,
        "b": dry["peak_reserved_bytes"],
        "diff": dry["peak_reserved_bytes"] - 22 * MIB,
        "rel_error": round((dry["peak_reserved_bytes"] - 22 * MIB) / (22 * MIB), 9),
    }
    assert (
        res["fragmentation"]["a"] == 8 * MIB - 1024
        and res["fragmentation"]["b"] == dry["fragmentation_bytes"]
    )
    rows = {(r["pool"], r["streams"]): r for r in res["segments_by_pool"]}
    # the dry run's FSDP2 step has segments on side streams; the snapshot has only the compute (default) stream
    side = sum(r["bytes"] for r in dry["segments_by_pool"] if r["stream"] != 0)
    assert side > 0
    side_rows = [r for (pool, streams), r in rows.items() if streams == SIDE_STREAMS]
    assert sum(r["bytes"]["b"] for r in side_rows) == side and all(r["bytes"]["a"] == 0 for r in side_rows)
    compute_large = rows[("large", COMPUTE_STREAMS)]
    assert compute_large["segments"]["a"] == 1 and compute_large["bytes"]["a"] == 20 * MIB
    assert sum(r["bytes"]["a"] for r in rows.values()) == 22 * MIB
    assert sum(r["bytes"]["b"] for r in rows.values()) == dry["peak_reserved_bytes"]


def test_the_human_view_has_the_allocator_table(dry_report, capsys):
    capsys.readouterr()
    main(["compare", str(FIXTURE), str(dry_report)])
    out = capsys.readouterr().out
    assert "caching allocator (reserved)" in out and "peak reserved" in out and "large/compute (1/" in out


def test_two_sides_without_the_allocator_have_no_reserved_section(dry_report, tmp_path, capsys):
    out = tmp_path / "cpu"
    assert main(["run", "--model", "llama-tiny", "--seq-len", "32", "--target-device", "cpu", "--output-dir",
                 str(out), "--quiet"]) == 0  # fmt: skip
    capsys.readouterr()
    cpu = out / "rank_0" / "rank_0_memory.json"
    main(["compare", str(cpu), str(dry_report), "--json"])
    assert json.loads(capsys.readouterr().out)["reserved"] is None
