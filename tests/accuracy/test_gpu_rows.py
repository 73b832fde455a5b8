"""The H200 record (docs/gpu/h200_measured.json, six jobs measured on a GPU): the dry run of every row is within the
bar of what the GPU measured (allocated 1%, reserved 3%, device without NCCL 3%; scripts/gpu_calibrate.py's
TOLERANCE), on the torch installed here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_calibrate.py"


@pytest.fixture(scope="module")
def cal():
    spec = importlib.util.spec_from_file_location("gpu_calibrate_rows", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def results(cal):
    return cal.compare_record(cal.load_record(cal.GPU_RECORD))


def test_the_record_is_the_h200_measurement_of_six_jobs(cal):
    record = cal.load_record(cal.GPU_RECORD)
    assert record["device_facts"]["total_memory_bytes"] == 150_109_880_320
    assert len(record["rows"]) == 6
    assert all(row["torch"].startswith("2.11.0") for row in record["rows"].values())


def test_every_row_is_within_the_bar_of_the_gpu(cal, results):
    assert [r["row"] for r in results] == list(cal.load_record(cal.GPU_RECORD)["rows"])
    assert cal.outside_tolerance(results) == []


def test_the_gpu_table_of_accuracy_md_is_the_current_dry_runs(cal, results):
    # docs/ACCURACY.md holds the table this dry run makes (regenerate it with
    # `PYTHONPATH=src python scripts/gpu_calibrate.py --from-record` when what is counted changes)
    text = (ROOT / "docs" / "ACCURACY.md").read_text()
    assert cal.record_table(results) in text


def test_a_shipped_h200_snapshot_compares_equal_in_allocated_bytes_to_its_dry_run(tmp_path, capsys):
    # p3 (8B shape, 8 layers, FSDP 4 x TP 2, seq 8192) as the user would check it: the dry run, then `compare` of
    # the GPU's gzipped snapshot against it. The snapshot's blocks are the allocator's (max_memory_allocated:
    # 19,404,806,144 B in docs/gpu/h200_measured.json), so the judged figure is the dry run's allocated one.
    import json

    from tests.conftest import cli

    snapshot = ROOT / "tests" / "allocator" / "data" / "p3_8b8l_fsdp4_tp2.pickle.gz"
    flags = "--model llama3-8b --n-layers 8 --world-size 8 --dp-shard 4 --tp 2 --seq-len 8192 --gpu h200"
    rc, _, err = cli(["run", *flags.split(), "--output-dir", str(tmp_path)], capsys)
    assert rc == 0, err
    report = tmp_path / "rank_0" / "rank_0_memory.json"
    rc, out, err = cli(["compare", str(snapshot), str(report), "--json"], capsys)
    assert rc == 0, err
    result = json.loads(out)
    assert result["judged_on"] == "allocated"
    assert result["allocated"]["a"] == result["allocated"]["b"] == 19_404_806_144
    assert result["within_tolerance"]
