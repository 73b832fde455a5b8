"""torchtitan's ``--compile.enable`` (per-block compile of the checkpointed blocks, and the loss) dry-run as torch
compiles it: llama3's FlexAttention blocks compile whole (the flex HOP lowered as Inductor's CUDA templates), nothing
runs eagerly, and the compiled step needs fewer bytes than the eager one for the reasons the report names."""

from __future__ import annotations

import re

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install 'hyperdryrun[torchtitan]')"
)

from hyperdryrun.integrations.torchtitan import simulate_torchtitan  # noqa: E402

DEBUG = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "512"]
DEBUG += ["--parallelism.data_parallel_shard_degree", "2"]


def run(*extra: str):
    return simulate_torchtitan([*DEBUG, *extra], world_size=2, rank=0, capture_stacks=False)


def test_llama3_compiled_blocks_compile_whole_and_need_fewer_bytes():
    eager, compiled = run(), run("--compile.enable")
    text = "\n".join(compiled.limitations)
    for eager_words in ("ran eagerly", "could not be compiled", "could not lower", "without torch.compile"):
        assert eager_words not in text
    blocks = re.search(r"torch.compile region FSDPCheckpointWrapper module: compiled by torch.*", text)
    loss = re.search(
        r"torch.compile region torchtitan.components.loss.cross_entropy_loss: compiled by torch", text
    )
    assert blocks and loss
    assert "flex_attention inside compiled regions lowered as Inductor's CUDA Triton templates" in text
    # the partitioner saves less for backward than the joint graph's forward values with no recomputation
    saved, unrecomputed = map(
        int, re.search(r"\((\d+) B; (\d+) B with no recomputation\)", blocks[0]).groups()
    )
    assert saved < unrecomputed
    assert compiled.peak < eager.peak


TP2 = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "512"]
TP2 += ["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--training.disable_cuda_graphs"]
# debugmodel: dim 256, local batch 8; TP 2 with sequence parallel: each rank holds 8 x 256 of the 512 positions.
# torch 2.13's CUDA kernels (torch/distributed/_symmetric_memory): an all-gather matmul gathers A = 8 x 512 x 256
# bf16 = 2,097,152 B (a temporary where the op does not return it), a matmul reduce-scatter stacks the partial
# products M x N = 4096 x 256 bf16 = 2,097,152 B; the workspace is the larger of the shard (1,048,576 B) and twice
# one rank's chunk of the partials (2 x 2,097,152 / 2 = 2,097,152 B).
GATHERED = PARTIALS = WORKSPACE = 2_097_152


def test_async_tp_fuses_the_tp_collectives_with_their_matmuls_as_the_cuda_kernels_allocate():
    def dry(*extra: str):
        return simulate_torchtitan(
            [*TP2, *extra], world_size=2, rank=0, capture_stacks=False, target_device="cuda"
        )

    import torch._inductor.fx_passes.post_grad as post_grad
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    before = (post_grad.micro_pipeline_tp_pass, dist.is_nccl_available, symm_mem.enable_symm_mem_for_group)
    plain, fused = dry(), dry("--compile.enable_async_tensor_parallel")
    again = dry("--compile.enable_async_tensor_parallel")
    assert again.peak == fused.peak
    line = next(line for line in fused.limitations if line.startswith("async TP: "))
    calls = dict(
        (op, int(n)) for op, n in re.findall(r"(fused_\w+) x(\d+)", line.split(" with the buffers")[0])
    )
    assert set(calls) == {"fused_all_gather_matmul", "fused_matmul_reduce_scatter"}
    assert f"kept after the step: 0: {WORKSPACE:,} B" in line
    assert not any(line.startswith("async TP: ") for line in plain.limitations)

    # the fused ops' outputs replace the unfused collectives' and matmuls'; what is new are the kernels'
    # temporaries, each of the hand-derived size and freed when its op returns
    def count(trace, op: str) -> int:
        return sum(b.op == op for b in trace.blocks)

    for collective, fused_op in (
        ("all_gather_into_tensor", "fused_all_gather_matmul"),
        ("reduce_scatter_tensor", "fused_matmul_reduce_scatter"),
    ):
        assert count(fused, collective) < count(plain, collective) and count(fused, fused_op) > 0
    extra = [b for b in fused.blocks if b.op == "empty"]
    extra_plain = [b for b in plain.blocks if b.op == "empty"]
    temporaries = len(extra) - len(extra_plain)
    assert calls["fused_matmul_reduce_scatter"] <= temporaries <= sum(calls.values())
    new = sorted(b.size for b in extra)
    for b in extra_plain:
        new.remove(b.size)
    assert set(new) == {GATHERED} == {PARTIALS}
    assert all(b.end is not None and b.end - b.start <= 2 for b in extra if b.size == GATHERED)
    # what the dry run patched for async TP is torch's again, and a second async-TP job in the process ran (above)
    assert (
        post_grad.micro_pipeline_tp_pass,
        dist.is_nccl_available,
        symm_mem.enable_symm_mem_for_group,
    ) == before
    assert not dist.is_nccl_available() and "0" not in symm_mem._group_name_to_store


def test_torchs_own_warnings_of_a_compiled_step_are_limitations_not_terminal_lines(tmp_path):
    """torchtitan's selective AC under compile makes dynamo log (torch._logging's warning_once, once a process:
    hence a process of its own) that context_fn is passed to checkpoint under torch.compile; a new user's terminal
    gets the report only, the report gets the warning."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    argv = [*DEBUG, "--compile.enable", "--output-dir", str(tmp_path / "out"), "--quiet"]
    done = subprocess.run(
        [sys.executable, "-m", "hyperdryrun", "torchtitan", "--world-size", "2", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "rank_0" / "rank_0_memory.json").read_text())
    assert any(
        line.startswith("warned during the simulated step (1 time): WARNING torch.")
        and "context_fn is passed to torch.utils.checkpoint under torch.compile" in line
        for line in report["limitations"]
    )
