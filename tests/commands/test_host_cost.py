"""What a job costs this machine, checked before it starts: the simulated world's setup (world size, ranks asked
for) for ``run``, the real step's host memory for ``measure``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hyperdryrun.cli import build_parser
from hyperdryrun.commands import measure as measure_command
from hyperdryrun.commands.job import check_host_cost, job_from_args, setup_seconds
from hyperdryrun.config import ConfigError, build_config
from tests.conftest import cli

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


@pytest.fixture(autouse=True)
def _scratch(monkeypatch, tmp_path):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HYPERDRYRUN_MAX_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)


# ---------------------------------------------------------------------------------------------------------
# run: the world's setup
# ---------------------------------------------------------------------------------------------------------


def test_ten_million_ranks_are_refused_at_once_naming_the_limit(tmp_path, capsys):
    t0 = time.perf_counter()
    rc, out, err = cli(["run", "--model", "llama-tiny", "--world-size", "10000000"], capsys)
    assert time.perf_counter() - t0 < 10
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "world.world_size=10000000 is more than the limit of 65536 ranks" in err
    assert "HYPERDRYRUN_MAX_WORLD_SIZE raises it" in err
    assert list(tmp_path.iterdir()) == []


def test_ten_million_ranks_in_a_real_process_stop_within_a_minute(tmp_path):
    # before the limit this ran past 300 s at 7.6 GB (DeviceMesh and FSDP2 setup for every rank)
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "HYPERDRYRUN_MAX_WORLD_SIZE")
    }
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "hyperdryrun.cli", "run", "--model", "llama-tiny", "--world-size", "10000000"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "HYPERDRYRUN_MAX_WORLD_SIZE" in proc.stderr


def test_the_world_size_limit_is_raised_by_its_variable(monkeypatch):
    cfg = build_config({"model": {"name": "llama-tiny"}, "world": {"world_size": 128}})
    monkeypatch.setenv("HYPERDRYRUN_MAX_WORLD_SIZE", "64")
    with pytest.raises(ConfigError, match="more than the limit of 64 ranks"):
        check_host_cost(cfg)
    monkeypatch.setenv("HYPERDRYRUN_MAX_WORLD_SIZE", "128")
    assert check_host_cost(cfg) == []
    monkeypatch.setenv("HYPERDRYRUN_MAX_WORLD_SIZE", "-3")
    with pytest.raises(ConfigError, match="HYPERDRYRUN_MAX_WORLD_SIZE='-3' must be a positive integer"):
        check_host_cost(cfg)


def test_setup_estimate_grows_with_the_world_and_the_fsdp_group():
    def seconds(model: str, world: int, **parallel: int) -> float:
        data = {"model": {"name": model}, "world": {"world_size": world}, "parallel": parallel}
        return setup_seconds(build_config({**data, "training": {"num_micro_batches": 8}}))

    # llama-tiny: 2 layers -> 23 tensors; 20,000 ranks -> 7 s of mesh and 16 s of FSDP2 chunks (measured: 21 s)
    assert seconds("llama-tiny", 20_000) == pytest.approx(20_000 * 0.35e-3 + 23 * 20_000 * 35e-6)
    # the same world split 4 ways by tp and pp: an FSDP group of 5,000 and one layer per rank
    assert seconds("llama-tiny", 20_000, tp=2, pp=2) < seconds("llama-tiny", 20_000) / 2
    assert seconds("llama3-8b", 8) < 1


def test_a_long_setup_and_many_ranks_each_warn_on_one_line(capsys):
    big = build_config({"model": {"name": "llama3-8b"}, "world": {"world_size": 8192}})
    (line,) = check_host_cost(big)
    assert line.startswith("world.world_size=8192 with dp_shard=8192: setting up the simulated world")
    assert "takes about 95 s" in line  # 8192 * 0.35 ms + (10 * 32 + 3) * 8192 * 35 us = 2.9 + 92.6
    small = build_config({"model": {"name": "llama-tiny"}, "world": {"world_size": 256}})
    assert check_host_cost(small) == []
    assert check_host_cost(small, ranks=256, jobs=2) == [
        "256 ranks to simulate, each a whole simulation in a worker process (2 at a time)"
    ]
    args = build_parser().parse_args(["run", "--model", "llama-tiny", "--world-size", "256", "--all-ranks"])
    job_from_args(args, {})
    assert capsys.readouterr().err == (
        "hyperdryrun: warning: 256 ranks to simulate, each a whole simulation in a worker process (as many at a "
        "time as there are cores)\n"
    )


# ---------------------------------------------------------------------------------------------------------
# measure: the real step's host memory
# ---------------------------------------------------------------------------------------------------------


def meminfo(tmp_path: Path, monkeypatch, available_kib: int) -> None:
    path = tmp_path / "meminfo"
    path.write_text(
        f"MemTotal:       25165824 kB\nMemFree:         1000000 kB\nMemAvailable:   {available_kib} kB\n"
    )
    monkeypatch.setattr(measure_command, "MEMINFO", path)


def test_available_host_bytes_reads_memavailable(tmp_path, monkeypatch):
    meminfo(tmp_path, monkeypatch, 24 * 1024 * 1024)
    assert measure_command.available_host_bytes() == 24 * GIB
    assert measure_command.available_host_bytes(tmp_path / "missing") is None
    (tmp_path / "odd").write_text("MemTotal: 5 kB\n")
    assert measure_command.available_host_bytes(tmp_path / "odd") is None


def test_an_8b_step_needs_its_fp32_weights_gradients_and_adamw_states_and_more():
    cfg = build_config({"model": {"name": "llama3-8b"}, "training": {"seq_len": 8192}})
    need = measure_command.host_memory_needed(cfg)
    # Llama 3 8B: 8,030,261,248 parameters; fp32 weights, gradients and two AdamW states: 16 bytes each
    assert need.parameters + need.gradients + need.optimizer_states == 8_030_261_248 * 16
    assert need.total > 128 * 10**9


def test_measure_of_8b_on_a_24_gib_machine_is_refused_before_it_starts(tmp_path, monkeypatch, capsys):
    meminfo(tmp_path, monkeypatch, 24 * 1024 * 1024)
    t0 = time.perf_counter()
    rc, out, err = cli(["measure", "--model", "llama3-8b", "--output-dir", str(tmp_path / "out")], capsys)
    assert time.perf_counter() - t0 < 10
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("hyperdryrun: error: measure of llama3-8b needs about ")
    assert "this machine has 24.0 GiB available (MemAvailable)" in err and "--no-memory-check" in err
    assert not (tmp_path / "out").exists()


def test_the_estimate_bounds_what_a_measured_step_really_holds():
    from hyperdryrun.measure import measure_job

    for data in (
        {"model": {"name": "llama-debug"}, "training": {"seq_len": 256}, "target_device": "cpu"},
        {
            "model": {"name": "llama-debug"},
            "training": {"seq_len": 256, "ac": "full", "dtype": "bf16"},
            "target_device": "cpu",
        },
    ):
        cfg = build_config(data)
        need = measure_command.host_memory_needed(cfg)
        peak = measure_job(cfg, capture_stacks=False).peak
        assert peak <= need.total - measure_command.PROCESS_BYTES < 2 * peak


def test_no_memory_check_measures_anyway(tmp_path, monkeypatch, capsys):
    meminfo(tmp_path, monkeypatch, 1)
    argv = ["measure", "--model", "llama-tiny", "--seq-len", "32", "--target-device", "cpu", "--quiet"]
    rc, _, err = cli([*argv, "--output-dir", str(tmp_path / "a")], capsys)
    assert rc == 2 and "needs about" in err
    rc, out, err = cli([*argv, "--output-dir", str(tmp_path / "b"), "--no-memory-check"], capsys)
    assert rc == 0, err
    # the one line of `run --quiet`: a small model's peak in MiB (bytes / 2**20, two decimals), not "0.0000 GiB"
    s = json.loads((tmp_path / "b" / "rank_0" / "rank_0_memory.json").read_text())["summary"]
    assert s["peak_bytes"] < 2**30 // 10
    line = f"measured peak {s['peak_bytes'] / 2**20:,.2f} MiB ({s['peak_phase']})"
    assert out.rstrip("\n") == (f"{line}; {s['verdict']}" if s.get("verdict") else line)
