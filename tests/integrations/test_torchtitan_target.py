"""``hyperdryrun torchtitan`` takes the device target as every front door does: ``--gpu`` (the preset's capacity,
SDPA rules and cuBLAS workspace), ``--alloc-conf``, ``--device-memory-gib`` and the margins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install 'hyperdryrun[torchtitan]')"
)

from hyperdryrun.cli import main  # noqa: E402

DEBUG = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "256"]
DEBUG += ["--training.disable_cuda_graphs", "--n-layers", "1", "--no-stacks", "--in-process", "--quiet"]
MiB = 2**20


def report(out: Path) -> dict:
    return json.loads((out / "rank_0" / "rank_0_memory.json").read_text())


def test_gpu_and_alloc_conf_give_the_presets_capacity_kernels_and_workspace(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["torchtitan", *DEBUG, "--gpu", "a100-80gb", "--alloc-conf", "expandable_segments:True"]
    assert main([*argv, "--output-dir", str(out)]) == 0
    r = report(out)
    cuda = r["metadata"]["cuda"]
    # the A100 80GB's total_memory, 81,050 MiB (torch's "79.15 GiB"), is the verdict's capacity
    assert r["summary"]["capacity_bytes"] == 81_050 * MiB and r["summary"]["oom"] is False
    assert "of 79.15 GiB" in capsys.readouterr().out
    assert cuda["gpu"]["name"] == "a100-80gb" and cuda["gpu"]["compute_capability"] == [8, 0]
    assert cuda["kernels"].startswith(
        "sm80 (a100-80gb)"
    )  # the SDPA rules of an sm80 card, not the default sm90
    # torch 2.13's CublasHandlePool.cpp default below sm90: ":4096:2:16:8" = 2 x 4 MiB + 8 x 16 KiB per handle
    assert cuda["cublas_workspace"]["bytes_per_handle"] == 2 * 4 * MiB + 8 * 16 * 1024
    assert cuda["allocator"]["settings"] == "expandable_segments:True"


def test_device_memory_overrides_the_presets_capacity_and_a_bad_gpu_is_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["torchtitan", *DEBUG, "--gpu", "h100-80gb", "--device-memory-gib", "0.01", "--margin-gib", "0"]
    assert main([*argv, "--output-dir", str(out)]) == 1  # OOM against the 0.01 GiB given, not the H100's
    assert report(out)["summary"]["capacity_bytes"] == round(0.01 * 2**30)
    capsys.readouterr()
    assert main(["torchtitan", *DEBUG, "--gpu", "h900", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hyperdryrun: error: cuda.gpu (--gpu): gpu='h900'") and err.count("\n") == 1
