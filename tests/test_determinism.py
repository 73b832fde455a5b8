"""The same inputs give byte-identical reports (JSON and CSV), run after run."""

from __future__ import annotations

import pytest

from hyperdryrun.cli import main


@pytest.mark.parametrize(
    "argv",
    [
        ["--world-size", "2"],
        ["--world-size", "4", "--tp", "2", "--ac", "selective", "--num-micro-batches", "2"],
    ],
    ids=["fsdp2", "fsdp2-tp2-sac-2mb"],
)
def test_two_identical_runs_write_byte_identical_reports(argv, tmp_path, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    outputs = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert main(["run", "--model", "llama-tiny", "--seq-len", "32", *argv, "--output-dir", str(out)]) == 0
        outputs.append({p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()})
    capsys.readouterr()
    assert sorted(str(p) for p in outputs[0]) == [
        "rank_0/rank_0_memory.csv",
        "rank_0/rank_0_memory.json",
        "rank_0/rank_0_segments.csv",  # a CUDA target: the caching allocator's segments at its reserved peak
    ]
    assert outputs[0] == outputs[1]


def test_a_fresh_process_and_a_warm_process_write_the_same_reports(tmp_path, capsys, monkeypatch):
    # DTensor caches its sharding propagation per process; the shape inference it runs on a cache miss must not
    # reach the trace, or the first run in a process would differ from later ones. (--no-stacks: the in-process
    # runs' Python stacks rightly include this test's frames, which the subprocess's do not.)
    import os
    import subprocess
    import sys
    from pathlib import Path

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    argv = [
        "run",
        "--model",
        "llama-tiny",
        "--seq-len",
        "32",
        "--world-size",
        "2",
        "--tp",
        "2",
        "--quiet",
        "--no-stacks",
    ]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    subprocess.run(
        [sys.executable, "-m", "hyperdryrun.cli", *argv, "--output-dir", str(tmp_path / "fresh")],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    for name in ("warm1", "warm2"):
        assert main([*argv, "--output-dir", str(tmp_path / name)]) == 0
    capsys.readouterr()
    for rel in ("rank_0/rank_0_memory.json", "rank_0/rank_0_memory.csv", "rank_0/rank_0_segments.csv"):
        fresh = (tmp_path / "fresh" / rel).read_bytes()
        assert fresh == (tmp_path / "warm1" / rel).read_bytes() == (tmp_path / "warm2" / rel).read_bytes()
