""".ci/torch-releases' disk check, run against a fake ``df`` that reports a chosen free space: the release venvs'
disk is refused in one line before the full suite's half hour, and ``--discard`` (what .ci/run passes: one release
venv on the disk at a time) needs one venv's room, not four. The sizes the script assumes (a release venv ~6 GiB,
.ci/run's .venv ~5 GiB, pip's wheels ~4 GiB, the script's comment) are the expectation; a CI machine with 32 GiB
free was refused by the earlier sum of 33 GiB."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the four releases of .ci/torch-releases' RELEASES (tests/compat/test_versions.py checks the list)
RELEASES = 4

FAKE_DF = """#!/bin/sh
# df -P DIR / df -Pk DIR as coreutils prints them: a header, then one filesystem line (free in 1 KiB blocks)
echo "Filesystem 1024-blocks Used Available Capacity Mounted on"
echo "/dev/fake 999999999 1 $FAKE_FREE_KIB 1% /"
"""


def check_disk(tmp_path: Path, free_gib: int, *args: str) -> subprocess.CompletedProcess[str]:
    """.ci/torch-releases in an empty checkout (no .venv, no .venvs), with ``df`` reporting ``free_gib``."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / ".ci" / "torch-releases", repo / ".ci" / "torch-releases")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "df").write_text(FAKE_DF)
    (bin_dir / "df").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_FREE_KIB": str(free_gib * 1024 * 1024),
        "TMPDIR": str(tmp_path),  # the same (fake) filesystem: the wheels count with the venvs
    }
    return subprocess.run(
        ["bash", str(repo / ".ci" / "torch-releases"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_discard_needs_room_for_one_release_venv(tmp_path: Path) -> None:
    need = 5 + 6 + 4  # .venv, one release venv, pip's wheels
    ok = check_disk(tmp_path, need, "--check-disk", "--discard")
    assert ok.returncode == 0, ok.stderr
    short = check_disk(tmp_path, need - 1, "--check-disk", "--discard")
    assert short.returncode == 1
    assert (
        short.stderr
        == f"torch-releases: {need - 1} GiB free for ., the missing venvs need ~{need} GiB there\n"
    )


def test_keeping_the_venvs_needs_room_for_all_of_them(tmp_path: Path) -> None:
    need = 5 + 6 * RELEASES + 4
    assert check_disk(tmp_path, need, "--check-disk").returncode == 0
    short = check_disk(tmp_path, 32, "--check-disk")  # what a CI machine had
    assert short.returncode == 1
    assert short.stderr == f"torch-releases: 32 GiB free for ., the missing venvs need ~{need} GiB there\n"


def test_ci_run_discards_the_release_venvs() -> None:
    """.ci/run checks and runs the releases with --discard (its clean clone keeps nothing)."""
    calls = [
        line.split()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith("bash .ci/torch-releases")
    ]
    assert calls == [
        ["bash", ".ci/torch-releases", "--check-disk", "--discard"],
        ["bash", ".ci/torch-releases", "--discard"],
    ]


@pytest.mark.parametrize("option", ["--keep", "-x"])
def test_an_unknown_option_is_refused_in_one_line(tmp_path: Path, option: str) -> None:
    done = check_disk(tmp_path, 100, option)
    assert done.returncode == 2
    assert done.stderr == f"torch-releases: unknown option {option} (--check-disk, --discard)\n"
