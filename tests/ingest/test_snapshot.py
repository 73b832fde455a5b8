"""CUDA snapshot ingestion, checked against the allocation sequence worked by hand in make_fixtures.snapshot()."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest

from hyperdryrun.ingest.files import IngestError
from hyperdryrun.ingest.snapshot import trace_from_snapshot
from hyperdryrun.report import build_report
from hyperdryrun.report.reader import load_any
from hyperdryrun.trace.blocks import Category, Phase
from tests.ingest.fixtures.make_fixtures import snapshot

FIXTURE = Path(__file__).parent / "fixtures" / "tiny.snapshot.pickle"
MIB = 1 << 20


def test_fixture_file_is_what_the_script_writes():
    with open(FIXTURE, "rb") as f:
        assert pickle.load(f) == snapshot()


def test_peak_initial_and_final_bytes_match_the_hand_worked_sequence():
    tr = load_any(FIXTURE)
    # residents W (4 MiB, only in segments) and G0 (1 MiB, freed in the window) are there from task 0
    assert tr.initial == 5 * MIB
    # peak at B1's allocation: W + A1 + A2 (1000 B -> 1024) + B1 (G0 freed just before)
    assert tr.peak == (4 + 4 + 6) * MIB + 1024
    assert tr.peak_task == 2
    assert tr.current == (4 + 3) * MIB  # W and O1; A2's free was requested, so it is no longer allocated
    assert tr.phase_peak == {
        Phase.FORWARD: 9 * MIB + 1024,
        Phase.BACKWARD: 14 * MIB + 1024,
        Phase.RECOMPUTE: 12 * MIB + 1024,
        Phase.OPTIMIZER: 7 * MIB + 1024,
    }
    assert tr.metadata["target_device"] == "cuda:0"
    assert tr.metadata["reserved_bytes_at_snapshot"] == 22 * MIB


def test_blocks_carry_phase_op_frames_and_rounded_sizes():
    tr = load_any(FIXTURE)
    rows = [(b.size, b.requested, b.phase, b.op, b.persistent) for b in tr.blocks]
    assert rows == [
        (4 * MIB, 4 * MIB, Phase.INITIALIZATION, "resident before trace", True),  # W
        (1 * MIB, 1 * MIB, Phase.INITIALIZATION, "initialization", False),  # G0
        (4 * MIB, 4 * MIB, Phase.FORWARD, "<unknown>", False),  # A1
        (1024, 1000, Phase.FORWARD, "<unknown>", False),  # A2
        (6 * MIB, 6 * MIB, Phase.BACKWARD, "aten::mm", False),  # B1, from the at::_ops::mm C++ frame
        (2 * MIB, 2 * MIB, Phase.RECOMPUTE, "<unknown>", False),  # R1, checkpoint unpack_hook
        (3 * MIB, 3 * MIB, Phase.OPTIMIZER, "<unknown>", True),  # O1, torch/optim frame
    ]
    frames = {b.id: tr.stacks.frames(b.stack_id) for b in tr.blocks}
    assert frames[2] == (("/home/u/model.py", 10, "forward"), ("/home/u/train.py", 30, "train_step"))
    assert frames[4] == ()  # C++ frames only
    assert frames[5] == (("/home/u/model.py", 12, "forward"),)  # torch/utils/checkpoint.py dropped
    assert frames[6] == (("/home/u/train.py", 33, "train_step"),)


def test_breakdown_at_peak_adds_up_by_phase_default_categories():
    r = build_report(load_any(FIXTURE))
    s = r["summary"]
    assert s["peak_phase"] == "backward"
    assert s["breakdown_at_peak"][str(Category.OTHER)] == 4 * MIB  # W
    assert s["breakdown_at_peak"][str(Category.ACTIVATION)] == 4 * MIB + 1024  # A1, A2
    assert s["breakdown_at_peak"][str(Category.TEMP)] == 6 * MIB  # B1
    assert sum(s["breakdown_at_peak"].values()) == s["peak_bytes"]


def test_without_free_requested_frees_are_taken_at_free_completed():
    data = snapshot()
    data["device_traces"][0] = [e for e in data["device_traces"][0] if e["action"] != "free_requested"]
    tr = trace_from_snapshot(data)
    # R1 and B1 now stay until after O1; A2 is never completed, so it stays to the end
    assert tr.peak == (4 + 6 + 2 + 3) * MIB + 1024
    assert tr.task_phase[tr.peak_task] is Phase.OPTIMIZER
    assert tr.current == 7 * MIB + 1024
    assert any("free_completed" in x for x in tr.limitations)


def test_device_is_chosen_and_checked():
    data = snapshot()
    data["device_traces"] = [[], data["device_traces"][0]]
    for seg in data["segments"]:
        seg["device"] = 1
    tr = trace_from_snapshot(data)
    assert tr.metadata["target_device"] == "cuda:1"
    assert tr.peak == 14 * MIB + 1024
    assert trace_from_snapshot(data, device="cuda").metadata["target_device"] == "cuda:1"
    with pytest.raises(IngestError, match=r"no trace for device 'cuda:0'"):
        trace_from_snapshot(data, "s.pickle", device="cuda:0")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"segments": [], "device_traces": [[]]}, "empty trace"),
        ({"segments": []}, "no 'device_traces'"),
        ([1, 2, 3], "no 'segments'"),
        ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1}]]}, "lacks integer addr/size"),
    ],
)
def test_malformed_snapshots_raise_one_line_errors(tmp_path, data, message):
    path = tmp_path / "bad.pickle"
    path.write_bytes(pickle.dumps(data))
    with pytest.raises(IngestError, match=message) as err:
        load_any(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_a_pickle_with_objects_is_refused_without_running_them(tmp_path):
    path = tmp_path / "obj.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]], "x": Path("/")}))
    with pytest.raises(IngestError, match="not a CUDA memory snapshot pickle .*references pathlib"):
        load_any(path)


def test_reading_does_not_change_the_snapshot():
    data = snapshot()
    before = copy.deepcopy(data)
    trace_from_snapshot(data)
    assert data == before
