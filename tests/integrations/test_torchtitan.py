"""torchtitan jobs as they are (torchtitan 0.3.0): its default attention (FlexAttention), optimizer container
(fused AdamW), selective activation checkpointing and chunked loss, world 8, FSDP 8, rank 0. Parameter, gradient
and optimizer-state bytes are worked out from the model shapes and the published parameter count."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install 'hyperdryrun[torchtitan]')"
)

import hyperdryrun  # noqa: E402
from hyperdryrun.integrations.torchtitan import TorchtitanError, simulate_torchtitan  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FSDP8 = ["--parallelism.data_parallel_shard_degree", "8"]
DEBUGMODEL = ["--module", "llama3", "--config", "llama3_debugmodel", *FSDP8]
PP2 = [  # torchtitan's debugmodel has 8 rows a batch: 8 pipeline micro batches of 1 row
    "--module",
    "llama3",
    "--config",
    "llama3_debugmodel",
    "--parallelism.data_parallel_shard_degree",
    "4",
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--training.disable_cuda_graphs",
]
FP32, STEP_SCALAR = 4, 512  # fused AdamW keeps state["step"] on the device: one 4-byte tensor, a 512 B block


def rank0_shard_bytes(shape: tuple[int, ...], ways: int = 8) -> int:
    """FSDP2 shards dim 0 in chunks of ceil(d0 / ways) rows; rank 0 holds the first; 512 B allocator rounding."""
    nbytes = math.ceil(shape[0] / ways) * math.prod(shape[1:]) * FP32
    return (nbytes + 511) // 512 * 512


def debugmodel_shapes() -> list[tuple[int, ...]]:
    """torchtitan 0.3.0 llama3 debugmodel: dim 256, 6 layers, 16 heads (no GQA: 16 KV heads, head_dim 16),
    SwiGLU hidden 768 (4 * 256 * 2/3 = 682, rounded up to a multiple of 256), vocab 2048, fused QKV."""
    dim, hidden, vocab, heads, kv_heads = 256, 768, 2048, 16, 16
    qkv = kv_heads * (heads // kv_heads + 2) * (dim // heads)
    layer = [(qkv, dim), (dim, dim), (hidden, dim), (dim, hidden), (hidden, dim), (dim,), (dim,)]
    return [(vocab, dim), *layer * 6, (dim,), (vocab, dim)]


@pytest.fixture(scope="module")
def debugmodel():
    trace = simulate_torchtitan(DEBUGMODEL, world_size=8, rank=0, capture_stacks=False)
    return trace, hyperdryrun.build_report(trace)


def test_debugmodel_runs_torchtitans_defaults(debugmodel):
    trace, report = debugmodel
    titan = report["metadata"]["torchtitan"]
    assert report["status"] == "ok" and report["metadata"]["parallel"]["dp_shard"] == 8
    assert titan["attention"] == "FlexAttention" and titan["activation_checkpoint"] == "SelectiveAC"
    assert titan["loss"] == "ChunkedLossWrapper" and titan["optimizer_implementation"] == "fused"
    assert titan["parameters"] == sum(math.prod(s) for s in debugmodel_shapes()) == 6_163_712
    ops = set(trace.task_op)
    assert {"create_block_mask", "flex_attention", "flex_attention_backward"} <= ops
    assert "recompute" in report["phases"]  # selective activation checkpointing recomputed in backward


def test_debugmodel_parameters_gradients_and_adamw_states(debugmodel):
    _, report = debugmodel
    shapes = debugmodel_shapes()
    params = sum(rank0_shard_bytes(s) for s in shapes)
    after = report["summary"]["breakdown_after_step"]
    assert after["Parameter"] == params
    # CUDA graphs on (torchtitan's default): zero_grad(set_to_none=False) keeps the sharded fp32 gradients
    assert after["Gradient"] == params
    # exp_avg and exp_avg_sq like each parameter shard, plus each parameter's device step scalar
    assert after["Optstate"] == 2 * params + STEP_SCALAR * len(shapes)


def test_llama3_8b_states_match_the_published_parameter_count():
    published, vocab, dim, n_layers = 8_030_261_248, 128_256, 4096, 32
    per_layer = (published - 2 * vocab * dim - dim) // n_layers
    two_layers = 2 * per_layer + 2 * vocab * dim + dim
    trace = simulate_torchtitan(
        ["--module", "llama3", "--config", "llama3_8b", *FSDP8],
        world_size=8,
        rank=0,
        n_layers=2,
        capture_stacks=False,
    )
    report = hyperdryrun.build_report(trace)
    after = report["summary"]["breakdown_after_step"]
    assert report["metadata"]["torchtitan"]["parameters"] == two_layers
    assert after["Parameter"] == FP32 * two_layers // 8  # every 8B shape divides by 8 into 512 B multiples
    assert after["Gradient"] == after["Parameter"]
    assert after["Optstate"] == 2 * after["Parameter"] + STEP_SCALAR * (
        2 * 7 + 3
    )  # 7 tensors a layer, 3 more
    assert any("cut to its first 2 of 32 layers" in x for x in report["limitations"])


def test_torchtitans_globals_are_restored(debugmodel):
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.protocols.module as titan_module
    import torchtitan.tools.utils as titan_utils

    assert (
        parallel_dims.device_type == titan_utils.device_type
    )  # patched to the simulation device only inside
    assert titan_module.Module._init_self_parameters.__qualname__ == "Module._init_self_parameters"
    assert logging.getLogger().level == logging.WARNING


def pipeline_globals() -> dict:
    """What a pipeline-parallel torchtitan job touches: the process group, torchtitan's stage class, torch's
    warm-up vote and every schedule's step."""
    import torch.distributed as dist
    import torchtitan.distributed.pipeline_parallel as titan_pp
    from torch.distributed.pipelining import schedules

    classes = [
        c
        for c in vars(schedules).values()
        if isinstance(c, type) and issubclass(c, schedules._PipelineSchedule)
    ]
    return {
        "pg": dist.is_initialized(),
        "stage": titan_pp.PipelineStage,
        "vote": schedules._PipelineSchedule.__dict__["_warmup_p2p"],
        "steps": {c.__name__: c.__dict__.get("step") for c in classes},
        "root_level": logging.getLogger().level,
    }


@pytest.mark.parametrize("fails", [False, True])
def test_a_pipeline_job_leaves_the_world_as_found(fails, monkeypatch):
    """torchtitan's debugmodel with its Interleaved1F1B schedule (2 stages a rank), pp 2 x FSDP 4, rank 0."""
    before = pipeline_globals()
    if fails:
        from torchtitan.trainer import Trainer

        def boom(*args, **kwargs):
            raise RuntimeError("boom inside the pipeline step")

        monkeypatch.setattr(Trainer, "post_dataloading_process", boom)
        with pytest.raises(hyperdryrun.SimulationError, match="boom inside the pipeline step"):
            simulate_torchtitan([*PP2, "--training.seq_len", "256"], world_size=8, n_layers=2)
    else:
        trace = simulate_torchtitan([*PP2, "--training.seq_len", "256"], world_size=8, n_layers=2)
        pipeline = trace.metadata["pipeline"]
        assert pipeline["schedule"] == "Interleaved1F1B" and pipeline["stage_indices"] == [0, 2]
        assert pipeline["num_micro_batches"] == 8 and trace.metadata["num_micro_batches"] == 8
        assert any("arg_mbs=" in line for line in trace.limitations)
    assert pipeline_globals() == before


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [*PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
            "activation_checkpoint (activation-checkpoint:selective): torch's selective activation checkpointing "
            "allows one backward per region and ZBVZeroBubble runs two (inputs, then weights)",
        ),
        (
            [*DEBUGMODEL, "--parallelism.spmd_backend", "spmd_types"],
            "parallelism.spmd_backend (--parallelism.spmd_backend): parallelism.spmd_backend='spmd_types' shards",
        ),
        (
            [*DEBUGMODEL, "--training.seq_len", "2047", "--parallelism.tensor_parallel_degree", "2"],
            "training.seq_len",
        ),
        (
            [*DEBUGMODEL, "--parallelism.pipeline_parallel_degree", "2"],
            "torchtitan rejected the arguments '--module llama3 --config llama3_debugmodel "
            "--parallelism.data_parallel_shard_degree 8 --parallelism.pipeline_parallel_degree 2': Error parsing "
            "Config: CUDA graphs do not support pipeline parallelism yet. Set --training.disable_cuda_graphs.",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_field(argv, message):
    with pytest.raises(TorchtitanError) as info:
        simulate_torchtitan(argv, world_size=16 if "--parallelism.tensor_parallel_degree" in argv else 8)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize("batch, mask", [(1, "documents"), (2, "documents"), (2, "sliding_window")])
def test_torchtitans_own_masks_give_only_the_block_mask_tensors(batch, mask):
    import torch
    from torch import nn
    from torch.nn.attention.flex_attention import and_masks
    from torchtitan.models.common import attention

    seq_len = 1024
    blocks = seq_len // 128  # torchtitan's default FlexAttention block size

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(8, 8)

        def forward(self, positions: torch.Tensor) -> torch.Tensor:
            if mask == "documents":  # torchtitan's Decoder._create_flex_attention_mask_for_document
                mods = [
                    attention.get_causal_mask_mod(),
                    attention.get_efficient_causal_mask_mod_for_packed_document(positions),
                ]
            else:
                mods = [attention.get_sliding_window_mask_mod(256)]
            attention.create_attention_mask(
                and_masks(*mods), batch, None, seq_len, seq_len, device=positions.device
            )
            return self.w(torch.ones(1, 8, device=positions.device)).sum()

    trace = hyperdryrun.simulate(
        Masked,
        lambda i, device: torch.arange(seq_len, device=device).remainder(300).repeat(batch, 1),
        loss_fn=lambda model, positions: model(positions),
        capture_stacks=False,
    )
    made = sorted(b.requested for b in trace.blocks if b.op == "create_block_mask")
    int32 = 4
    assert made == sorted([batch * blocks * int32, batch * blocks * blocks * int32] * 4)
    assert max(b.requested for b in trace.blocks) < batch * seq_len * seq_len  # no dense mask


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hyperdryrun.cli", "torchtitan", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO) + ":" + str(REPO / "src")},
    )


def test_command_runs_the_job_in_a_child_and_writes_the_reports(tmp_path):
    done = cli(*DEBUGMODEL, "--n-layers", "1", "--output-dir", "out", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("peak ") and done.stderr == ""
    report = json.loads((tmp_path / "out" / "rank_0" / "rank_0_memory.json").read_text())
    assert report["status"] == "ok" and report["metadata"]["world_size"] == 8  # from the parallelism degrees
    assert (tmp_path / "out" / "rank_0" / "rank_0_memory.csv").exists()


def test_a_native_crash_in_the_job_is_a_one_line_error_and_an_error_report(tmp_path):
    target = "tests.integrations._segfault_on_import.crash"  # torchtitan imports its override targets
    done = cli(*DEBUGMODEL, "--override.imports", target, "--output-dir", "out", cwd=tmp_path)
    assert done.returncode == 2
    path = tmp_path / "out" / "rank_0" / "rank_0_memory.json"
    assert done.stderr.strip().splitlines()[-1] == (
        "hyperdryrun: error: rank 0: the simulation process was killed by SIGSEGV (signal 11), a crash in native "
        "code that no Python code can catch (report: out/rank_0/rank_0_memory.json)"
    )
    report = json.loads(path.read_text())
    assert report["status"] == "error" and "SIGSEGV" in report["error"]["message"]
