"""Rank classes: the parameter layout they assume against the really parallelized model, and the classes against
every rank of small jobs simulated (equal reports within a class, different reports in different classes)."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from hyperdryrun import recipe
from hyperdryrun.config import build_config
from hyperdryrun.report.build import build_report
from hyperdryrun.search.classes import (
    chunk_size,
    class_of,
    group_index,
    group_sizes,
    local_shape,
    rank_classes,
    rank_ranges,
    stage_params,
)
from hyperdryrun.world import SimulatedWorld
from tests.conftest import job


@pytest.mark.parametrize(("n", "k"), [(64, 3), (4, 8), (0, 4), (7, 7), (10, 4), (128256, 64), (1, 2)])
def test_chunk_size_is_the_length_of_each_torch_chunk(n, k):
    chunks = list(torch.arange(n).chunk(k)) if n else []
    expected = [len(c) for c in chunks] + [0] * (k - len(chunks))
    assert [chunk_size(n, k, i) for i in range(k)] == expected


def _real_local_shapes(cfg) -> dict[str, set[tuple[int, ...]]]:
    """Every parameter's local shape after the recipe's own parallelize (meta tensors, this rank's world)."""
    dims = cfg.dims
    world = SimulatedWorld(
        cfg.world.world_size, cfg.world.rank, None, dims.mesh_shape, dims.mesh_dim_names, cfg.target_device
    )
    out: dict[str, set[tuple[int, ...]]] = {}
    with world:
        with torch.device("meta"):
            model = recipe.model_fn(cfg)()
        if cfg.parallel.pp > 1:
            model = recipe.pipeline(cfg).parallelize(model, world.mesh)
        else:
            model = recipe.parallelize(cfg)(model, world.mesh) or model
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            name = re.sub(r"^stage\d+\.", "", name.replace("_checkpoint_wrapped_module.", ""))
            out.setdefault(re.sub(r"layers\.\d+\.", "layers.*.", name), set()).add(tuple(local.shape))
    return out


LAYOUTS = [
    ("uneven FSDP", dict(world__world_size=3, model__dim=72), [0, 2]),
    (
        "FSDP+TP+PP",
        dict(
            world__world_size=8,
            parallel__tp=2,
            parallel__pp=2,
            model__n_layers=4,
            training__num_micro_batches=2,
        ),
        [0, 3, 5, 7],
    ),
    ("HSDP+CP", dict(world__world_size=4, parallel__cp=2, parallel__dp_replicate=2), [0, 1, 3]),
    ("MoE EP", dict(model__name="moe-tiny", world__world_size=8, parallel__ep=2), [0, 1, 5]),
    (
        "MoE TP+EP+ETP, dense and shared experts",
        dict(
            model__name="moe-tiny",
            world__world_size=8,
            parallel__tp=2,
            parallel__ep=2,
            parallel__etp=2,
            model__n_dense_layers=1,
            model__num_shared_experts=1,
        ),
        [0, 1, 6],
    ),  # fmt: skip
    ("MoE experts fewer than FSDP ranks", dict(model__name="moe-tiny", world__world_size=8), [0, 4, 7]),
    (
        "MLA, EP over dp_shard/ep on dim 1",
        dict(
            model__name="deepseek-v3",
            model__n_layers=2,
            model__n_dense_layers=1,
            model__num_experts=8,
            world__world_size=32,
            parallel__ep=4,
            parallel__dp_shard=16,
            parallel__tp=2,
            parallel__etp=2,
        ),
        [0, 5, 31],
    ),  # fmt: skip
]


@pytest.mark.parametrize(("name", "over", "ranks"), LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_parameter_layout_matches_the_parallelized_model(name, over, ranks):
    for rank in ranks:
        cfg = job(**over, world__rank=rank)
        dims, c = cfg.dims, cfg.dims.coordinates(rank)
        mine: dict[str, set[tuple[int, ...]]] = {}
        for spec in stage_params(cfg, c.stages):
            mine.setdefault(spec.name, set()).add(local_shape(spec, group_sizes(dims), group_index(dims, c)))
        assert mine == _real_local_shapes(cfg), f"rank {rank}"


IDENTITY = (("metadata", "rank"), ("metadata", "local_rank"), ("metadata", "moe", "ep_rank"))


def _profile(cfg) -> str:
    """The rank's JSON report without what names the rank (its rank, local rank, EP rank, expert indices and the
    names of its process groups)."""
    report = copy.deepcopy(build_report(recipe.run_job(cfg, capture_stacks=False)))
    for path in IDENTITY:
        node = report
        for key in path[:-1]:
            node = node.get(key) or {}
        node.pop(path[-1], None)
    if report["metadata"].get("moe"):
        report["metadata"]["moe"].pop("local_experts", None)
    # The process group a communicator belongs to is named by its registration order ("5" or "6" for the two
    # replicate groups); its size and bytes stay.
    for comm in (report["metadata"].get("cuda") or {}).get("nccl", {}).get("communicators", []):
        comm.pop("group", None)
    return json.dumps(report, sort_keys=True)


def _partition(groups) -> set[frozenset[int]]:
    return {frozenset(g) for g in groups}


BRUTE_FORCE = [
    # 64 rows over 3 FSDP ranks: 22, 22, 20 (torch.chunk), so rank 2 holds smaller shards.
    ("uneven FSDP shards", dict(world__world_size=3), [[0, 1], [2]]),
    # A dim not divisible by dp_shard: dim 72 over 8 ranks is 9 each, but separate wk/wv (36 rows) chunk to
    # 5,...,5,1 (the fused wqkv's 144 rows split evenly, hence separate projections here).
    (
        "uneven FSDP shards of a dim",
        dict(world__world_size=8, model__dim=72, model__fuse_qkv=False),
        [[0, 1, 2, 3, 4, 5, 6], [7]],
    ),
    # Four experts (and a 4-row router) over 8 FSDP ranks: ranks 4-7 get empty shards.
    ("empty FSDP shards", dict(model__name="moe-tiny", world__world_size=8), [[0, 1, 2, 3], [4, 5, 6, 7]]),
    # pp 2 x dp_shard 2 x tp 2: the stages differ, the tp and dp ranks of a stage do not.
    (
        "pipeline and TP",
        dict(
            world__world_size=8,
            parallel__tp=2,
            parallel__pp=2,
            model__n_layers=4,
            training__num_micro_batches=2,
        ),
        [[0, 1, 2, 3], [4, 5, 6, 7]],
    ),
    # Expert 0 gets 2x the balanced load: the EP rank holding it (ep index 0: ranks 0 and 2) receives more tokens.
    (
        "EP hotspot",
        dict(model__name="moe-tiny", world__world_size=4, parallel__ep=2, values__routing="hotspot"),
        [[0, 2], [1, 3]],
    ),
    ("EP balanced", dict(model__name="moe-tiny", world__world_size=4, parallel__ep=2), [[0, 1, 2, 3]]),
    ("HSDP + TP", dict(world__world_size=4, parallel__dp_replicate=2, parallel__tp=2), [[0, 1, 2, 3]]),
]


@pytest.mark.parametrize(("name", "over", "expected"), BRUTE_FORCE, ids=[x[0] for x in BRUTE_FORCE])
def test_rank_classes_agree_with_every_rank_simulated(name, over, expected):
    cfg = job(**over)
    classes = rank_classes(cfg)
    assert _partition(c.ranks for c in classes) == _partition(expected)
    profiles = {r: _profile(job(**over, world__rank=r)) for r in range(cfg.world.world_size)}
    by_profile: dict[str, list[int]] = {}
    for r, p in profiles.items():
        by_profile.setdefault(p, []).append(r)
    # Equal bytes within each class, and a class split exactly where the reports differ.
    assert _partition(by_profile.values()) == _partition(c.ranks for c in classes)


def test_context_parallel_ranks_are_kept_apart_and_each_class_is_uniform():
    # Ring attention's causal split depends on the cp rank, so cp positions are separate classes (conservative):
    # within each, every rank's report is the same.
    over = dict(world__world_size=4, parallel__cp=2)
    classes = rank_classes(job(**over))
    assert _partition(c.ranks for c in classes) == _partition([[0, 2], [1, 3]])
    for c in classes:
        assert len({_profile(job(**over, world__rank=r)) for r in c.ranks}) == 1


def test_the_405b_job_has_one_class_per_pipeline_stage():
    cfg = build_config(
        {
            "model": {"name": "llama3-405b"},
            "world": {"world_size": 512},
            "parallel": {"dp_shard": 8, "tp": 8, "pp": 8},
            "training": {"seq_len": 8192, "num_micro_batches": 16, "ac": "full"},
        }
    )
    classes = rank_classes(cfg)
    # pp is the outermost mesh dimension: stage s holds ranks 64s .. 64s+63; every shard is even.
    assert [c.ranks for c in classes] == [tuple(range(64 * s, 64 * s + 64)) for s in range(8)]
    assert [c.representative for c in classes] == [0, 64, 128, 192, 256, 320, 384, 448]
    assert class_of(classes)[449].index == 7


def test_rank_ranges_compress_consecutive_ranks():
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert rank_ranges((3,)) == "3"
