"""The H200 record's rows (docs/gpu/h200_measured.json, measured on torch 2.11) dry-run on this torch, each within
the bar of scripts/gpu_calibrate.py (.ci/torch-releases runs it on every supported release): allocated (the tensors
FSDP2, DTensor and the kernels make), reserved (the caching allocator's segments for them) and device without NCCL
(reserved + the CUDA context: the H200 shows nvidia-smi - max_memory_reserved = 880,803,840 B on every row, the
context default of world/runtime.py). Also: docs/ACCURACY.md's GPU table is the current dry run's, and a shipped
snapshot compares equal to its dry run in allocated bytes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_calibrate.py"
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
def test_every_row_of_the_record_dry_runs_within_the_bar(results):
    cal, record, rows = results
    assert [r["row"] for r in rows] == list(record["rows"])
    for r in rows:
        assert r["dry_reserved"] >= r["dry_allocated"] >= r["dry_peak"] > 0, r
    assert cal.outside_tolerance(rows) == []


@pytest.mark.slow
def test_the_gpu_keeps_the_same_bytes_beside_the_reserved_ones_on_every_row(results):
    """The record's own constant (independent of the dry run), and the dry run's device figure is its reserved
    bytes plus one constant too: the device gap is the context model's, the same on every row."""
    _, record, rows = results
    assert {row["smi_used"] - row["max_reserved"] for row in record["rows"].values()} == {GPU_BEYOND_RESERVED}
    assert {r["dry_device"] - r["dry_reserved"] for r in rows} == {GPU_BEYOND_RESERVED}


def test_the_record_is_the_h200_measurement_of_six_jobs(results):
    _, record, _ = results
    assert record["device_facts"]["total_memory_bytes"] == 150_109_880_320
    assert len(record["rows"]) == 6
    assert all(row["torch"].startswith("2.11.0") for row in record["rows"].values())


@pytest.mark.slow
def test_the_gpu_table_of_accuracy_md_is_the_current_dry_runs(results):
    cal, _, rows = results
    # docs/ACCURACY.md holds the table this dry run makes (regenerate it with
    # `PYTHONPATH=src python scripts/gpu_calibrate.py --from-record` when what is counted changes): between its
    # markers the pinned release's (2.11 to 2.14 give the same), under "On torch 2.15" 2.15's (p4 differs: torch's
    # FSDP2 frees the unsharded gradients earlier)
    text = (ROOT / "docs" / "ACCURACY.md").read_text()
    assert cal.record_table(rows) in text


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_exact_shortcut_gives_every_row_s_full_dry_run_figures(results):
    # What `fit` reads of a rank when it samples instead of simulating the whole step: the tensors' peak and the
    # allocator model's reserved bytes, replayed on the blocks written down from the samples
    # (hyperdryrun.search.synthesis), equal to the full dry run's (the fixture's) on each row that has a plan.
    from hyperdryrun.search.extrapolate import EXTRAPOLATED, plan_for
    from hyperdryrun.search.shortcut import step_figures

    cal, record, rows = results
    gpu = record.get("gpu_preset", "h200")
    planned = 0
    for (name, over), r in zip(cal.record_rows(record), rows, strict=True):
        cfg = cal.gpu_config(over, gpu)
        if plan_for(cfg)[0] is None:
            continue
        planned += 1
        short = step_figures(cfg)
        assert short.method == EXTRAPOLATED, (name, short.detail)
        assert (short.peak_bytes, short.peak_reserved_bytes) == (r["dry_peak"], r["dry_reserved"]), name
    assert planned == 5  # all but p3 (8 layers: its samples would cost more than its step)
