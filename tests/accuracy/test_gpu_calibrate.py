"""scripts/gpu_calibrate.py on its CPU path (no GPU here): one table row per configuration, JSON beside it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_calibrate.py"


@pytest.fixture(scope="module")
def gpu_calibrate():
    spec = importlib.util.spec_from_file_location("gpu_calibrate", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_path_prints_one_row_per_config_and_agrees_within_one_percent(gpu_calibrate, tmp_path, capsys):
    out = tmp_path / "cal.json"
    rc = gpu_calibrate.main(["--device", "cpu", "--tiny", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    results = json.loads(out.read_text())
    assert [r["config"] for r in results] == [name for name, _ in gpu_calibrate.TINY]
    for r in results:
        assert f"| {r['config']} | cpu | {r['dry_peak']:,} |" in text
        # the CPU path's "allocated" is the measured peak without kernel scratch: the dry run must match it to the
        # byte, as every accuracy row does; its "reserved" adds the scratch (oneDNN's bf16 scratchpad, 35,200 B at
        # most on these rows), which more than 64 KiB would mean real allocations were taken for scratch
        assert r["diff_allocated"] == 0, r
        assert 0 <= r["max_reserved"] - r["max_allocated"] <= 64 * 1024, r
        assert abs(r["diff_pct"]) <= 1.0, r


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_one_line_error(gpu_calibrate, capsys):
    assert gpu_calibrate.main(["--device", "cuda", "--tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torch.cuda.is_available() is False" in err
