"""scripts/layer_repeat.py on a real dry run: identical decoder layers give identical block sequences, and
consecutive middle layers are shifted copies of one another (the same shift for every pair)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_middle_layers_of_a_dry_run_repeat_with_one_shift_pattern(tmp_path):
    run = [sys.executable, "-m", "hyperdryrun.cli", "run", "--model", "llama-tiny", "--n-layers", "5"]
    subprocess.run([*run, "--world-size", "2", "--output-dir", str(tmp_path), "--quiet"], check=True)
    csv = tmp_path / "rank_0" / "rank_0_memory.csv"
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "layer_repeat.py"), str(csv)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    rows = {int(line.split()[0]): line.split()[1:] for line in out if line.strip()[:1].isdigit()}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert {rows[n][1] for n in (1, 2, 3)} == {"yes"}
    assert len({rows[n][0] for n in (1, 2, 3)}) == 1  # as many blocks in every middle layer
    assert "start shifts between consecutive middle layers (1..3): the same for every pair" in out
