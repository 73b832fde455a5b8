"""Fixtures: a two-rank dry run of llama-tiny written by the CLI, as a user would make it."""

from __future__ import annotations

import csv
import importlib
import os
from pathlib import Path
from types import ModuleType

import pytest

from hyperdryrun.cli import main

TINY = ["--model", "llama-tiny", "--world-size", "2", "--seq-len", "256", "--quiet"]


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``rank_0/`` and ``rank_1/`` of llama-tiny on FSDP 2, from ``hyperdryrun run``."""
    out = tmp_path_factory.mktemp("run")
    for rank in ("0", "1"):
        assert main(["run", *TINY, "--rank", rank, "--output-dir", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def rank0_json(run_dir: Path) -> Path:
    return run_dir / "rank_0" / "rank_0_memory.json"


def csv_blocks(path: Path) -> list[dict[str, str]]:
    """The memory-block CSV rows as dicts, read with the csv module alone."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def live_at(rows: list[dict[str, str]], task: int) -> list[dict[str, str]]:
    return [r for r in rows if int(r["start_time_stamp"]) <= task < int(r["end_time_stamp"])]


def need(module: str, why: str) -> ModuleType:
    """Import an optional test dependency; outside CI skip loudly when it is missing, under CI fail (CI installs
    ``.[dev]``, so a missing one there is a broken set-up, not a reason to pass)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SKIPPED LOUDLY: {module} is not installed ({why}); pip install -e '.[dev]'")
