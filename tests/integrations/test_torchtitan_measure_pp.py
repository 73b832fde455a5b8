"""A pipeline-parallel torchtitan step's dry run equals its real CPU execution (``hyperdryrun torchtitan
--measure``): torchtitan's llama3 debug model cut to 2 layers, PP 2 with 1F1B over world 2, 2 micro batches of
1 x 256 tokens, each rank's stage run with real tensors on the fake process group. The measured run keeps the
stages' receive buffers from its warm-up step (``PipelineStage`` allocates one per micro batch at the first step),
so they are seeded as residents, as the built-in recipe's measured pipeline is. The same host tensors and CPU-only
scalars as in ``test_torchtitan_measure.py`` are left out of the measured side (its module docstring says why)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install 'hyperdryrun[torchtitan]')"
)

from hyperdryrun.integrations.torchtitan import simulate_torchtitan  # noqa: E402
from hyperdryrun.measure.torchtitan import measure_torchtitan  # noqa: E402
from tests.integrations.test_torchtitan_measure import (  # noqa: E402
    by_category,
    cpu_scalar_blocks,
    host_blocks,
    live,
)

PP_JOB = [
    "--module", "llama3", "--config", "llama3_debugmodel", "--parallelism.data_parallel_shard_degree", "1",
    "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
    "--training.seq_len", "256", "--training.local_batch_size", "2", "--training.disable_cuda_graphs",
]  # fmt: skip
# one micro batch's hidden state, bf16 (torchtitan's FSDP2 param dtype): 1 x 256 x 256 x 2 B
HIDDEN_BYTES = 1 * 256 * 256 * 2


LAST_STAGE_GAP = pytest.mark.xfail(
    strict=True,
    reason="open: the last stage's measured peak is 242,692 B (0.7%) above its dry run; the peaks fall at different "
    "backward ops, during FSDP2's gradient accumulation over the second micro batch (the measured run holds the "
    "fp32 unsharded gradients of the first as Temp _to_copy blocks and a 2 MiB lm_head add_), not yet explained",
)


@pytest.mark.parametrize(
    "rank", [0, pytest.param(1, marks=LAST_STAGE_GAP)], ids=["first-stage", "last-stage"]
)
def test_pipeline_dry_run_equals_the_measured_step(rank):
    job = {"world_size": 2, "rank": rank, "n_layers": 2, "attention": "sdpa"}
    measured = measure_torchtitan(PP_JOB, **job)
    dry = simulate_torchtitan(PP_JOB, **job, target_device="cpu", capture_stacks=False)
    assert measured.metadata["pipeline"]["stage_indices"] == [rank]
    left_out = {id(b) for b in [*host_blocks(measured), *cpu_scalar_blocks(measured)]}
    kept = [b for b in measured.blocks if id(b) not in left_out]
    totals = [live(kept, t) for t in range(measured.num_tasks)]
    print(f"\nrank {rank}: measured {measured.peak:,} B, kept {max(totals):,} B, dry run {dry.peak:,} B")
    # each stage keeps one receive buffer per micro batch: activations in (stage 1) or gradients in (stage 0)
    held = by_category(kept, 0)["Other"]
    assert held >= 2 * HIDDEN_BYTES
    assert max(totals) == dry.peak
    assert by_category(kept, measured.num_tasks) == by_category(dry.blocks, dry.num_tasks)
