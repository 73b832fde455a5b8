"""Compiled steps against real CPU Inductor execution: a model whose blocks are ``torch.compile``d (Inductor, the
default backend) dry-run with ``target_device="cpu"`` and measured for real (``hyperdryrun.measure``: the blocks
compiled by Inductor's C++ backend with gcc, run under torch.profiler); the step peak equal to the byte and every
phase's peak (forward, backward, optimizer) within 1%, as the accuracy matrix holds eager jobs (the measured side
without kernel scratch). 512 tokens make the blocks' activations (512 x 256 fp32 = 512 KiB each) outweigh the
parameters and AdamW states (6 x 64 KiB per block), so the forward and backward peaks are the compiled graphs'."""

from __future__ import annotations

import functools
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import hyperdryrun
from hyperdryrun.measure.accuracy import peak_error
from hyperdryrun.measure.step import measure
from hyperdryrun.report.build import phases
from hyperdryrun.trace.blocks import STEP_PHASES

TOLERANCE = 0.01

DIM, TOKENS = 64, 512


def _save_matmuls(ctx, op, *args, **kwargs):
    return (
        CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
    )


class Block(nn.Module):
    def __init__(self, ac: str) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(DIM, 4 * DIM) / DIM**0.5)
        self.w2 = nn.Parameter(torch.randn(4 * DIM, DIM) / DIM**0.5)
        self.ac = ac

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.rms_norm(x, (DIM,)) @ self.w1).sin().cos() @ self.w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ac == "full":
            return x + checkpoint(self.mlp, x, use_reentrant=False)
        if self.ac == "selective":
            contexts = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            return x + checkpoint(self.mlp, x, use_reentrant=False, context_fn=contexts)
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self, ac: str = "none", layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(ac) for _ in range(layers))
        for block in self.blocks:
            block.compile()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


JOBS = {
    "dense": {},
    "dense 2 micro batches": {"num_micro_batches": 2},
    "full AC in the compiled blocks": {"ac": "full"},
    "selective AC (save matmuls) in the compiled blocks": {"ac": "selective"},
}


@cache
def both(name: str):
    job = dict(JOBS[name])
    ac = job.pop("ac", "none")
    kwargs = dict(
        loss_fn=lambda model, x: model(x).pow(2).mean(),
        capture_stacks=False,
        **job,
    )

    def batch(i, device):
        return torch.randn(TOKENS, DIM, device=device)

    dry = hyperdryrun.simulate(lambda: Model(ac), batch, target_device="cpu", **kwargs)
    measured = measure(lambda: Model(ac), batch, **kwargs)
    return dry, measured


@pytest.mark.parametrize("name", list(JOBS))
def test_compiled_step_dry_run_equals_real_inductor_execution(name):
    dry, measured = both(name)
    diff, rel = peak_error(dry, measured)
    print(f"\n{name}: dry {dry.peak:,} B, measured {measured.peak:,} B, diff {diff:+,} B ({rel:+.4%})")
    assert any(x.startswith("torch.compile region Block module") for x in dry.limitations)
    assert not any("ran eagerly" in x or "op by op" in x for x in dry.limitations)
    assert diff == 0, (dry.peak, measured.peak)
    dry_phases = phases(dry)
    measured_phases = measured.metadata["kernel_scratch"]["phase_peak_bytes_excluding"]
    for phase in STEP_PHASES:
        d = dry_phases.get(str(phase), {}).get("peak_bytes", 0)
        m = measured_phases.get(str(phase), 0)
        print(f"  {phase}: dry {d:,} B, measured {m:,} B")
        assert abs(m - d) <= TOLERANCE * max(m, d, 1), (phase, d, m)


def test_compile_changes_what_the_step_holds():
    """The jobs differ where compile and checkpointing differ: full AC inside the compiled blocks saves less for
    backward than the plain compiled blocks (the dry run's per-region line), and both sides agree on it."""
    plain, full = both("dense")[0], both("full AC in the compiled blocks")[0]

    def saved(trace):
        (line,) = [x for x in trace.limitations if x.startswith("torch.compile region Block module")]
        return int(line.split("saved for backward per call ")[1].split("(")[1].split(" B")[0])

    assert saved(full) < saved(plain)
