"""The built-in llama presets make torchtitan 0.3.0's memory choices, checked without torchtitan: its selective-AC
policy recomputes every second matmul, the chunked loss holds one chunk of logits, every layer has its RoPE table,
and the new fields reject values that would have no effect."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hyperdryrun.config import ConfigError, build_config
from hyperdryrun.models.llama import PRESETS, LlamaTransformer, TransformerBlock
from hyperdryrun.parallel.ac import checkpointed_layers, every_second_matmul_policy, torchtitan_save_ops
from hyperdryrun.recipe import run_job
from hyperdryrun.trace.blocks import Category, Phase

TINY = PRESETS["llama-tiny"]  # dim 64, 4 heads, 2 KV heads (head_dim 16), ffn 128, vocab 256


class _Ctx:
    is_recompute = False


def test_sac_policy_saves_odd_matmuls_and_recomputes_even_ones():
    policy = every_second_matmul_policy(torchtitan_save_ops())
    w = torch.empty(4, 4)
    got = [policy(_Ctx(), torch.ops.aten.mm.default, w, w) for _ in range(5)]
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert got == [save, recompute, save, recompute, save]
    # other ops: attention saved, elementwise recomputed, neither counted as a matmul
    assert policy(_Ctx(), torch.ops.aten._scaled_dot_product_cudnn_attention.default) is save
    assert policy(_Ctx(), torch.ops.aten.mul.Tensor) is recompute
    assert policy(_Ctx(), torch.ops.aten.mm.default, w, w) is recompute  # the 6th matmul


def test_sac_on_a_block_saves_the_qkv_w1_and_w2_matmuls():
    """A fused-QKV block runs 5 matmuls in this order: wqkv, wo, w1, w3, w2. Saved: the 1st, 3rd and 5th, i.e. the
    outputs of shape (tokens, 64 + 2*2*16 = 128), (tokens, 128) and (tokens, 64)."""
    block = TransformerBlock(TINY, max_seq_len=8)
    decisions = []
    inner = every_second_matmul_policy(torchtitan_save_ops())

    def recording(ctx, func, *args, **kwargs):
        out = inner(ctx, func, *args, **kwargs)
        if func == torch.ops.aten.mm.default and not ctx.is_recompute:
            decisions.append((out, tuple(args[1].shape)))
        return out

    x = torch.randn(1, 8, 64, requires_grad=True)
    ctx_fn = lambda: create_selective_checkpoint_contexts(recording)  # noqa: E731
    checkpoint(block, x, None, use_reentrant=False, context_fn=ctx_fn).sum().backward()
    saved = [shape for d, shape in decisions if d is CheckpointPolicy.MUST_SAVE]
    assert len(decisions) == 5
    # mm's second argument is the transposed weight, (in, out)
    assert saved == [(64, 128), (64, 128), (128, 64)]


def test_layer_ac_checkpoints_torchtitans_positions():
    # torchtitan's counter starts at 1 and checkpoints when it divides by k: layers k-1, 2k-1, ...
    assert checkpointed_layers(7, 3) == [2, 5]
    assert checkpointed_layers(4, 1) == [0, 1, 2, 3]


def test_every_layer_holds_its_own_rope_table():
    seq = 32
    model = LlamaTransformer(TINY, max_seq_len=seq)
    buffers = dict(model.named_buffers())
    assert sorted(buffers) == [f"layers.{i}.attention.rope.cache" for i in range(TINY.n_layers)]
    for cache in buffers.values():
        assert cache.shape == (seq, 16 // 2) and cache.dtype == torch.complex64


def test_chunked_loss_holds_one_chunk_of_logits():
    """seq 64 in 4 chunks on one rank: each forward output matmul is 16 tokens x 256 vocab in bf16 (FSDP2's
    param_dtype), its fp32 log-softmax 16 x 256 x 4 B; the whole sequence's would be 4 times that."""
    chunk_logits = 16 * 256 * 4
    cfg = build_config(
        {"model": {"name": "llama-tiny"}, "training": {"seq_len": 64, "loss": "chunked", "loss_chunks": 4}}
    )
    trace = run_job(cfg, capture_stacks=False)
    head = [b for b in trace.blocks if b.module == "output" and b.op == "mm" and b.phase is Phase.FORWARD]
    assert len(head) == 4 and {b.size for b in head} == {16 * 256 * 2}
    softmax = [b.size for b in trace.blocks if b.op == "_log_softmax"]
    assert softmax == [chunk_logits] * 4
    full = run_job(
        build_config({"model": {"name": "llama-tiny"}, "training": {"seq_len": 64}}), capture_stacks=False
    )
    assert max(b.size for b in full.blocks if b.op == "_log_softmax") == 4 * chunk_logits


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"training": {"loss_chunks": 4}},
            "training.loss_chunks=4 has no effect without training.loss='chunked'",
        ),
        ({"training": {"loss": "chunked", "loss_chunks": 3}}, "training.loss_chunks=3 must divide"),
        (
            {"training": {"ac": "selective", "ac_selective": "ops"}},
            "training.ac_selective: must be 'op', 'op-save-all-matmuls' or a positive layer interval, got 'ops'",
        ),
        (
            {"model": {"name": "deepseek-v3", "fuse_qkv": False}},
            "model.fuse_qkv=False applies to grouped-query attention, 'deepseek-v3' has MLA",
        ),
        (
            {"model": {"name": "llama-tiny", "moe_impl": "torchtitan-2024"}},
            "model.moe_impl=torchtitan-2024 needs an MoE model",
        ),
        ({"model": {"norm": "layer"}}, "model.norm"),
        (
            # one rank computing in fp32: no FSDP2 (its mixed-precision policy would apply it)
            {"parallel": {"fsdp_wrap": "torchtitan-2024"}, "training": {"param_dtype": "fp32"}},
            "parallel.fsdp_wrap='torchtitan-2024' has no effect: FSDP2 is not applied",
        ),
        (
            {
                "world": {"world_size": 2},
                "parallel": {"pp": 2},
                "training": {"loss": "chunked", "num_micro_batches": 2},
            },
            "training.loss='chunked' is not built with parallel.pp=2",
        ),
    ],
)
def test_fields_reject_bad_or_ineffective_values(data, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config(data)


def test_earlier_torchtitan_choices_stay_selectable():
    model = {"norm": "fp32-unfused", "fuse_qkv": False, "rope": "shared"}
    cfg = build_config(
        {"model": model, "world": {"world_size": 2}, "parallel": {"fsdp_wrap": "torchtitan-2024"}}
    )
    args = cfg.model.args()
    assert (args.norm, args.fuse_qkv, args.rope) == ("fp32-unfused", False, "shared")
    assert cfg.parallel.fsdp_wrap == "torchtitan-2024"


@pytest.mark.parametrize(
    "field",
    [
        {"model": {"name": "hf:llama-3.1-8b", "norm": "fused"}},
        {"model": {"name": "hf:llama-3.1-8b", "rope": "shared"}},
        {"model": {"name": "hf:llama-3.1-8b"}, "training": {"loss": "chunked"}},
        {
            "model": {"name": "hf:llama-3.1-8b"},
            "world": {"world_size": 2},
            "parallel": {"fsdp_wrap": "torchtitan"},
        },
    ],
)
def test_preset_choices_are_errors_on_hugging_face_models(field):
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    if field.get("parallel"):  # the default value is accepted; the other one has no effect on an HF model
        build_config(field)
        field = {**field, "parallel": {"fsdp_wrap": "torchtitan-2024"}}
    with pytest.raises(ConfigError, match="applies to built-in presets") as err:
        build_config(field)
    assert "\n" not in str(err.value)


def _r512(n: int) -> int:
    return (n + 511) // 512 * 512


@pytest.mark.parametrize(
    "fsdp_wrap, kept",
    [
        # torchtitan 0.3.0 under PP: no unit reshards after forward, so the embedding and both blocks of stage 0
        pytest.param("torchtitan", ("tok_embeddings", "layers.0", "layers.1"), id="torchtitan-0.3.0"),
        # its 2024 releases: every block but the stage's last resharded, the root (embedding) too
        pytest.param("torchtitan-2024", ("layers.1",), id="torchtitan-2024"),
    ],
)
def test_pipeline_stage_0_holds_its_units_and_rope_tables_as_torchtitan_does(fsdp_wrap, kept):
    """PP layout (torchtitan's path refuses PP, so this is the independent derivation): pp=2 x dp_shard=2, rank 0
    is stage 0 of llama-tiny with 4 layers (embedding, layers 0-1), seq 64, 1F1B over 2 micro batches. Bytes from
    the shapes: one 512-rounded storage per parameter; fp32 shards over 2 ranks, bf16 unsharded copies."""
    trace = run_job(
        build_config(
            {
                "model": {"name": "llama-tiny", "n_layers": 4},
                "world": {"world_size": 4},
                "parallel": {"pp": 2, "dp_shard": 2, "fsdp_wrap": fsdp_wrap},
                "training": {"seq_len": 64, "num_micro_batches": 2},
                "target_device": "cuda",
            }
        ),
        capture_stacks=False,
    )
    block = [128 * 64, 64 * 64, 128 * 64, 64 * 128, 128 * 64, 64, 64]  # wqkv, wo, w1, w2, w3, two norms
    units = {"tok_embeddings": [256 * 64], "layers.0": block, "layers.1": block}
    shards = sum(_r512(n * 4 // 2) for unit in units.values() for n in unit)
    persistent = [b for b in trace.blocks if b.persistent]
    assert sum(b.size for b in persistent if b.category is Category.PARAMETER) == shards == 182_272
    # only stage 0's two layers' RoPE tables: complex64 (64 positions, 16 / 2 rotations) each
    assert sum(b.size for b in persistent if b.category is Category.BUFFER) == 2 * _r512(64 * 8 * 8)
    first_backward = trace.task_phase.index(Phase.BACKWARD)
    unsharded = [
        b
        for b in trace.blocks
        if b.category is Category.PARAMETER and not b.persistent and b.start <= first_backward < b.end
    ]
    assert {b.module for b in unsharded} == set(kept)
    assert sum(b.size for b in unsharded) == sum(_r512(n * 2) for m in kept for n in units[m])


def test_the_report_metadata_states_the_preset_choices():
    def meta(data: dict) -> dict:
        m = run_job(
            build_config({"world": {"world_size": 2}, "training": {"seq_len": 64}, **data}), False
        ).metadata
        return {k: m[k] for k in ("loss", "norm", "fuse_qkv", "rope", "fsdp_wrap")}

    assert meta({"model": {"name": "llama-tiny"}}) == {
        "loss": {"kind": "cross-entropy", "chunks": None},
        "norm": "fused",
        "fuse_qkv": True,
        "rope": "per-layer",
        "fsdp_wrap": "torchtitan",
    }
    old = {"name": "llama-tiny", "norm": "fp32-unfused", "fuse_qkv": False, "rope": "shared"}
    assert meta({"model": old, "parallel": {"fsdp_wrap": "torchtitan-2024"}}) == {
        "loss": {"kind": "cross-entropy", "chunks": None},
        "norm": "fp32-unfused",
        "fuse_qkv": False,
        "rope": "shared",
        "fsdp_wrap": "torchtitan-2024",
    }
    # MoE presets make the same choices (their FSDP units are parallel/expert.py's), the old ones selectable too.
    assert meta({"model": {"name": "moe-tiny"}}) == {
        "loss": {"kind": "cross-entropy", "chunks": None},
        "norm": "fused",
        "fuse_qkv": True,
        "rope": "per-layer",
        "fsdp_wrap": "torchtitan",
    }
    old_moe = {"name": "moe-tiny", "fuse_qkv": False, "rope": "shared"}
    assert meta({"model": old_moe, "parallel": {"fsdp_wrap": "torchtitan-2024"}}) == {
        "loss": {"kind": "cross-entropy", "chunks": None},
        "norm": "fused",
        "fuse_qkv": False,
        "rope": "shared",
        "fsdp_wrap": "torchtitan-2024",
    }
