"""scripts/gpu_calibrate.py's three figures and its docs/ACCURACY.md section, on the paths a CPU machine can run."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_calibrate.py"


@pytest.fixture(scope="module")
def cal():
    spec = importlib.util.spec_from_file_location("gpu_calibrate_table", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_table_goes_between_the_markers_and_the_rest_of_the_file_stays(cal, tmp_path):
    doc = tmp_path / "ACCURACY.md"
    before, after = "# Accuracy\n\ntext before\n\n", "\n\ntext after\n"
    doc.write_text(f"{before}{cal.BEGIN}\nold table\n{cal.END}{after}")
    cal.write_accuracy(doc, "GPU: X", "| a |\n|---|")
    expected = f"{before}{cal.BEGIN}\nGPU: X\n\n| a |\n|---|\n{cal.END}{after}"
    assert doc.read_text() == expected
    cal.write_accuracy(doc, "GPU: X", "| a |\n|---|")  # a second run replaces, it does not add
    assert doc.read_text() == expected


def test_a_file_without_markers_gets_the_section_appended(cal, tmp_path):
    doc = tmp_path / "ACCURACY.md"
    doc.write_text("# Accuracy\n")
    cal.write_accuracy(doc, "h", "t")
    assert doc.read_text() == f"# Accuracy\n\n{cal.BEGIN}\nh\n\nt\n{cal.END}\n"


def test_the_repository_accuracy_file_has_the_markers_once(cal):
    text = (ROOT / "docs" / "ACCURACY.md").read_text()
    assert text.count(cal.BEGIN) == 1 and text.count(cal.END) == 1
    assert text.index(cal.BEGIN) < text.index(cal.END)


def test_nvidia_smi_used_is_this_process_row_in_mib(cal, monkeypatch):
    def fake_run(argv, **kwargs):
        assert argv[0] == "nvidia-smi" and "--query-compute-apps=pid,used_memory" in argv
        return subprocess.CompletedProcess(argv, 0, stdout="11, 500\n4242, 81234\n")

    monkeypatch.setattr(cal.subprocess, "run", fake_run)
    assert cal.nvidia_smi_used(4242) == 81234 * 2**20
    assert cal.nvidia_smi_used(7) is None  # a process nvidia-smi does not list


def test_nvidia_smi_missing_is_none(cal, monkeypatch):
    def missing(argv, **kwargs):
        raise FileNotFoundError(argv[0])

    monkeypatch.setattr(cal.subprocess, "run", missing)
    assert cal.nvidia_smi_used() is None


def test_the_dry_run_side_of_a_cuda_row_gives_allocated_reserved_and_device_without_nccl(cal):
    from hyperdryrun.config import build_config
    from hyperdryrun.measure.accuracy import merge

    name, over = cal.TINY[1]  # world 2: FSDP, so a communicator's NCCL line exists and must be left out
    cfg = build_config(merge(over, {"target_device": "cuda"}))
    dry = cal.dry_figures(cfg)
    from hyperdryrun.recipe import run_job
    from hyperdryrun.report.build import device_memory_of

    trace = run_job(cfg, capture_stacks=False)
    dm = device_memory_of(trace)
    context = trace.metadata["cuda"]["cuda_context"]["bytes"]
    assert trace.metadata["cuda"]["nccl"]["bytes"] > 0
    assert dry["dry_peak"] == trace.peak
    assert dry["dry_allocated"] == dm.peak_allocated and dry["dry_reserved"] == dm.peak_reserved
    assert (
        dry["dry_device"] == dm.peak_reserved + context
    )  # reserved + context; no NCCL on a fake process group
    assert dry["dry_reserved"] >= dry["dry_allocated"] >= dry["dry_peak"]


def test_the_cpu_path_has_no_reserved_or_device_figures(cal):
    rows = cal.run(cal.TINY[:1], "cpu")
    (r,) = rows
    assert r["dry_reserved"] is None and r["dry_device"] is None and r["smi_used"] is None
    line = cal.table(rows).splitlines()[-1]
    assert line.endswith("| - | - | - |") and f"| {r['dry_peak']:,} |" in line
