"""ParallelDims: the mesh, every rank's coordinates and the layout rules, as plain arithmetic.

Coordinates are checked against an independent enumeration (numpy's row-major layout of ``arange(world)`` over the
mesh shape, which is how ``init_device_mesh`` assigns ranks) and, for one world, against torch's own DeviceMesh;
pipeline stage ids against the schedules' placement written out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from hyperdryrun.config import TrainingConfig
from hyperdryrun.models.llama import PRESETS
from hyperdryrun.models.moe import PRESETS as MOE_PRESETS
from hyperdryrun.parallel_dims import MESH_DIMS, ParallelDims, RankCoordinates

TINY = PRESETS["llama-tiny"]  # dim 64, 4 heads, 2 kv heads, ffn 128, vocab 256, 2 layers
MOE_TINY = MOE_PRESETS["moe-tiny"]  # the same attention, 4 experts, top 2, expert ffn 32
TRAIN = TrainingConfig(seq_len=64, num_micro_batches=4)


LAYOUTS = [
    dict(world_size=8, pp=2, dp_shard=2, tp=2),
    dict(world_size=12, dp_replicate=3, tp=2),
    dict(world_size=24, pp=2, dp_shard=3, cp=2, tp=2),
    dict(world_size=16, pp=2, dp_replicate=2, dp_shard=2, tp=2),
    dict(world_size=6, cp=3),
    dict(world_size=1),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_coordinates_of_every_rank_follow_the_row_major_mesh(layout):
    dims = ParallelDims(**layout)
    shape = tuple(layout.get(d, 1) for d in MESH_DIMS)
    if "dp_shard" not in layout:  # what the world leaves
        others = int(np.prod([v for d, v in zip(MESH_DIMS, shape, strict=True) if d != "dp_shard"]))
        shape = tuple(
            layout["world_size"] // others if d == "dp_shard" else v for d, v in zip(MESH_DIMS, shape)
        )
    assert dims.mesh_shape == shape
    assert dims.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    grid = np.arange(layout["world_size"]).reshape(shape)
    for rank in range(layout["world_size"]):
        (where,) = np.argwhere(grid == rank)
        c = dims.coordinates(rank)
        assert (c.pp, c.dp_replicate, c.dp_shard, c.cp, c.tp) == tuple(int(i) for i in where)
        assert c.rank == rank


@pytest.mark.parametrize(
    ("layout", "ep"),
    [(dict(world_size=8, dp_shard=4, tp=2), 2), (dict(world_size=16, dp_replicate=2, dp_shard=8), 4)],
)
def test_ep_rank_is_the_inner_part_of_dp_shard(layout, ep):
    # EP unflattens dp_shard into (dp_shard // ep, ep): reshape the grid so and read the ep axis.
    dims = ParallelDims(**layout, ep=ep)
    pp, dr, ds, cp, tp = dims.mesh_shape
    grid = np.arange(dims.world_size).reshape(pp, dr, ds // ep, ep, cp, tp)
    for rank in range(dims.world_size):
        (where,) = np.argwhere(grid == rank)
        assert dims.coordinates(rank).ep == int(where[3])


def test_coordinates_match_torchs_device_mesh():
    from hyperdryrun.world import SimulatedWorld

    dims = ParallelDims(world_size=8, pp=2, dp_shard=2, tp=2, ep=2)
    for rank in range(8):
        with SimulatedWorld(8, rank, mesh_shape=dims.mesh_shape, mesh_dim_names=dims.mesh_dim_names) as world:
            mesh = world.mesh
            ep_mesh = mesh._unflatten("dp_shard", (1, 2), ("dp_shard_mod_ep", "ep"))["ep"]
            c = dims.coordinates(rank)
            assert [mesh[d].get_local_rank() for d in MESH_DIMS] == [
                c.pp,
                c.dp_replicate,
                c.dp_shard,
                c.cp,
                c.tp,
            ]
            assert ep_mesh.get_local_rank() == c.ep


@pytest.mark.parametrize(
    ("schedule", "pp", "virtual", "stages"),
    [
        # one stage per rank: pipeline rank r holds stage r
        ("1F1B", 4, None, [(0,), (1,), (2,), (3,)]),
        ("GPipe", 2, None, [(0,), (1,)]),
        # looped: rank r holds r, r + pp, r + 2*pp, ...
        ("Interleaved1F1B", 2, None, [(0, 2), (1, 3)]),
        ("LoopedBFS", 2, 3, [(0, 2, 4), (1, 3, 5)]),
        ("InterleavedZeroBubble", 3, None, [(0, 3), (1, 4), (2, 5)]),
        # V: rank r holds r on the way down and 2*pp - 1 - r on the way back
        ("ZBVZeroBubble", 3, None, [(0, 5), (1, 4), (2, 3)]),
        ("DualPipeV", 2, None, [(0, 3), (1, 2)]),
    ],
)
def test_stage_ids_per_schedule(schedule, pp, virtual, stages):
    dims = ParallelDims(world_size=2 * pp, pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual)
    assert dims.num_stages == pp * len(stages[0])
    # pp is the outermost mesh dimension: ranks 2r and 2r + 1 (dp_shard 2) are on pipeline rank r.
    assert [dims.coordinates(rank).stages for rank in range(2 * pp)] == [s for s in stages for _ in (0, 1)]


def test_coordinates_are_a_small_frozen_value():
    c = ParallelDims(world_size=8, pp=2, tp=2).coordinates(5)
    assert c == RankCoordinates(rank=5, pp=1, dp_replicate=0, dp_shard=0, cp=0, tp=1, ep=0, stages=(1,))
    with pytest.raises(AttributeError):
        c.tp = 0


def test_degrees_in_report_order():
    dims = ParallelDims(world_size=16, dp_replicate=2, tp=2, pp=2, ep=2)
    assert dims.degrees() == {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2, "ep": 2, "etp": 1}
    assert list(dims.degrees()) == ["pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp"]


# ------------------------------------------------------------------------------------------------------ validity
@pytest.mark.parametrize(
    "layout",
    [
        dict(world_size=8, tp=2, pp=2),
        dict(world_size=8, dp_replicate=2, dp_shard=2, tp=2),
        dict(world_size=4, pp=2, pp_schedule="Interleaved1F1B"),
        dict(world_size=2, pp=2, pp_schedule="DualPipeV"),
        dict(world_size=2, pp=2, pp_stage_layers=(1, 1)),
    ],
)
def test_valid_dense_layouts_have_no_problems(layout):
    assert ParallelDims(**layout).problems(TINY, TRAIN) == []


def test_valid_moe_layouts_have_no_problems():
    assert ParallelDims(world_size=8, dp_shard=4, tp=2, ep=2, etp=2).problems(MOE_TINY, TRAIN) == []
    assert ParallelDims(world_size=4, ep=4).problems(MOE_TINY, TRAIN) == []


def test_every_problem_is_listed_in_order_without_raising():
    # 6 ranks do not divide by tp=4; llama-tiny's 2 kv heads do not split 4 ways; dense models have no experts.
    dims = ParallelDims(world_size=6, tp=4, ep=2)
    assert dims.dp_shard is None
    assert dims.problems(TINY, TRAIN, model_name="llama-tiny") == [
        "world.world_size=6 is not divisible by dp_replicate*cp*tp*pp=4",
        "model.n_kv_heads=2 is not divisible by parallel.tp=4",
        "parallel.ep=2 needs an MoE model, 'llama-tiny' is dense",
    ]


def test_explicit_dp_shard_that_misses_the_world_names_the_product():
    assert ParallelDims(world_size=8, dp_shard=2, tp=2).problems(TINY, TRAIN) == [
        "world.world_size=8 != dp_replicate*dp_shard*cp*tp*pp = 1*2*1*2*1 = 4"
    ]


def test_a_degree_below_one_is_a_problem_not_a_crash():
    assert ParallelDims(world_size=4, tp=0).problems(TINY, TRAIN) == ["parallel.tp=0 must be >= 1"]


def test_sequence_parallel_needs_the_sequence_to_split_over_tp():
    train = TrainingConfig(seq_len=63)
    msg = "training.seq_len=63 is not divisible by parallel.tp=2 (sequence parallel shards the sequence)"
    assert ParallelDims(world_size=2, tp=2).problems(TINY, train) == [msg]
    assert ParallelDims(world_size=2, tp=2, sequence_parallel=False).problems(TINY, train) == []


def test_pipeline_problems():
    # 2 layers + embedding + head make 4 even-split units: 6 stages (pp 3 x 2 virtual) do not fit.
    dims = ParallelDims(world_size=3, pp=3, pp_schedule="Interleaved1F1B")
    assert dims.problems(TINY, TRAIN) == [
        "model.n_layers=2 does not split into 6 pipeline stages (the even split counts the embedding and the head "
        "as one layer each: needs n_layers + 2 >= 6)",
    ]
    dims = ParallelDims(
        world_size=2, pp=2, pp_schedule="DualPipeV", pp_virtual_stages=3, pp_stage_layers=(1, 0, 1)
    )
    assert dims.problems(TINY, TrainingConfig(num_micro_batches=2)) == [
        "parallel.pp_virtual_stages=3 must be 2 for parallel.pp_schedule=DualPipeV (a V schedule holds exactly two "
        "stages per rank)",
        "parallel.pp_stage_layers has 3 entries, needs one per pipeline stage: pp*stages_per_rank = 2*3 = 6",
        "training.num_micro_batches=2 must be >= the 6 pipeline stages for parallel.pp_schedule=DualPipeV",
    ]
    dims = ParallelDims(world_size=2, pp=2, pp_schedule="Interleaved1F1B", pp_stage_layers=(1, 0, 1, 0))
    assert dims.problems(TINY, TrainingConfig(num_micro_batches=5)) == [
        "parallel.pp_stage_layers=[1, 0, 1, 0]: middle stage 1 has no layers (only the first and last stages, "
        "which hold the embedding and the head, may have none)",
        # rounds = max(1, 5 // 2) = 2 micro batches per round; 5 is not a multiple of 2
        "training.num_micro_batches=5 must be a multiple of max(1, num_micro_batches // pp) = 2 for "
        "parallel.pp_schedule=Interleaved1F1B",
    ]


def test_context_parallel_problems():
    # fp32 compute: llama-tiny's GQA is not runnable; 40 / 4 = 10 rows per half shard, not a multiple of 32.
    train = TrainingConfig(seq_len=40, param_dtype=None)
    assert ParallelDims(world_size=2, cp=2).problems(TINY, train, target_device="cpu") == [
        "parallel.cp=2 needs target_device=cuda, got 'cpu' (torch 2.13 ring attention only dispatches the CUDA "
        "flash, memory-efficient and cuDNN SDPA kernels)",
        "parallel.cp=2 with fp32 compute and grouped-query attention (model.n_kv_heads=2 < n_heads=4) is not "
        "supported: CUDA runs that SDPA with the math kernel (flash and cuDNN need bf16/fp16, memory-efficient has "
        "no GQA in torch 2.13), which ring attention does not handle",
        "training.seq_len=40 with parallel.cp=2 and fp32 compute: the memory-efficient SDPA kernel pads its "
        "logsumexp to a multiple of 32 rows, so ring attention's half-shard merge needs seq_len/(2*cp)=10 to be "
        "a multiple of 32",
    ]
    assert ParallelDims(world_size=2, cp=2).problems(TINY, TrainingConfig(seq_len=64)) == []


def test_moe_problems():
    assert ParallelDims(world_size=6, ep=3).problems(MOE_TINY, TRAIN) == [
        "parallel.ep=3 must divide model.num_experts=4"
    ]
    assert ParallelDims(world_size=4, dp_shard=2, tp=2, ep=4).problems(MOE_TINY, TRAIN) == [
        "parallel.etp=1 with parallel.tp=2 and parallel.ep=4 is not supported (EP borrowing the tp ranks is not "
        "built; use parallel.etp=2)",
        "parallel.ep=4 must divide parallel.dp_shard=2 (EP splits dp_shard)",
    ]
    assert ParallelDims(world_size=2, cp=2).problems(MOE_TINY, TrainingConfig(seq_len=64)) == [
        "parallel.cp=2 with an MoE model is not supported yet (MoE runs with FSDP/TP/EP/PP)"
    ]


def test_mesh_of_an_invalid_layout_raises_with_the_problem():
    with pytest.raises(
        ValueError, match=r"world.world_size=6 is not divisible by dp_replicate\*cp\*tp\*pp=4"
    ):
        ParallelDims(world_size=6, tp=4).coordinates(0)
    with pytest.raises(ValueError, match="rank=8 must satisfy 0 <= rank < world_size=8"):
        ParallelDims(world_size=8).coordinates(8)
