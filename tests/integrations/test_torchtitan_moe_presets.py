"""The built-in qwen3-moe-debug and deepseek-v3-debug presets against torchtitan 0.3.0's own ``--module qwen3
--config qwen3_moe_debug`` (its ``debugmodel_moe``: 8 MoE layers, 64 experts, top 8, GQA) and ``--module deepseek_v3
--config deepseek_v3_debugmodel`` (6 layers, the first dense, MLA, 8 routed experts, top 3, 2 shared) on the same
layout, seq 4096, rank 0: every category at the peak but activations (and torchtitan's position tensor) is equal to
the byte, the rest is derived; the peaks agree within 0.1% except deepseek-v3-debug under op SAC (0.17%: 5 x
261,120 B of FlexAttention's logsumexp on a 0.8 GB peak, a difference of attention kernels the 0.1% bar cannot
absorb on a model this small; it is derived to the byte below instead).

Both sides run the same job: torchtitan's chunked loss is ``--loss chunked``, its fused AdamW ``--optimizer-impl
fused``, torchtitan runs with ``--training.disable_cuda_graphs``. The router's gate runs under
``torch.autocast(<device>, float32)`` on both sides, CUDA's fp32 region on this CUDA target (no CPU-autocast warning
in either report), and the routed path keeps torchtitan's tensor lifetimes (its token dispatcher: the experts' output
held until the combine returns, the output buffer made before the fp32 score product, the boolean routing map held
by the MoE's forward). Those lifetimes decide where the peak falls: deepseek-v3-debug under op SAC peaks in the last
layer's recompute, at the combine's fp32 score product, on both sides. What remains is the attention kernel,
torchtitan's FlexAttention against the built-in's SDPA (cuDNN on the default H100 kernels), and the tensors
FlexAttention's document masking needs. Each case states the exact byte difference it measured, derived below."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install 'hyperdryrun[torchtitan]')"
)

from hyperdryrun.config import build_config  # noqa: E402
from hyperdryrun.integrations.torchtitan import simulate_torchtitan  # noqa: E402
from hyperdryrun.recipe import run_job  # noqa: E402
from hyperdryrun.report.build import alive_at, breakdown  # noqa: E402

SEQ, HEADS = 4096, 16
LSE = HEADS * SEQ * 4
"""FlexAttention's logsumexp, fp32 (batch 1, 16 heads, 4096 positions): 262,144 B, saved once more per layer than
cuDNN's stats under the op SAC policy."""
PHILOX = 2 * 512
"""cuDNN SDPA's philox seed and offset (two 512 B blocks per layer) that FlexAttention does not make."""
FLEX_INPUTS = 4 * 512 + 4 * 4096 + 16_896 + 16_384 + 512
"""Alive on torchtitan's side for the whole step: the BlockMask (32 x 32 blocks of 128: four int32 count tensors
of 128 B and four int32 index tensors of 4,096 B), the document mask_mod's int32 [1, 4097] (16,388 B, 16,896
allocated) and int32 [1, 4096], and the valid-token all-reduce's scalar (the built-in's loss division scalar stands
for torchtitan's loss addition scalar)."""
POSITIONS = SEQ * 8
"""torchtitan's int64 positions [1, 4096], created outside any module (category Other)."""


def titan_trace(module: str, config: str, world: int, ep: int, ac: str):
    argv = ["--module", module, "--config", config, "--training.seq_len", str(SEQ)]
    argv += ["--training.local_batch_size", "1", "--training.disable_cuda_graphs"]
    argv += ["--parallelism.data_parallel_shard_degree", str(world)]
    argv += ["--parallelism.expert_parallel_degree", str(ep), f"activation-checkpoint:{ac}"]
    return simulate_torchtitan(argv, world_size=world, capture_stacks=False)


def builtin_trace(preset: str, world: int, ep: int, ac: str):
    cfg = build_config(
        {
            "model": {"name": preset},
            "world": {"world_size": world},
            "parallel": {"dp_shard": world, "ep": ep},
            "training": {"seq_len": SEQ, "loss": "chunked", "optimizer_impl": "fused", "ac": ac},
        }
    )
    return run_job(cfg, capture_stacks=False)


def at_peak(trace) -> dict[str, int]:
    return breakdown(alive_at(trace.blocks, trace.peak_task))


QWEN3 = ("qwen3", "qwen3_moe_debug", "qwen3-moe-debug")
DEEPSEEK = ("deepseek_v3", "deepseek_v3_debugmodel", "deepseek-v3-debug")


@pytest.mark.parametrize(
    "model, world, ep, ac, saved_layers, cudnn_layers, within",
    [
        # No AC, peak in the last layer's (7) backward of the score product: the same saved bytes per layer but
        # cuDNN's philox pair, in all 8 layers. 4,836,098,048 vs 4,836,021,248 B (76,800 B, 0.0016%).
        pytest.param(QWEN3, 2, 2, "none", 0, 8, 1000, id="qwen3-fsdp2-ep2-no-ac"),
        # Op SAC, peak in layer 6's backward of the score product (layer 7 is done): layers 0-5 hold
        # FlexAttention's extra logsumexp, layer 6 (recomputed) the same bytes but cuDNN's philox pair. Experts:
        # EP 2, unsharded by FSDP2 (efsdp 1), or sharded over efsdp 2 in the block's unit while the rest is sharded
        # over 4. 3,103,149,056 vs 3,101,498,368 B and 2,153,777,664 vs 2,152,126,976 B (1,650,688 B each).
        pytest.param(QWEN3, 2, 2, "selective", 6, 1, 1000, id="qwen3-fsdp2-ep2-op-sac"),
        pytest.param(QWEN3, 4, 2, "selective", 6, 1, 1000, id="qwen3-fsdp4-ep2-op-sac"),
        # No EP (torchtitan's LocalTokenDispatcher): the peak comes earlier in backward, in layer 1's: layer 0
        # holds FlexAttention's extra logsumexp, layer 1 (recomputed) cuDNN's philox pair. 3,216,956,928 vs
        # 3,216,611,840 B (345,088 B, 0.011%).
        pytest.param(QWEN3, 2, 1, "selective", 1, 1, 1000, id="qwen3-fsdp2-op-sac"),
        # MLA (q_lora_rank 0: one wq), a dense first layer, two shared experts, a complex RoPE table per layer.
        # No AC, peak in the last layer's (5) backward: 1,324,380,160 vs 1,324,301,312 B (78,848 B, 0.006%).
        pytest.param(DEEPSEEK, 2, 2, "none", 0, 6, 1000, id="deepseek-fsdp2-ep2-no-ac"),
        # Op SAC, peak in the last layer's (5) recompute at the combine's fp32 score product (the fp32 gate made
        # it higher than that layer's backward, by 1,393,664 B on both sides): layers 0-4 hold FlexAttention's
        # extra logsumexp, layer 5 cuDNN's philox pair. 812,357,632 vs 810,968,064 B (1,389,568 B, 0.17%).
        pytest.param(DEEPSEEK, 4, 2, "selective", 5, 1, 500, id="deepseek-fsdp4-ep2-op-sac"),
    ],
)
def test_builtin_moe_preset_equals_torchtitans_moe_model(
    model, world, ep, ac, saved_layers, cudnn_layers, within
):
    module, config, preset = model
    titan, builtin = titan_trace(module, config, world, ep, ac), builtin_trace(preset, world, ep, ac)
    t, b = at_peak(titan), at_peak(builtin)
    for trace in (titan, builtin):
        assert not [line for line in trace.limitations if "In CPU autocast" in line], trace.limitations
    for category in ("Parameter", "Buffer", "Gradient", "Optstate", "Temp"):
        assert t.get(category, 0) == b.get(category, 0), (category, t, b)
    activations = saved_layers * (LSE - PHILOX) - cudnn_layers * PHILOX + FLEX_INPUTS
    assert t["Activation"] - b["Activation"] == activations, (t, b)
    assert t["Other"] - b["Other"] == POSITIONS, (t, b)
    assert titan.peak - builtin.peak == activations + POSITIONS, (titan.peak, builtin.peak)
    assert abs(titan.peak - builtin.peak) <= titan.peak // within


def test_with_the_same_attention_kernel_the_deepseek_op_sac_case_is_within_0_1_percent():
    """The one case over 0.1% (deepseek-v3-debug, FSDP 4 x EP 2, op SAC: 0.17%) is all attention kernel: with
    torchtitan's inner attention swapped for the built-in's SDPA (``--attention sdpa``), every category at the peak
    is equal but torchtitan's positions (Other, 32,768 B) and the valid-token all-reduce's 512 B scalar (its loss
    addition scalar stands for the built-in's loss division one): 33,280 B on an 0.8 GB peak."""
    argv = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", "--training.seq_len", str(SEQ)]
    argv += ["--training.local_batch_size", "1", "--training.disable_cuda_graphs"]
    argv += ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.expert_parallel_degree", "2"]
    titan = simulate_torchtitan(
        [*argv, "activation-checkpoint:selective"], world_size=4, capture_stacks=False, attention="sdpa"
    )
    builtin = builtin_trace("deepseek-v3-debug", 4, 2, "selective")
    t, b = at_peak(titan), at_peak(builtin)
    for category in ("Parameter", "Buffer", "Gradient", "Optstate", "Temp"):
        assert t.get(category, 0) == b.get(category, 0), (category, t, b)
    assert (t["Activation"] - b["Activation"], t["Other"] - b["Other"]) == (512, POSITIONS)
    assert titan.peak - builtin.peak == 512 + POSITIONS
    assert titan.peak - builtin.peak <= titan.peak // 1000


def small_job(model: dict, fsdp_wrap: str | None = None):
    parallel = {"dp_shard": 2, "ep": 2, **({"fsdp_wrap": fsdp_wrap} if fsdp_wrap else {})}
    cfg = build_config(
        {
            "model": {"name": "qwen3-moe-debug", **model},
            "world": {"world_size": 2},
            "parallel": parallel,
            "training": {"seq_len": 512, "optimizer_impl": "fused"},
        }
    )
    return run_job(cfg, capture_stacks=False)


def buffer_bytes(trace) -> int:
    return sum(blk.size for blk in trace.blocks if str(blk.category) == "Buffer")


def test_old_moe_structure_stays_selectable():
    """--no-fuse-qkv, --rope shared, --moe-impl torchtitan-2024 and --fsdp-wrap torchtitan-2024 give the earlier
    model: three projections and one RoPE table (no per-layer buffers, no load-balancing buffers); the default is
    torchtitan 0.3.0's, whose buffers are a cos|sin table per attention and two fp32 counters per MoE layer."""
    new = small_job({})
    assert (new.metadata["fuse_qkv"], new.metadata["rope"], new.metadata["moe_impl"]) == (
        True,
        "per-layer",
        "torchtitan",
    )
    assert new.metadata["fsdp_wrap"] == "torchtitan"
    # 8 layers x (fp32 [512, 2 x 128] cos|sin table + expert_bias and tokens_per_expert, fp32 [64] each: 512 B).
    assert buffer_bytes(new) == 8 * (512 * 256 * 4 + 2 * 512)
    old = small_job({"fuse_qkv": False, "rope": "shared", "moe_impl": "torchtitan-2024"}, "torchtitan-2024")
    meta = old.metadata
    assert (meta["fuse_qkv"], meta["rope"], meta["moe_impl"], meta["fsdp_wrap"]) == (
        False,
        "shared",
        "torchtitan-2024",
        "torchtitan-2024",
    )
    # One complex RoPE table of 512 rows x 64 pairs (8 B each) for the model, nothing else buffered.
    assert buffer_bytes(old) == 512 * 64 * 8
