"""Parameter, gradient and optimizer-state bytes against figures derived from the shapes alone.

Expected values come from the model's published shape rules and the documented FSDP2 / TP layouts, never from the
tracker: FSDP2 pads each parameter to ceil(dim0 / N) rows per rank (its sharded storage), AdamW keeps two fp32
states shaped like the rank's *unpadded* rows, FSDP2's reduce-scatter output is one flat buffer per
parameter group that the sharded gradients view, and every CUDA allocation is rounded up to 512 bytes.
"""

from __future__ import annotations

import math

import pytest
import torch

from hyperdryrun.models.llama import PRESETS, Transformer
from hyperdryrun.trace.blocks import Category, Phase
from tests.conftest import dry_run


def r512(n: int) -> int:
    return (n + 511) // 512 * 512


def tiny_shapes(tp_layout: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """llama-tiny (dim 64, 2 layers, 4 heads, 2 kv heads, ffn 128, vocab 256) parameter shapes by FQN,
    written out by hand from the architecture, with the TP style of each (col: dim 0, row: dim 1, rep).
    q, k and v are one fused projection (torchtitan 0.3.0's wqkv): d query rows + 2 x kv key/value rows."""
    d, kv, f, v = 64, 2 * (64 // 4), 128, 256
    shapes = {
        "tok_embeddings.weight": ((v, d), "col"),
        "norm.weight": ((d,), "rep"),
        "output.weight": ((v, d), "col"),
    }
    for i in range(2):
        p = f"layers.{i}."
        shapes |= {
            p + "attention.wqkv.weight": ((d + 2 * kv, d), "col"),
            p + "attention.wo.weight": ((d, d), "row"),
            p + "feed_forward.w1.weight": ((f, d), "col"),
            p + "feed_forward.w2.weight": ((d, f), "row"),
            p + "feed_forward.w3.weight": ((f, d), "col"),
            p + "attention_norm.weight": ((d,), "rep"),
            p + "ffn_norm.weight": ((d,), "rep"),
        }
    return shapes


def groups(shapes: dict) -> list[list[str]]:
    """FSDP2 parameter groups of the recipe (torchtitan 0.3.0's units): the embedding, one per decoder layer, and
    the final norm with the head; the root holds no parameter of its own."""
    layers = [[n for n in shapes if n.startswith(f"layers.{i}.")] for i in range(2)]
    return [["tok_embeddings.weight"], *layers, ["norm.weight", "output.weight"]]


def fsdp_rows(d0: int, n: int, rank: int) -> tuple[int, int]:
    """(padded rows every rank stores, rows this rank really owns) for dim 0 sharded over n ranks."""
    c = math.ceil(d0 / n)
    return c, max(0, min(c, d0 - rank * c))


def category_bytes_at(trace, task: int, category: Category) -> int:
    return sum(b.size for b in trace.blocks if b.category is category and b.start <= task < b.end)


def after_step(trace, category: Category) -> int:
    return sum(b.size for b in trace.blocks if b.category is category and b.persistent)


def first_task(trace, phase: Phase) -> int:
    return trace.task_phase.index(phase)


def test_tiny_shapes_match_the_model_and_the_parameter_formula():
    args = PRESETS["llama-tiny"]
    with torch.device("meta"):
        model = Transformer(args, max_seq_len=64)
    actual = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert actual == {n: s for n, (s, _) in tiny_shapes().items()}
    assert sum(math.prod(s) for s, _ in tiny_shapes().values()) == args.num_params() == 106_816


@pytest.mark.parametrize(
    ("name", "published"),
    [("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496), ("llama3-405b", 405_853_388_800)],
)
def test_presets_have_the_published_parameter_counts(name, published):
    args = PRESETS[name]
    assert args.num_params() == published
    with torch.device("meta"):
        model = Transformer(args.replace(n_layers=1), max_seq_len=16)
    one_layer = sum(p.numel() for p in model.parameters())
    per_layer = sum(p.numel() for p in model.layers["0"].parameters())
    assert one_layer + (args.n_layers - 1) * per_layer == published


@pytest.mark.parametrize("rank", [0, 2])
def test_uneven_fsdp_shards_give_padded_params_and_grads_and_unpadded_optimizer_states(rank):
    # world 3 does not divide 64, 32, 128 or 256 rows: every parameter is unevenly sharded.
    trace = dry_run(world__world_size=3, world__rank=rank, target_device="cuda")
    shapes = tiny_shapes()
    params = optstate = 0
    for shape, _ in shapes.values():
        padded, owned = fsdp_rows(shape[0], 3, rank)
        rest = math.prod(shape[1:])
        params += r512(padded * rest * 4)  # fp32 master shard, padded
        optstate += 2 * r512(owned * rest * 4)  # exp_avg, exp_avg_sq (zero-size shards allocate nothing)
    grads = sum(
        r512(sum(fsdp_rows(shapes[n][0][0], 3, rank)[0] * math.prod(shapes[n][0][1:]) for n in g) * 4)
        for g in groups(shapes)
    )
    assert after_step(trace, Category.PARAMETER) == params
    assert after_step(trace, Category.OPTSTATE) == optstate
    assert category_bytes_at(trace, first_task(trace, Phase.OPTIMIZER), Category.GRADIENT) == grads
    assert after_step(trace, Category.GRADIENT) == 0  # zero_grad(set_to_none=True) ends the step


def test_tensor_parallel_shards_each_weight_along_its_plan_dimension():
    # tp=2 alone, fp32 compute: no FSDP; colwise weights split dim 0, rowwise dim 1, norms replicated.
    trace = dry_run(
        world__world_size=2,
        parallel__tp=2,
        training__param_dtype="fp32",
        training__reduce_dtype="fp32",
    )
    local = 0
    for shape, style in tiny_shapes().values():
        n = math.prod(shape)
        local += r512((n // 2 if style in ("col", "row") else n) * 4)
    assert after_step(trace, Category.PARAMETER) == local
    assert after_step(trace, Category.OPTSTATE) == 2 * local
    # Without FSDP each gradient is its own tensor shaped like the local weight, except the vocab-sharded
    # embedding's: DTensor (torch 2.13 _embedding_ops.embedding_dense_backward_strategy) has no Shard(0) strategy
    # for the weight gradient, so it is Partial and reduced to a Replicate (full vocab x dim) gradient.
    emb = 256 * 64 * 4
    assert (
        category_bytes_at(trace, first_task(trace, Phase.OPTIMIZER), Category.GRADIENT)
        == local - emb // 2 + emb
    )


def test_one_rank_holds_exactly_twice_the_parameter_bytes_of_each_of_two():
    requested = {}
    for world in (1, 2):
        trace = dry_run(world__world_size=world)
        requested[world] = sum(
            b.requested for b in trace.blocks if b.category is Category.PARAMETER and b.persistent
        )
    assert requested[1] == 106_816 * 4
    assert requested[1] == 2 * requested[2]


def test_sgd_with_momentum_keeps_one_state_per_parameter():
    trace = dry_run(world__world_size=2, training__optimizer="SGD")
    expected = sum(r512(fsdp_rows(s[0], 2, 0)[1] * math.prod(s[1:]) * 4) for s, _ in tiny_shapes().values())
    assert after_step(trace, Category.OPTSTATE) == expected


def test_fused_adamw_keeps_its_step_counters_on_the_device():
    # fused=True: state["step"] is a device scalar (one 512 B block each); foreach keeps it on the host.
    n_params = len(tiny_shapes())
    foreach = after_step(dry_run(world__world_size=2), Category.OPTSTATE)
    fused = after_step(dry_run(world__world_size=2, training__optimizer_impl="fused"), Category.OPTSTATE)
    assert fused - foreach == n_params * 512


def test_buffers_are_one_rope_table_of_the_sequence_length_per_layer():
    head_dim = 64 // 4
    # complex64 freqs_cis of shape (seq, head_dim / 2): 8 bytes per element; torchtitan 0.3.0 gives each of the
    # 2 layers its own table, its 2024 releases (model.rope: shared) one for the model.
    table = r512(64 * (head_dim // 2) * 8)
    assert after_step(dry_run(world__world_size=2, training__seq_len=64), Category.BUFFER) == 2 * table
    shared = dry_run(world__world_size=2, training__seq_len=64, model__rope="shared")
    assert after_step(shared, Category.BUFFER) == table


def test_tied_embeddings_store_the_shared_table_once():
    # llama-tiny untied: 106,816 parameters; tying drops the output head's vocab x dim = 256 x 64.
    def param_requested(**over) -> int:
        trace = dry_run(**over)
        return sum(b.requested for b in trace.blocks if b.category is Category.PARAMETER and b.persistent)

    assert param_requested() == 106_816 * 4
    assert param_requested(model__tie_embeddings=True) == (106_816 - 256 * 64) * 4


def test_bf16_storage_halves_parameter_and_state_bytes():
    # training.dtype bf16 with bf16 compute: parameters and AdamW states both bf16 (2 bytes), world 1, no FSDP.
    trace = dry_run(training__dtype="bf16", training__param_dtype="bf16", training__reduce_dtype="bf16")
    params = sum(b.requested for b in trace.blocks if b.category is Category.PARAMETER and b.persistent)
    states = sum(b.requested for b in trace.blocks if b.category is Category.OPTSTATE and b.persistent)
    assert params == 106_816 * 2
    assert states == 2 * 106_816 * 2
