"""The benchmark script runs end to end at its smallest size and prints its table (no timing is asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hyperdryrun

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def test_bench_smoke_prints_table_and_target_lines(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(hyperdryrun.__file__).resolve().parent.parent)
    out = tmp_path / "PERFORMANCE.md"
    out.write_text("# Performance\n\nhand-written text stays\n")
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    assert "| layers | variant | wall s | × floor (wall) | CPU s | × floor (CPU) |" in text
    for variant in ("floor", "track", "full", "memtracker", "fsdpmemtracker"):
        assert f"| 1 | {variant} |" in text
    verdicts = [
        line.split()[0] for line in text.splitlines() if line.split()[:1] in (["PASS"], ["FAIL"], ["SKIP"])
    ]
    assert len(verdicts) == 8
    written = out.read_text()
    assert written.startswith("# Performance\n\nhand-written text stays\n")
    assert "<!-- bench:begin -->" in written and "| 1 | full |" in written


def test_commands_benchmark_smoke_runs_each_kind_against_its_floor():
    """benchmarks/commands.py (issue 29's whole-command and search benchmark) at its smallest: a rank job's whole
    command against its floor, a search cold and cached; rows only, no timing asserted."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(hyperdryrun.__file__).resolve().parent.parent)
    script = BENCH.parent / "commands.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| `", "| imports"))]
    assert [row.split("|")[1].strip() for row in rows] == [
        "imports any dry-run process needs (torch, DTensor, FSDP2, a FakeTensorMode)",
        "`readme` (llama-tiny) whole command",
        "`fit70` (llama-tiny) cold",
        "`fit70` (llama-tiny) cached",
    ]
    for row in rows:
        cpu, wall = (float(x) for x in row.split("|")[2:4])
        assert cpu > 0 and wall > 0
