"""A pipeline-parallel torchtitan step's dry run equals its real CPU execution (``hyperdryrun torchtitan
--measure``): torchtitan's llama3 debug model cut to 2 layers, PP 2 with 1F1B over world 2, 2 micro batches of
1 x 256 tokens, each rank's stage run with real tensors on the fake process group. The measured run keeps the
stages' receive buffers from its warm-up step (``PipelineStage`` allocates one per micro batch at the first step),
so they are seeded as residents, as the built-in recipe's measured pipeline is. The same host tensors and CPU-only
scalars as in ``test_torchtitan_measure.py`` are left out of the measured side (its module docstring says why), and
the CPU-only fp32 copies that a mixed-dtype in-place ``add_`` makes (:func:`cpu_cast_blocks`)."""

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
    kernel_scratch_blocks,
    live,
)

PP_JOB = [
    "--module", "llama3", "--config", "llama3_debugmodel", "--parallelism.data_parallel_shard_degree", "1",
    "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
    "--training.seq_len", "256", "--training.local_batch_size", "2", "--training.disable_cuda_graphs",
]  # fmt: skip
# one micro batch's hidden state, bf16 (torchtitan's FSDP2 param dtype): 1 x 256 x 256 x 2 B
HIDDEN_BYTES = 1 * 256 * 256 * 2


def cpu_cast_blocks(trace) -> list:
    """The measured backward's CPU-only casts: an in-place ``add_`` of a bf16 gradient into an fp32 one (FSDP2's
    gradient accumulation over the no-sync micro batches of a pipeline, the chunked loss's lm_head gradient) runs
    on the CPU through TensorIterator's input promotion, which makes an fp32 copy of the bf16 operand and frees it
    at once; CUDA's kernels cast while they load (dynamic casting) and allocate nothing."""
    return [b for b in trace.blocks if b.op == "add_" and b.end == b.start + 1 and str(b.phase) == "backward"]


@pytest.mark.parametrize("rank", [0, 1], ids=["first-stage", "last-stage"])
def test_pipeline_dry_run_equals_the_measured_step(rank):
    job = {"world_size": 2, "rank": rank, "n_layers": 2, "attention": "sdpa"}
    measured = measure_torchtitan(PP_JOB, **job)
    dry = simulate_torchtitan(PP_JOB, **job, target_device="cpu", capture_stacks=False)
    assert measured.metadata["pipeline"]["stage_indices"] == [rank]
    casts = cpu_cast_blocks(measured)
    # fp32 copies of bf16 gradients: the lm_head's (vocab 2048 x dim 256), the layers' matrices (768 x 256,
    # 256 x 256) and norms (256)
    assert {b.size for b in casts} <= {2048 * 256 * 4, 768 * 256 * 4, 256 * 256 * 4, 256 * 4}
    left_out = {
        id(b)
        for b in [
            *host_blocks(measured),
            *cpu_scalar_blocks(measured),
            *casts,
            *kernel_scratch_blocks(measured),
        ]
    }
    kept = [b for b in measured.blocks if id(b) not in left_out]
    totals = [live(kept, t) for t in range(measured.num_tasks)]
    print(f"\nrank {rank}: measured {measured.peak:,} B, kept {max(totals):,} B, dry run {dry.peak:,} B")
    # each stage keeps one receive buffer per micro batch: activations in (stage 1) or gradients in (stage 0)
    held = by_category(kept, 0)["Other"]
    assert held >= 2 * HIDDEN_BYTES
    assert max(totals) == dry.peak
    assert by_category(kept, measured.num_tasks) == by_category(dry.blocks, dry.num_tasks)
