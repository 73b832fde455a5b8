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
