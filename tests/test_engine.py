"""The engine's DTensor speed-up patch changes no result and is undone after every run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hyperdryrun
from hyperdryrun.engine import SimulationError

from .conftest import dry_run

_CSV_SCRIPT = """
import sys
import hyperdryrun.engine as engine
from hyperdryrun.config import build_config
from hyperdryrun.recipe import run_job
from hyperdryrun.report import blocks_csv
if sys.argv[1] == "unpatched":
    engine.dtensor_speedups = lambda: []
cfg = build_config({"model": {"name": "llama-tiny"}, "training": {"seq_len": 64},
                    "world": {"world_size": 4}, "parallel": {"tp": 2}})
sys.stdout.write(blocks_csv(run_job(cfg)))
"""


def _fresh_process_csv(mode: str) -> str:
    # A fresh process each: the first run in a process sees torch's DTensor caches cold (see docs/PERFORMANCE.md).
    env = dict(os.environ, PYTHONPATH=str(Path(hyperdryrun.__file__).resolve().parent.parent))
    proc = subprocess.run(
        [sys.executable, "-c", _CSV_SCRIPT, mode], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_dtensor_speedup_changes_no_block():
    # FSDP over TP-sharded parameters: the foreach optimizer ops have _StridedShard inputs, the patch's other branch.
    patched = _fresh_process_csv("patched")
    assert patched.count("\n") > 100
    assert _fresh_process_csv("unpatched") == patched


def test_dtensor_speedup_patch_undone_after_run_and_after_failure():
    import torch.distributed.tensor._sharding_prop as sharding_prop

    from hyperdryrun import simulate

    original = sharding_prop._propagate_use_strided_shard_flag
    dry_run(world__world_size=2)
    assert sharding_prop._propagate_use_strided_shard_flag is original

    def boom(model, batch):
        raise RuntimeError("loss exploded")

    with pytest.raises(SimulationError, match="step: RuntimeError: loss exploded"):
        simulate(
            lambda: torch.nn.Linear(4, 4), lambda i, d: torch.ones(2, 4, device=d), loss_fn=boom, world_size=2
        )
    assert sharding_prop._propagate_use_strided_shard_flag is original
