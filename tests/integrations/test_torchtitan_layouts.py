"""torchtitan 0.3.0's 3D and 4D layouts through its own ``parallelize`` and ``pipelining_fn``: TP, CP and EP with
pipeline parallel. Each rank's parameter bytes are worked out from the layer shapes of its stage, divided by the
TP and FSDP shards; the 405B runs the 3D layout of torchtitan's 512-GPU run (FSDP 8 x TP 8 x PP 8)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install 'hyperdryrun[torchtitan]')"
)

import hyperdryrun  # noqa: E402
from hyperdryrun.integrations.torchtitan import TorchtitanError, simulate_torchtitan  # noqa: E402

FP32, STEP_SCALAR = 4, 512


def pp_args(pp: int, **degrees: int) -> list[str]:
    argv = ["--parallelism.pipeline_parallel_degree", str(pp), "--training.disable_cuda_graphs"]
    for name, degree in degrees.items():
        argv += [f"--parallelism.{name}_degree", str(degree)]
    return argv


def after_step(trace) -> dict[str, int]:
    return hyperdryrun.build_report(trace)["summary"]["breakdown_after_step"]


# torchtitan 0.3.0 llama3 405B: dim 16384, 128 heads of 128 (8 KV heads: fused wqkv 18432 rows), SwiGLU 53248,
# vocab 128256; FSDP2 shards dim 0 of each TP-local tensor, the norms are replicated over TP (sequence parallel).
DIM, QKV, FFN, VOCAB = 16384, (128 + 2 * 8) * 128, 53248, 128256


def shard_bytes(rows: int, cols: int, tp: int, fsdp: int) -> int:
    return rows // tp // fsdp * cols * FP32


def layer_bytes(tp: int, fsdp: int) -> int:
    mats = [(QKV, DIM), (DIM, DIM), (FFN, DIM), (FFN, DIM)]  # wqkv, wo (rowwise: dim 1 is split), w1, w3
    rowwise = [(DIM, FFN)]  # w2 splits its columns over tp; FSDP splits its rows
    return (
        sum(shard_bytes(r, c, tp, fsdp) for r, c in mats)
        + sum(r // fsdp * c // tp * FP32 for r, c in rowwise)
        + 2 * DIM // fsdp * FP32
    )


@pytest.mark.parametrize(
    "rank, stage, expected_params",
    [
        # 14 layers + embedding + head weighed one layer each: 2 per stage; stage 0 = tok_embeddings + layer 0
        (0, 0, shard_bytes(VOCAB, DIM, 8, 8) + layer_bytes(8, 8)),
        # pp is torchtitan's outermost mesh dim: ranks 448..511 hold stage 7 = layer 13 + norm + lm_head
        (448, 7, layer_bytes(8, 8) + DIM // 8 * FP32 + shard_bytes(VOCAB, DIM, 8, 8)),
    ],
    ids=["first-stage", "last-stage"],
)
def test_llama3_405b_3d_layout_stage_parameters(rank, stage, expected_params):
    """torchtitan's 405B config as written (float8 rowwise linears but the head, compile, async TP; its float8
    converter's SM check answered as the default target, an sm90 H100), FSDP 8 x TP 8 x PP 8 on 512 ranks, 1F1B
    over 8 micro batches, cut to 14 layers so that every stage holds torchtitan's own split of them. Float8Linear
    keeps nn.Linear's parameters: the same fp32 shards as bf16 linears."""
    argv = ["--module", "llama3", "--config", "llama3_405b"]
    argv += [*pp_args(8, data_parallel_shard=8), "--training.local_batch_size", "8"]
    trace = simulate_torchtitan(argv, world_size=512, rank=rank, n_layers=14, capture_stacks=False)
    pipeline = trace.metadata["pipeline"]
    assert pipeline["stage_indices"] == [stage] and pipeline["num_stages"] == 8
    assert trace.metadata["parallel"] | {} == {
        "dp_replicate": 1,
        "dp_shard": 8,
        "cp": 1,
        "tp": 8,
        "pp": 8,
        "ep": 1,
    }
    after = after_step(trace)
    assert after["Parameter"] == expected_params
    # fused AdamW: exp_avg and exp_avg_sq like each parameter shard, plus a device step scalar per parameter (7 a
    # layer; the embedding, or the norm and the head)
    assert trace.metadata["torchtitan"]["optimizer_implementation"] == "fused"
    assert after["Optstate"] == 2 * expected_params + STEP_SCALAR * (8 if stage == 0 else 9)
    assert any("async TP" in line for line in trace.limitations)
    # each stage holds one layer: wqkv, wo, w1, w2, w3 in float8 (the head is filtered out by the config)
    assert trace.metadata["torchtitan"]["quantization"] == {"Float8Linear": 5}


DEBUG = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "256"]
# llama3 debugmodel: dim 256, 16 heads of 16 (no GQA: wqkv 768 rows), SwiGLU 768, vocab 2048; pp 2 with 1F1B:
# 6 layers + 2 = 8 weighed, 4 a stage: stage 0 = tok_embeddings + layers 0-2, stage 1 = layers 3-5 + norm + lm_head
D_DIM, D_QKV, D_FFN, D_VOCAB = 256, 768, 768, 2048


def debug_layer(ways: int) -> int:
    """One debugmodel layer's fp32 parameter bytes sharded ``ways`` ways on dim 0 (512 B allocator rounding each:
    every shard here is a multiple of 512 B but the norms, 256 / ways x 4 B)."""
    mats = [(D_QKV, D_DIM), (D_DIM, D_DIM), (D_FFN, D_DIM), (D_DIM, D_FFN), (D_FFN, D_DIM)]
    norm = -(-(D_DIM // ways * FP32) // 512) * 512
    return sum(r // ways * c * FP32 for r, c in mats) + 2 * norm


@pytest.mark.parametrize("rank, stage", [(0, 0), (4, 1)], ids=["first-stage", "last-stage"])
def test_cp_with_pp_on_the_debugmodel(rank, stage):
    """pp 2 x FSDP 2 x CP 2, 1F1B over 8 micro batches: FSDP2 shards over dp_shard x cp (4 ways); each rank runs
    its stage on 128 of the 256 positions (the stage's static input shape is checked at run time)."""
    argv = [*DEBUG, *pp_args(2, data_parallel_shard=2, context_parallel=2)]
    argv += ["--parallelism.pipeline_parallel_schedule", "1F1B"]
    trace = simulate_torchtitan(argv, world_size=8, rank=rank, capture_stacks=False)
    assert trace.metadata["pipeline"]["stage_indices"] == [stage]
    ends = D_VOCAB // 4 * D_DIM * FP32 + (
        0 if stage == 0 else 512
    )  # embedding, or lm_head + norm (256 B -> 512)
    params = 3 * debug_layer(4) + ends
    assert after_step(trace)["Parameter"] == params


def test_ep_with_pp_on_deepseek_v3_debugmodel():
    """deepseek_v3's debug MoE, pp 2 x FSDP 4 x EP 2: the expert all-to-all's split sizes come from the routing
    rule (balanced: every EP rank routes its tokens alike)."""
    argv = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", "--training.seq_len", "256"]
    argv += pp_args(2, data_parallel_shard=4, expert_parallel=2)
    trace = simulate_torchtitan(argv, world_size=8, rank=4, capture_stacks=False)
    assert trace.metadata["parallel"]["ep"] == 2 and trace.metadata["pipeline"]["has_head"]
    assert "all_to_all_single" in " ".join(set(trace.task_op))


def test_refused_layouts_say_why_in_one_line(tmp_path):
    missing = str(tmp_path / "schedule.csv")
    argv = [*DEBUG, *pp_args(2, data_parallel_shard=2, tensor_parallel=2)]
    with pytest.raises(TorchtitanError) as info:
        simulate_torchtitan([*argv, "--parallelism.pipeline_parallel_schedule_csv", missing], world_size=8)
    assert str(info.value) == (
        "parallelism.pipeline_parallel_schedule_csv (--parallelism.pipeline_parallel_schedule_csv): no such file "
        f"(got {missing!r})"
    )


# torch 2.13's _PipelineScheduleRuntime._load_csv reads one row of compute actions per pp rank ("<stage>F<mb>",
# "<stage>B<mb>") and lowers them to sends and receives; torchtitan 0.3.0 builds that schedule for a CSV.
GPIPE_CSV = "0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"
CSV_JOB = [*DEBUG, *pp_args(2, data_parallel_shard=1), "--training.local_batch_size", "4"]


def csv_peak(extra: list[str]) -> int:
    return simulate_torchtitan([*CSV_JOB, *extra], world_size=2, rank=0, capture_stacks=False).peak


def test_a_schedule_csv_runs_its_order_of_actions(tmp_path):
    """Stage 0 running all four forwards before any backward (GPipe's order, written as a CSV) holds four micro
    batches' activations at once: its peak is GPipe's, above 1F1B's (which holds at most two on stage 0)."""
    path = tmp_path / "gpipe.csv"
    path.write_text(GPIPE_CSV)
    single = ["--parallelism.pipeline_parallel_schedule", "1F1B"]
    from_csv = csv_peak([*single, "--parallelism.pipeline_parallel_schedule_csv", str(path)])
    gpipe = csv_peak(["--parallelism.pipeline_parallel_schedule", "GPipe"])
    one_f_one_b = csv_peak(single)
    assert from_csv == gpipe > one_f_one_b
