"""Each block's allocation stream, as torch 2.13's FSDP2 chooses it on CUDA; the threads and streams that get a cuBLAS
workspace; the process groups a step communicates on.

Expected streams are read off torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: ``foreach_all_gather``
allocates the flat all-gather output under ``all_gather_copy_in_stream``; ``foreach_reduce`` allocates the
reduce-scatter input on the current stream and the reduce-scatter output under ``reduce_scatter_stream``. Sizes
follow from the parameter shapes: FSDP2 shards every parameter's dim 0 over the 2 ranks (no padding: 32, 8 rows).
"""

from __future__ import annotations

import csv
import io

import pytest
import torch
from torch.distributed.fsdp import fully_shard

from hyperdryrun import simulate
from hyperdryrun.report import blocks_csv
from hyperdryrun.trace.blocks import Phase
from hyperdryrun.trace.tracker import AUTOGRAD_THREAD, MAIN_THREAD
from hyperdryrun.world.streams import FSDP_STREAMS

FP32 = 4
LAYER0 = 32 * 16 + 32  # Linear(16, 32): weight and bias elements
LAYER1 = 8 * 32 + 8  # Linear(32, 8)
STREAM_IDS = {name: i + 1 for i, (_, name) in enumerate(FSDP_STREAMS)}
COPY_IN, REDUCE_SCATTER = STREAM_IDS["fsdp all-gather copy-in"], STREAM_IDS["fsdp reduce-scatter"]


def model_fn() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def fsdp_two_layers(model: torch.nn.Module, mesh) -> None:
    # reshard_after_forward=False: each layer is all-gathered once, in forward
    fully_shard(model[0], mesh=mesh, reshard_after_forward=False)
    fully_shard(model[2], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)  # the root holds no parameter of its own


def batch_fn(i: int, device: torch.device) -> torch.Tensor:
    return torch.randn(4, 16, device=device)


def loss_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


@pytest.fixture(scope="module")
def fsdp_trace():
    return simulate(model_fn, batch_fn, loss_fn=loss_fn, parallelize_fn=fsdp_two_layers, world_size=2)


def test_fsdp_streams_are_named_in_the_metadata(fsdp_trace):
    streams = {s["id"]: s["name"] for s in fsdp_trace.metadata["cuda"]["streams"]}
    assert streams == {0: "compute", **{i: name for name, i in STREAM_IDS.items()}}


def test_all_gather_outputs_are_allocated_on_the_copy_in_stream_one_per_layer(fsdp_trace):
    on_copy_in = [b for b in fsdp_trace.blocks if b.stream == COPY_IN]
    # the flat output holds every rank's shard: the layer's whole parameter numel, fp32
    assert [(b.requested, b.phase) for b in on_copy_in] == [
        (LAYER0 * FP32, Phase.FORWARD),
        (LAYER1 * FP32, Phase.FORWARD),
    ]


def test_reduce_scatter_outputs_are_on_the_reduce_scatter_stream_and_inputs_on_the_compute_stream(fsdp_trace):
    outputs = [b for b in fsdp_trace.blocks if b.stream == REDUCE_SCATTER]
    # backward runs layer 1 first; each output is this rank's shard of the fp32 gradient
    assert [(b.requested, b.phase) for b in outputs] == [
        (LAYER1 * FP32 // 2, Phase.BACKWARD),
        (LAYER0 * FP32 // 2, Phase.BACKWARD),
    ]
    # each reduce-scatter input (the whole unsharded gradient) is allocated just before its output, on stream 0
    for out, numel in zip(outputs, (LAYER1, LAYER0), strict=True):
        inputs = [b for b in fsdp_trace.blocks if b.start < out.start and b.requested == numel * FP32]
        assert inputs and inputs[-1].stream == 0 and inputs[-1].phase is Phase.BACKWARD


def test_nothing_else_is_allocated_on_a_side_stream(fsdp_trace):
    side = [b for b in fsdp_trace.blocks if b.stream != 0]
    assert len(side) == 4  # two all-gather outputs, two reduce-scatter outputs
    assert {b.stream for b in side} == {COPY_IN, REDUCE_SCATTER}


def test_the_csv_carries_the_stream_of_each_block(fsdp_trace):
    rows = list(csv.DictReader(io.StringIO(blocks_csv(fsdp_trace))))
    assert [int(r["stream_id"]) for r in rows] == [b.stream for b in fsdp_trace.blocks]


def test_a_cpu_target_puts_every_block_on_stream_0():
    trace = simulate(
        model_fn, batch_fn, loss_fn=loss_fn, parallelize_fn=fsdp_two_layers, world_size=2, target_device="cpu"
    )
    assert {b.stream for b in trace.blocks} == {0}
    assert "cuda" not in trace.metadata
    assert {r["stream_id"] for r in csv.DictReader(io.StringIO(blocks_csv(trace)))} == {"0"}


def test_cublas_workspaces_go_to_the_forward_and_the_autograd_thread_at_their_first_matmul(fsdp_trace):
    handles = fsdp_trace.metadata["cuda"]["cublas_workspace"]["handles"]
    assert [(h["thread"], h["stream"]) for h in handles] == [(MAIN_THREAD, 0), (AUTOGRAD_THREAD, 0)]
    fw, bw = (h["first_task"] for h in handles)
    # the first matmul of the step is layer 0's addmm; the first of backward is layer 1's input-gradient mm
    assert fsdp_trace.task_op[fw] == "addmm" and fsdp_trace.task_phase[fw] is Phase.FORWARD
    assert fsdp_trace.task_op[bw] == "mm" and fsdp_trace.task_phase[bw] is Phase.BACKWARD
    matmuls = ("mm", "addmm")
    assert all(op not in matmuls for op in fsdp_trace.task_op[:fw])
    assert all(
        not (op in matmuls and phase is Phase.BACKWARD)
        for op, phase in zip(fsdp_trace.task_op[:bw], fsdp_trace.task_phase[:bw], strict=True)
    )
    ws = fsdp_trace.metadata["cuda"]["cublas_workspace"]
    assert ws["bytes_per_handle"] == 32 * 2**20  # the default GPU is an sm90 H100
    assert ws["bytes"] == 2 * 32 * 2**20


def test_record_stream_holds_the_block_for_the_stream_it_names():
    side = {}

    def step_fn(model, optimizer, batches):
        for x in batches:
            s = torch.cpu.Stream()  # what torch.cuda.Stream is to a CUDA job, on the simulation device
            with torch.cpu.stream(s):
                y = x * 2  # allocated on the side stream
            z = x + 1  # on the compute stream, then used on the side stream
            z.record_stream(s)
            side["y"], side["z"] = y, z
            del y, z

    trace = simulate(model_fn, batch_fn, step_fn=step_fn, world_size=1)
    streams = {s["name"]: s["id"] for s in trace.metadata["cuda"]["streams"]}
    sid = streams["stream 1"]
    mul = [b for b in trace.blocks if b.op == "mul"]
    add = [b for b in trace.blocks if b.op == "add"]
    assert [b.stream for b in mul] == [sid] and mul[0].use_streams == frozenset()
    assert [b.stream for b in add] == [0] and add[0].use_streams == frozenset({sid})


def test_a_step_communicates_on_its_mesh_groups_only():
    from hyperdryrun.config import build_config
    from hyperdryrun.recipe import run_job

    cfg = build_config(
        {
            "model": {"name": "llama-tiny"},
            "training": {"seq_len": 32},
            "world": {"world_size": 4},
            "parallel": {"tp": 2},
        }
    )
    comms = run_job(cfg, capture_stacks=False).metadata["cuda"]["nccl"]["communicators"]
    # FSDP over dp_shard (2 ranks) and TP over tp (2 ranks): one communicator each, of two ranks
    assert sorted(c["description"] for c in comms) == ["mesh_dp_shard", "mesh_tp"]
    per_comm = (
        16 * 2 * (4 * 2**20 + 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8)
    )  # channels x ring x (Simple+LL+LL128)
    assert [(c["size"], c["bytes"]) for c in comms] == [(2, per_comm), (2, per_comm)]
