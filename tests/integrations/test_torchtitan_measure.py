"""A torchtitan step's dry run equals its real CPU execution (``hyperdryrun torchtitan --measure``), to the byte.

The job: torchtitan 0.3.0's llama3 debug model cut to 2 layers, its optimizer container (fused AdamW), selective
activation checkpointing and chunked loss, ``Trainer.train_step``, world 8, FSDP 8, rank 0 (measured with real
tensors and the fake process group, as ``hyperdryrun measure`` does), local batch 2 x 256 tokens. The attention is
torchtitan's ScaledDotProductAttention (``--attention sdpa``): FlexAttention has no CPU backward in torch 2.13.

What both sides count, and so what is compared: every allocation of the step on the device, except the host
tensors that a CPU run puts on the same allocator and a GPU run keeps in host memory, which the dry run (it follows
a GPU's device memory, also on a CPU target) does not count: the CPU RNG state that activation checkpointing saves
per checkpointed layer and stashes while recomputing it (``torch.get_rng_state()``, 5056 B each) and torchtitan's host token counter
(``local_valid_tokens = torch.tensor(0, dtype=torch.int64)`` in ``Trainer.train_step``, 8 B); and one CPU-only
kernel allocation: fused AdamW's ``torch._foreach_add_(state_steps, 1)`` takes the CPU's per-tensor slow path,
which wraps the scalar 1 as a 0-dim int64 tensor (8 B) and casts it to the float32 step (4 B), freed at once,
where CUDA's foreach kernel takes the scalar as an argument. Those are found by their op, size and the source line
that makes them, and their bytes are stated. And, as every measured-against-dry comparison does, the kernels' own
scratch (``Block.scratch``: allocated and freed inside the kernel that made it, which is no op output a dry run
records): its size depends on the CPU. On a core with AMX, oneDNN's bf16 GEMM packs its operands into up to
2.6 MB of scratch per mm in these jobs, enough to move a phase's measured maximum; without AMX it is a few KB.
Nothing else is left out.
"""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install 'hyperdryrun[torchtitan]')"
)

import torch  # noqa: E402

import hyperdryrun  # noqa: E402
from hyperdryrun.integrations.torchtitan import simulate_torchtitan  # noqa: E402
from hyperdryrun.measure.step import MeasureError  # noqa: E402
from hyperdryrun.measure.torchtitan import measure_torchtitan  # noqa: E402
from hyperdryrun.trace.blocks import STEP_PHASES, Category  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
JOB = [
    "--module",
    "llama3",
    "--config",
    "llama3_debugmodel",
    "--parallelism.data_parallel_shard_degree",
    "8",
    "--training.seq_len",
    "256",
    "--training.local_batch_size",
    "2",
]
N_LAYERS = 2
FP32 = 4


def host_token_counter_line() -> int:
    """The line of torchtitan's ``Trainer.train_step`` that makes its host token counter, read from its source."""
    from torchtitan.trainer import Trainer

    lines, first = inspect.getsourcelines(Trainer.train_step)
    hits = [first + i for i, line in enumerate(lines) if "local_valid_tokens = torch.tensor(0" in line]
    assert len(hits) == 1, hits
    return hits[0]


def host_blocks(trace) -> list:
    """The measured blocks that are host memory on a GPU (see the module docstring)."""
    line = host_token_counter_line()
    out = []
    for b in trace.blocks:
        frames = trace.stacks.frames(b.stack_id) if b.stack_id >= 0 else ()
        counter = any(f.endswith("torchtitan/trainer.py") and n == line for f, n, _ in frames)
        if "get_state" in b.op or counter:
            out.append(b)
    return out


def cpu_scalar_blocks(trace) -> list:
    """The measured optimizer's wrapped scalars of the CPU foreach slow path (see the module docstring)."""
    return [
        b
        for b in trace.blocks
        if b.op == "_foreach_add_"
        and str(b.phase) == "optimizer"
        and b.size in (8, 4)
        and b.end == b.start + 1
    ]


def kernel_scratch_blocks(trace) -> list:
    """The measured kernels' own workspaces (see the module docstring): not op outputs, so no dry run has them."""
    return [b for b in trace.blocks if b.scratch]


def live(blocks, task: int) -> int:
    return sum(b.size for b in blocks if b.start <= task < b.end)


def by_category(blocks, task: int) -> dict[str, int]:
    out = {str(c): 0 for c in Category}
    for b in blocks:
        if b.start <= task < b.end:
            out[str(b.category)] += b.size
    return out


@pytest.fixture(scope="module")
def measured_and_dry():
    measured = measure_torchtitan(JOB, world_size=8, rank=0, n_layers=N_LAYERS, attention="sdpa")
    dry = simulate_torchtitan(
        JOB,
        world_size=8,
        rank=0,
        n_layers=N_LAYERS,
        attention="sdpa",
        target_device="cpu",
        capture_stacks=False,
    )
    return measured, dry


def test_the_measured_step_is_torchtitans_with_sdpa_and_says_so(measured_and_dry):
    measured, dry = measured_and_dry
    for trace in (measured, dry):
        titan = trace.metadata["torchtitan"]
        assert (
            titan["attention"] == "ScaledDotProductAttention"
            and titan["activation_checkpoint"] == "SelectiveAC"
        )
        assert titan["loss"] == "ChunkedLossWrapper" and titan["optimizer_implementation"] == "fused"
        assert any(
            x.startswith("--attention sdpa: torchtitan's FlexAttention replaced") for x in trace.limitations
        )
    assert measured.metadata["mode"] == "measured" and dry.metadata["mode"] == "dry-run"
    assert "_scaled_dot_product_flash_attention_for_cpu" in {b.op for b in measured.blocks}


def test_measured_parameters_gradients_and_adamw_states_are_the_sharded_shapes(measured_and_dry):
    measured, _ = measured_and_dry
    # debug model: dim 256, fused QKV 768 x 256, FFN hidden 768, vocab 2048; FSDP2 rank 0 holds ceil(d0 / 8) rows
    layer = [(768, 256), (256, 256), (768, 256), (256, 768), (768, 256), (256,), (256,)]
    shapes = [(2048, 256), *layer * N_LAYERS, (256,), (2048, 256)]
    params = sum(math.ceil(s[0] / 8) * math.prod(s[1:]) * FP32 for s in shapes)
    after = hyperdryrun.build_report(measured)["summary"]["breakdown_after_step"]
    assert after["Parameter"] == params
    assert (
        after["Gradient"] == params
    )  # CUDA graphs on (the default): zero_grad(set_to_none=False) keeps them
    assert after["Optstate"] == 2 * params + FP32 * len(
        shapes
    )  # exp_avg, exp_avg_sq; fused: a step per param


def test_dry_run_equals_the_measured_step_per_category_and_peak(measured_and_dry):
    measured, dry = measured_and_dry
    host = host_blocks(measured)
    rng_state = torch.get_rng_state().numel()
    # per checkpointed layer one RNG state saved in its forward and one stashed while its recompute runs under the
    # saved one (torch.utils.checkpoint's fork_rng); and the 8-byte counter
    made = sorted((b.size, str(b.phase)) for b in host)
    assert made == sorted([(8, "forward")] + [(rng_state, "forward"), (rng_state, "backward")] * N_LAYERS), (
        made
    )
    scalars = cpu_scalar_blocks(measured)
    # one int64 1 and its float32 cast per step tensor (fused AdamW steps every parameter's scalar)
    assert sorted(b.size for b in scalars) == sorted([8, 4] * len(set(b.start for b in scalars)))
    assert len(scalars) == 2 * (7 * N_LAYERS + 3), len(scalars)
    left_out = {id(b) for b in [*host, *scalars, *kernel_scratch_blocks(measured)]}
    kept = [b for b in measured.blocks if id(b) not in left_out]
    steps = range(measured.num_tasks)
    totals = [live(kept, t) for t in steps]
    peak = max(totals)
    peak_task = totals.index(peak)
    print(f"\nmeasured {measured.peak:,} B; without host tensors {peak:,} B (dry run {dry.peak:,} B)")
    assert measured.initial == dry.initial
    assert peak == dry.peak
    assert by_category(kept, peak_task) == by_category(dry.blocks, dry.peak_task)
    dry_totals = [live(dry.blocks, t) for t in range(dry.num_tasks)]
    for phase in STEP_PHASES:
        sides = [
            [totals[t] for t in steps if measured.task_phase[t] is phase],
            [dry_totals[t] for t in range(dry.num_tasks) if dry.task_phase[t] is phase],
        ]
        assert max(sides[0], default=None) == max(sides[1], default=None), phase
    end = measured.num_tasks
    assert by_category(kept, end) == by_category(dry.blocks, dry.num_tasks)
    assert measured.current == dry.current


def test_a_flex_attention_job_cannot_be_measured_and_the_error_names_the_flag():
    with pytest.raises(MeasureError) as info:
        measure_torchtitan(JOB, world_size=8, rank=0, n_layers=1)
    message = str(info.value)
    assert message.startswith("--attention: torchtitan's FlexAttention has no backward on the CPU")
    assert "--attention sdpa" in message and "\n" not in message


def test_command_measure_writes_a_measured_report(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hyperdryrun.cli",
            "torchtitan",
            *JOB,
            "--n-layers",
            "1",
            "--attention",
            "sdpa",
        ]
        + ["--measure", "--no-stacks", "--output-dir", "out", "--quiet"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO) + ":" + str(REPO / "src")},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("measured peak ")
    report = json.loads((tmp_path / "out" / "rank_0" / "rank_0_memory.json").read_text())
    assert report["status"] == "ok" and report["metadata"]["mode"] == "measured"
    assert any("target_device=cuda was not executed" in x for x in report["limitations"])
    assert (tmp_path / "out" / "rank_0" / "rank_0_memory.csv").exists()
