"""The H200 record's rows (docs/gpu/h200_measured.json, measured on torch 2.11) dry-run on this torch, each within
the bar of scripts/gpu_calibrate.py on the figures torch decides (.ci/torch-releases runs it on every supported
release): allocated (the tensors FSDP2, DTensor and the kernels make) and reserved (the caching allocator's
segments for them).

The device figure adds the CUDA context, a constant of world/runtime.py that no torch release changes: the H200
shows nvidia-smi - max_memory_reserved = 880,803,840 B on every row, so it is checked here as that constant."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_calibrate.py"
GPU_BEYOND_RESERVED = 880_803_840
"""nvidia-smi minus max_memory_reserved on the H200, the same on each of the six rows (the record's own figures):
the CUDA context and what the driver keeps beside the allocator's segments."""


@pytest.fixture(scope="module")
def results():
    spec = importlib.util.spec_from_file_location("gpu_calibrate_record", SCRIPT)
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    record = cal.load_record(cal.GPU_RECORD)
    return cal, record, cal.compare_record(record)


@pytest.mark.slow
def test_every_row_of_the_record_dry_runs_within_the_bar_on_allocated_and_reserved(results):
    cal, record, rows = results
    assert [r["row"] for r in rows] == list(record["rows"])
    for r in rows:
        assert r["dry_reserved"] >= r["dry_allocated"] >= r["dry_peak"] > 0, r
        for figure in ("allocated", "reserved"):
            assert abs(r["diff"][figure]) <= cal.TOLERANCE[figure], (r["row"], figure, r["diff"][figure])


@pytest.mark.slow
def test_the_gpu_keeps_the_same_bytes_beside_the_reserved_ones_on_every_row(results):
    """The record's own constant (independent of the dry run), and the dry run's device figure is its reserved
    bytes plus one constant too: the device gap is the context model's, the same on every row."""
    _, record, rows = results
    assert {row["smi_used"] - row["max_reserved"] for row in record["rows"].values()} == {GPU_BEYOND_RESERVED}
    assert len({r["dry_device"] - r["dry_reserved"] for r in rows}) == 1
