"""Context parallel: torch 2.13's ring attention over the "cp" mesh, in torchtitan's llama3 recipe.

Expected bytes come from the llama-tiny shapes (dim 64, 4 heads of 16, 2 KV heads, vocab 256, 2 layers), the
micro batch (1 x 64 tokens) and the dtypes (bf16 compute under FSDP2 mixed precision, fp32 logsumexp and ring
accumulation, int64 tokens), never from the code under test.

"Attention activations" are the blocks that the attention modules (``layers.N.attention`` and its projections)
allocate in the forward and still hold when backward starts, i.e. what the attention saves for backward: the
rotated q and k, v, the attention output and its logsumexp, and cuDNN's two int64 philox scalars.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from hyperdryrun.config import ConfigError
from hyperdryrun.trace.blocks import Category, Phase
from tests.conftest import dry_run, job

B, S, DIM, H, HKV, HD, VOCAB, LAYERS = 1, 64, 64, 4, 2, 16, 256, 2
BF16, FP32, INT64 = 2, 4, 8
_ATTENTION = re.compile(r"layers\.\d+\.attention($|\.)")


def _run(cp: int, rank: int = 0, world: int | None = None, **over):
    return dry_run(world__world_size=world or cp, world__rank=rank, parallel__cp=cp, **over)


def _saved_by_attention(trace) -> list:
    """Attention blocks allocated in the forward and alive when the backward starts."""
    first_backward = trace.task_phase.index(Phase.BACKWARD)
    return [
        b
        for b in trace.blocks
        if b.phase == Phase.FORWARD and _ATTENTION.match(b.module) and b.start < first_backward <= b.end
    ]


def _qkv_lse(blocks) -> int:
    """The saved q, k, v and logsumexp, by the ops that produce them: q and k the RoPE's bf16 casts back
    (``_to_copy``), v the contiguous copy of the fused wqkv split (a ``clone`` made before the layer's RoPE runs;
    a later clone is the attention output's transposed copy), the logsumexp the kernel's or the ring's."""
    lse_ops = ("_scaled_dot_product_cudnn_attention", "cat", "sub")
    rope_start = {}
    for b in blocks:
        if b.module.endswith(".rope"):
            layer = b.module.removesuffix(".rope")
            rope_start[layer] = min(rope_start.get(layer, b.start), b.start)
    total = 0
    for b in blocks:
        v_copy = b.op == "clone" and b.start < rope_start[b.module]
        if (
            (b.op == "_to_copy" and b.module.endswith(".rope"))
            or v_copy
            or (b.op in lse_ops and b.requested % (H * FP32) == 0 and b.requested < 2048)
        ):
            total += b.requested
    return total


def _expected_saved(seq: int) -> int:
    """q, k, v, out in bf16, logsumexp in fp32, two int64 philox scalars and the layer's RoPE rows (complex64,
    gathered per layer as torchtitan 0.3.0 does, saved by the rotation), per layer, for ``seq`` local tokens."""
    q, kv, out, lse = seq * H * HD * BF16, seq * HKV * HD * BF16, seq * H * HD * BF16, H * seq * FP32
    rope = seq * (HD // 2) * 2 * FP32
    return LAYERS * (q + 2 * kv + out + lse + 2 * INT64 + rope)


@pytest.fixture(scope="module")
def traces():
    """CP=1 (FSDP over 2 ranks, full sequence each) and both ranks of CP=2 (same world, half the sequence each)."""
    return {
        "cp1": _run(1, world=2),
        "cp2_rank0": _run(2, rank=0),
        "cp2_rank1": _run(2, rank=1),
    }


# ------------------------------------------------------------------------------------ attention activations
def test_cp1_attention_activations_match_the_shapes(traces):
    saved = _saved_by_attention(traces["cp1"])
    assert sum(b.requested for b in saved) == _expected_saved(S) == 59424


@pytest.mark.parametrize("rank", [0, 1])
def test_cp2_halves_the_saved_q_k_v_and_logsumexp(traces, rank):
    cp1 = _qkv_lse(_saved_by_attention(traces["cp1"]))
    cp2 = _qkv_lse(_saved_by_attention(traces[f"cp2_rank{rank}"]))
    per_token = (H + 2 * HKV) * HD * BF16 + H * FP32
    assert cp1 == LAYERS * S * per_token
    assert cp2 == LAYERS * (S // 2) * per_token == cp1 // 2


def test_cp2_last_rank_halves_the_attention_activations(traces):
    cp1 = sum(b.requested for b in _saved_by_attention(traces["cp1"]))
    last = sum(b.requested for b in _saved_by_attention(traces["cp2_rank1"]))
    assert last == _expected_saved(S // 2)
    assert abs(last / cp1 - 0.5) <= 0.05 * 0.5


def test_cp2_first_rank_also_keeps_a_transposed_copy_of_the_ring_output(traces):
    # On every CP rank but the last, torch's ring merges a partial step with torch.cat, so the output is contiguous
    # in (b, h, s, d); the model's out.transpose(1, 2).contiguous() then copies it (cuDNN's own output is laid out
    # as (b, s, h, d), where that transpose is free). Both are saved: the output by SDPA, the copy by wo.
    first = sum(b.requested for b in _saved_by_attention(traces["cp2_rank0"]))
    assert first == _expected_saved(S // 2) + LAYERS * (S // 2) * H * HD * BF16


# ------------------------------------------------------------------------------------ sequence shards
@pytest.mark.parametrize("rank", [0, 1])
def test_hidden_states_and_logits_are_sequence_shards(traces, rank):
    trace = traces[f"cp2_rank{rank}"]
    embedding = [b for b in trace.blocks if b.module == "tok_embeddings" and b.op == "embedding"]
    logits = [b for b in trace.blocks if b.module == "output" and b.op == "mm" and b.phase == Phase.FORWARD]
    assert [b.requested for b in embedding] == [B * S * DIM * BF16 // 2]
    assert [b.requested for b in logits] == [B * S * VOCAB * BF16 // 2]


def test_batch_and_rope_buffer_are_sharded_with_the_load_balancer(traces):
    blocks = [b for b in traces["cp2_rank0"].blocks if b.phase == Phase.FORWARD and b.module == ""]
    # The loaded micro batch (tokens and labels) is whole; torch's context_parallel gathers both into the head-tail
    # order and each rank keeps a copy of its half, alive for the step (the context's generator frame holds it).
    assert [b.requested for b in blocks if b.op == "randint"] == [B * S * INT64] * 2
    assert [b.requested for b in blocks if b.op == "gather"] == [B * S * INT64] * 2
    rope_row = HD // 2 * 8  # complex64 rotations per position
    # one RoPE table per layer (torchtitan 0.3.0), each reordered and sharded like the batch
    assert [b.requested for b in blocks if b.op == "index_select"] == [S * rope_row] * LAYERS
    kept = [b.requested for b in blocks if b.op == "clone" and b.end == max(x.end for x in blocks)]
    # Held by context_parallel's frame until it exits: each RoPE buffer's restore copy (whole), the list of shards
    # (tokens, labels, every layer's RoPE) and the loop's last ``shard.clone()`` (the last RoPE's); the buffers
    # were resized in place.
    half_batch, half_rope = B * S // 2 * INT64, S // 2 * rope_row
    expected = [S * rope_row] * LAYERS + [half_batch] * 2 + [half_rope] * LAYERS + [half_rope]
    assert sorted(kept) == sorted(expected)


def test_torch_default_for_causal_sdpa_is_head_tail_load_balancing():
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _create_default_load_balancer,
        _HeadTailLoadBalancer,
    )

    balancer = _create_default_load_balancer(16, 2, "cpu")
    assert isinstance(balancer, _HeadTailLoadBalancer)
    order = balancer._generate_indices()[0].tolist()
    # rank 0 keeps chunks 0 and 3 of 4, rank 1 chunks 1 and 2
    assert order == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]


# ------------------------------------------------------------------------------------ ring buffers
def _ring_blocks(trace, op: str, phase: Phase) -> list[int]:
    return [
        b.requested for b in trace.blocks if b.op == op and b.phase == phase and _ATTENTION.match(b.module)
    ]


@pytest.mark.parametrize("cp", [2, 4])
def test_allgather_ring_exchanges_kv_and_kv_gradients(cp):
    trace = _run(cp)
    local_kv = 2 * (S // cp) * HKV * HD  # k and v elements of this rank's shard
    # forward: one all-gather of every rank's k and v per layer
    assert _ring_blocks(trace, "all_gather_into_tensor", Phase.FORWARD) == [cp * local_kv * BF16] * LAYERS
    # backward: the same all-gather, and cp all-to-all rotations of the fp32 k/v gradients per layer
    assert _ring_blocks(trace, "all_gather_into_tensor", Phase.BACKWARD) == [cp * local_kv * BF16] * LAYERS
    assert _ring_blocks(trace, "all_to_all_single", Phase.BACKWARD) == [local_kv * FP32] * (cp * LAYERS)
    assert _ring_blocks(trace, "all_to_all_single", Phase.FORWARD) == []


def test_alltoall_ring_passes_kv_to_the_next_rank_each_step():
    cp = 4
    trace = _run(cp, parallel__cp_rotate_method="alltoall")
    local_kv = 2 * (S // cp) * HKV * HD
    assert _ring_blocks(trace, "all_gather_into_tensor", Phase.FORWARD) == []
    assert _ring_blocks(trace, "all_to_all_single", Phase.FORWARD) == [local_kv * BF16] * ((cp - 1) * LAYERS)
    backward = sorted(_ring_blocks(trace, "all_to_all_single", Phase.BACKWARD))
    assert backward == sorted([local_kv * BF16] * ((cp - 1) * LAYERS) + [local_kv * FP32] * (cp * LAYERS))


def test_each_micro_batch_runs_its_own_ring():
    trace = _run(2, training__num_micro_batches=2)
    gathers = [b for b in trace.blocks if b.op == "all_gather_into_tensor" and b.phase == Phase.FORWARD]
    gathers = [b for b in gathers if _ATTENTION.match(b.module)]
    assert sorted(b.micro_batch for b in gathers) == [0] * LAYERS + [1] * LAYERS
    # the RoPE buffers (one per layer) are restored between micro batches: the second one shards them whole again
    rope = [b for b in trace.blocks if b.op == "index_select" and b.phase == Phase.FORWARD]
    assert [b.requested for b in rope] == [S * HD // 2 * 8] * (2 * LAYERS)


def test_ring_buffers_are_collective_outputs_freed_within_the_layer():
    trace = _run(2)
    gathers = [b for b in trace.blocks if b.op == "all_gather_into_tensor" and _ATTENTION.match(b.module)]
    assert gathers and all(b.end < trace.num_tasks for b in gathers)
    assert all(b.category in (Category.ACTIVATION, Category.TEMP) for b in gathers)


# ------------------------------------------------------------------------------------ combinations
def test_fsdp_shards_parameters_over_dp_shard_and_cp_together():
    from hyperdryrun.models.llama import PRESETS

    n = PRESETS["llama-tiny"].num_params()
    trace = _run(2, world=4, parallel__dp_shard=2)
    params = sum(
        b.requested
        for b in trace.blocks
        if b.phase == Phase.INITIALIZATION and b.category == Category.PARAMETER
    )
    assert params == n * FP32 // 4
    assert trace.metadata["context_parallel"]["fsdp_mesh"] == "dp_shard_cp"
    assert trace.metadata["fsdp"] is True


def test_cp_without_data_parallel_still_shards_parameters_over_cp():
    from hyperdryrun.models.llama import PRESETS

    # bf16 storage and no mixed precision: FSDP2 is there only because cp ranks share the parameters
    trace = _run(2, training__dtype="bf16", training__param_dtype=None, training__reduce_dtype=None)
    params = sum(
        b.requested
        for b in trace.blocks
        if b.phase == Phase.INITIALIZATION and b.category == Category.PARAMETER
    )
    assert params == PRESETS["llama-tiny"].num_params() * BF16 // 2
    assert trace.metadata["fsdp"] is True


def test_cp_with_tensor_parallel_shards_heads_and_sequence():
    trace = _run(2, world=4, parallel__tp=2)
    s, tp = S // 2, 2
    saved = _saved_by_attention(trace)
    # q after RoPE (bf16): local heads H / tp, local sequence S / cp
    assert [b.requested for b in saved if b.op == "_to_copy"].count(s * H // tp * HD * BF16) == LAYERS
    # per layer: the ring's all-gather of k and v (local KV heads), and sequence parallel's all-gather of the
    # attention input over tp (the cp shard of the sequence, full dim), which happen to be the same size here
    ring, sp = S * HKV // tp * HD * 2 * BF16, B * s * DIM * BF16
    assert _ring_blocks(trace, "all_gather_into_tensor", Phase.FORWARD) == [sp, ring] * LAYERS


def test_fp32_multi_head_attention_runs_the_memory_efficient_ring():
    trace = _run(
        2, model__n_kv_heads=H, training__seq_len=128, training__param_dtype=None, training__reduce_dtype=None
    )
    local_kv = 2 * 64 * H * HD
    assert _ring_blocks(trace, "all_gather_into_tensor", Phase.FORWARD) == [2 * local_kv * FP32] * LAYERS
    ops = {b.op for b in trace.blocks if _ATTENTION.match(b.module)}
    assert (
        "_scaled_dot_product_efficient_attention" in ops and "_scaled_dot_product_cudnn_attention" not in ops
    )


def test_cp_with_hsdp_and_full_ac_recomputes_the_ring():
    trace = _run(2, world=4, parallel__dp_replicate=2, training__ac="full")
    assert trace.metadata["context_parallel"]["fsdp_mesh"] == "dp_replicate x dp_shard_cp"
    recomputed = _ring_blocks(trace, "all_gather_into_tensor", Phase.RECOMPUTE)
    assert recomputed == [S * HKV * HD * 2 * BF16] * LAYERS


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "over, words",
    [
        ({"training__seq_len": 66}, ["training.seq_len=66", "2*parallel.cp=4", "load-balanced"]),
        (
            {
                "model__n_heads": 8,
                "model__n_kv_heads": 8,
                "training__seq_len": 24,
                "parallel__tp": 8,
                "world__world_size": 16,
            },
            ["training.seq_len/parallel.cp=12", "parallel.tp=8"],
        ),
        (
            {"parallel__pp": 2, "world__world_size": 4, "training__num_micro_batches": 2},
            ["parallel.cp=2", "parallel.pp=2", "not supported"],
        ),
        ({"parallel__cp_rotate_method": "ring"}, ["parallel.cp_rotate_method", "'ring'"]),
        ({"target_device": "cpu"}, ["parallel.cp=2", "target_device=cuda", "'cpu'"]),
        (
            {"training__param_dtype": None, "training__reduce_dtype": None},
            ["parallel.cp=2", "fp32", "model.n_kv_heads=2", "math kernel"],
        ),
        (
            {"model__n_kv_heads": 4, "training__param_dtype": None, "training__reduce_dtype": None},
            ["training.seq_len=64", "memory-efficient", "seq_len/(2*cp)=16", "multiple of 32"],
        ),
    ],
)
def test_bad_context_parallel_layout_is_a_one_line_error(over, words):
    with pytest.raises(ConfigError) as err:
        job(**{"world__world_size": 2, "parallel__cp": 2, **over})
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_cli_bad_cp_input_exits_2_with_one_line(capsys, tmp_path):
    from hyperdryrun.cli import main

    argv = ["run", "--model", "llama-tiny", "--world-size", "2", "--cp", "2", "--seq-len", "66"]
    assert main([*argv, "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hyperdryrun: error: training.seq_len=66") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------------ determinism, globals
def test_context_parallel_runs_write_byte_identical_reports(tmp_path, capsys, monkeypatch):
    from hyperdryrun.cli import main

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    argv = [
        "run",
        "--model",
        "llama-tiny",
        "--seq-len",
        "64",
        "--world-size",
        "4",
        "--cp",
        "2",
        "--rank",
        "3",
    ]
    outputs = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert main([*argv, "--output-dir", str(out)]) == 0
        outputs.append({p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()})
    capsys.readouterr()
    assert sorted(str(p) for p in outputs[0]) == [
        "rank_3/rank_3_memory.csv",
        "rank_3/rank_3_memory.json",
        "rank_3/rank_3_segments.csv",  # a CUDA target: the caching allocator's segments
    ]
    assert outputs[0] == outputs[1]


def _cp_globals():
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention

    strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    return {
        "sdpa": F.scaled_dot_product_attention,
        "options": (
            _attention._cp_options.enable_load_balance,
            _attention._cp_options.rotate_method,
            _attention._cp_options.convert_to_f32,
        ),
        "dispatch_mode": _attention._dispatch_mode,
        "replaced": dict(_attention._replaced_functions),
        "handlers": DTensor._op_dispatcher._custom_op_handlers,
        "strategy": strategies.get(torch.ops.aten._scaled_dot_product_cudnn_attention.default),
        "leaked_sdpa_names": [
            n for n in vars(F) if n.endswith("scaled_dot_product_attention") and n[0] != "_"
        ],
    }


def test_cp_globals_are_restored_after_the_run():
    before = _cp_globals()
    _run(2, parallel__cp_rotate_method="alltoall")
    assert _cp_globals() == before


def test_cp_globals_are_restored_when_the_step_raises():
    from hyperdryrun.engine import SimulationError, simulate
    from hyperdryrun.models.llama import cross_entropy_loss
    from hyperdryrun.parallel import MESH_DIMS, parallelize_llama
    from hyperdryrun.parallel.context import ContextParallelStep
    from hyperdryrun.recipe import batch_fn, model_fn, parallelize_options

    cfg = job(world__world_size=2, parallel__cp=2, parallel__cp_rotate_method="alltoall")
    during = []

    def failing_loss(logits, labels):
        during.append(_cp_globals())
        cross_entropy_loss(logits, labels)
        raise RuntimeError("loss exploded")

    cp = ContextParallelStep(
        lambda m, mesh: parallelize_llama(m, mesh, cfg.dims, parallelize_options(cfg)),
        failing_loss,
        1,
        "alltoall",
    )
    before = _cp_globals()
    with pytest.raises(SimulationError, match="loss exploded"):
        simulate(
            model_fn(cfg),
            batch_fn(cfg),
            step_fn=cp.step,
            parallelize_fn=cp.parallelize,
            world_size=2,
            rank=0,
            mesh_shape=cfg.dims.mesh_shape,
            mesh_dim_names=MESH_DIMS,
        )
    assert during and during[0]["sdpa"] is not before["sdpa"]
    assert during[0]["handlers"] is not before["handlers"]
    assert _cp_globals() == before


def test_without_the_sdpa_name_stand_in_cp_never_reaches_attention(monkeypatch):
    from torch.distributed.tensor.experimental._context_parallel import _attention

    from hyperdryrun.parallel import context

    monkeypatch.setattr(context, "sdpa_name_patch", lambda: None)
    try:
        trace = _run(2)
        # CP's wrapper landed on F.cuda_scaled_dot_product_attention (the target-kernel SDPA's __name__), so the
        # attention ran on the local shard alone: no ring exchange at all.
        assert "cuda_scaled_dot_product_attention" in vars(F)
        assert _ring_blocks(trace, "all_gather_into_tensor", Phase.FORWARD) == []
    finally:
        vars(F).pop("cuda_scaled_dot_product_attention", None)
        assert _attention._replaced_functions == {}
