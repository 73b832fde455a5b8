"""torchtitan 0.3.0's multimodal MoE families: qwen3_5 (Gated DeltaNet layers on fla's Triton kernels) dry-runs,
its measured step is refused in one line (fla's kernels need a GPU), and kimi_k2_7 is refused in one line naming
DistMuon on more than one rank (on one rank: test_torchtitan_kimi.py). Job: the debug MoE config, world 2, FSDP 2 x
EP 2, rank 0, local batch 2 x 64, ``--attention sdpa``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install 'hyperdryrun[torchtitan]')"
)

from hyperdryrun.integrations.torchtitan import load_config, simulate_torchtitan  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORLD, EP, BATCH, SEQ = 2, 2, 2, 64
TOKENS = BATCH * SEQ  # per rank: FSDP shards the batch, each rank runs its local batch
BF16, FP32 = 2, 4
QWEN35 = [
    *("--module", "qwen3_5", "--config", "qwen35_debugmodel_moe"),
    *("--parallelism.data_parallel_shard_degree", str(WORLD)),
    *("--parallelism.expert_parallel_degree", str(EP)),
    # the debug config's TP 2 x PP 2 need 8 ranks; the MoE tests' layout is FSDP x EP
    *("--parallelism.tensor_parallel_degree", "1", "--parallelism.pipeline_parallel_degree", "1"),
    "--training.disable_cuda_graphs",
    *("--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH)),
]
needs_fla = pytest.mark.skipif(
    importlib.util.find_spec("fla") is None, reason="fla (flash-linear-attention) is not installed"
)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hyperdryrun.cli", "torchtitan", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )


@pytest.fixture(scope="module")
def qwen35_dry():
    from fla.ops.common import chunk_o
    from triton.runtime.jit import KernelInterface

    launcher = KernelInterface.__dict__["__getitem__"]
    modules = {name: sys.modules.get(name) for name in ("torchvision", "torchvision.io")}
    shared_mem = chunk_o.check_shared_mem
    trace = simulate_torchtitan(QWEN35, world_size=WORLD, rank=0, attention="sdpa", capture_stacks=False)
    assert chunk_o.check_shared_mem is shared_mem
    return trace, launcher, modules


@needs_fla
def test_qwen35_deltanet_kernel_holds_the_tensors_fla_allocates_for_its_triton_kernels(qwen35_dry):
    """fla's chunk_gated_delta_rule (use_qk_l2norm_in_kernel=True) l2-normalizes q and k, each expanded to the value
    heads (torchtitan's GatedDeltaKernel repeat_interleaves them): a bf16 (tokens, value heads, key_head_dim) output
    and fp32 per-row rstd, both with torch.empty; the Triton kernels that fill them do not run."""
    trace, _, _ = qwen35_dry
    delta_net = load_config(QWEN35).model_spec.model.layers[0].delta_net
    key_dim, value_heads = (
        delta_net.key_head_dim,
        delta_net.in_proj_v.out_features // delta_net.value_head_dim,
    )
    made = [
        (b.op, b.size)
        for b in trace.blocks
        if b.module == "layers.0.attn.kernel" and str(b.phase) == "forward"
    ]
    assert made.count(("empty", TOKENS * value_heads * FP32)) == 2  # q_rstd, k_rstd
    assert made.count(("empty_like", TOKENS * value_heads * key_dim * BF16)) >= 2  # l2norm(q), l2norm(k)
    said = [x for x in trace.limitations if x.startswith("Gated DeltaNet layers [0, 1, 2]")]
    assert len(said) == 1 and "fla" in said[0]


@needs_fla
def test_qwen35_deltanet_gate_gradient_buffer_is_sized_for_a_hopper_tile(qwen35_dry):
    """fla's chunk_bwd_dqkwg allocates dg as ceil(key_head_dim / tile) fp32 copies of the gate (tokens x value
    heads); an H100's 232,448 B of shared memory give a 128-wide tile, so one copy for key_head_dim 64 (fla's own
    answer without a GPU, a 32-wide tile, would make two)."""
    trace, _, _ = qwen35_dry
    delta_net = load_config(QWEN35).model_spec.model.layers[0].delta_net
    assert delta_net.key_head_dim <= 128
    value_heads = delta_net.in_proj_v.out_features // delta_net.value_head_dim
    made = [
        b.size
        for b in trace.blocks
        if b.module == "layers.0.attn.kernel" and str(b.phase) == "backward" and b.op == "empty"
    ]
    assert TOKENS * value_heads * FP32 in made and 2 * TOKENS * value_heads * FP32 not in made


@needs_fla
def test_qwen35_dry_run_leaves_triton_and_sys_modules_as_they_were(qwen35_dry):
    from triton.runtime.jit import KernelInterface

    _, launcher, modules = qwen35_dry
    assert KernelInterface.__dict__["__getitem__"] is launcher
    assert {name: sys.modules.get(name) for name in modules} == modules
    if modules["torchvision"] is None:  # the stand-in is gone; torchtitan's data loader module keeps it
        assert importlib.util.find_spec("torchvision") is None
        image = sys.modules["torchtitan.hf_datasets.multimodal.utils.image"]
        assert isinstance(image.torchvision, types.ModuleType)


@needs_fla
def test_qwen35_measure_is_refused_in_one_line_naming_fla_s_kernel(tmp_path):
    done = cli(
        *QWEN35, f"--world-size={WORLD}", "--attention=sdpa", "--measure", "--output-dir", str(tmp_path)
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyperdryrun: error: ")
    assert "layers [0, 1, 2] are Gated DeltaNet" in lines[0]
    assert "fla.ops.gated_delta_rule.chunk_gated_delta_rule" in lines[0] and "Triton" in lines[0]


def test_kimi_k2_7_is_refused_in_one_line_naming_dist_muon(tmp_path):
    done = cli(
        *("--module", "kimi_k2_7", "--config", "kimi_k2_5_debugmodel", f"--world-size={WORLD}"),
        *(
            "--parallelism.data_parallel_shard_degree",
            str(WORLD),
            "--parallelism.expert_parallel_degree",
            str(EP),
        ),
        *("--training.seq_len", str(SEQ), "--output-dir", str(tmp_path)),
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyperdryrun: error: ")
    assert "--optimizer:" in lines[0] and "DistMuon" in lines[0] and "spmd_types" in lines[0]
    assert lines[0].endswith("on one rank (--world-size 1) it runs")
