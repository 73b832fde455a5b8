"""The job config on its own (the CLI tests reach it through flags): defaults, what the world leaves to dp_shard,
one-line errors naming the field and the value, the model registry behind ``model.name``, and YAML / torchrun input.
"""

from __future__ import annotations

import pytest

from hyperdryrun.config import ConfigError, JobConfig, build_config, load_yaml, rank_from_env
from hyperdryrun.models.llama import PRESETS, LlamaArgs
from hyperdryrun.models.moe import PRESETS as MOE_PRESETS
from hyperdryrun.models.moe import MoEArgs
from hyperdryrun.parallel_dims import ParallelDims


def error_of(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        build_config(data)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_defaults_are_the_documented_job():
    cfg = JobConfig()
    assert cfg.model.name == "llama3-8b" and cfg.model.args() == PRESETS["llama3-8b"]
    assert (cfg.world.world_size, cfg.world.rank, cfg.local_rank) == (1, 0, 0)
    assert cfg.parallel.dp_shard == 1
    assert (cfg.training.seq_len, cfg.training.dtype, cfg.training.param_dtype) == (2048, "fp32", "bf16")
    assert cfg.parallel.pp_schedule == "1F1B" and cfg.parallel.pp_stages_per_rank == 1
    assert cfg.target_device == "cuda" and cfg.output_dir == "hyperdryrun_out"


@pytest.mark.parametrize(
    ("parallel", "world", "dp_shard"),
    [({}, 8, 8), ({"tp": 2}, 8, 4), ({"tp": 2, "pp": 2}, 8, 2), ({"dp_replicate": 2, "cp": 2}, 16, 4)],
)
def test_dp_shard_defaults_to_what_the_world_leaves(parallel, world, dp_shard):
    data = {"model": {"name": "llama-tiny"}, "parallel": parallel, "world": {"world_size": world}}
    cfg = build_config({**data, "training": {"num_micro_batches": 2}})
    assert cfg.parallel.dp_shard == dp_shard
    assert cfg.dims == ParallelDims(world_size=world, **parallel)


def test_with_changes_is_the_job_built_with_those_fields_and_leaves_the_original_alone():
    given = {"model": {"name": "llama-tiny"}, "world": {"world_size": 8}, "training": {"seq_len": 64}}
    cfg = build_config(given)
    changed = cfg.with_changes(parallel={"tp": 2}, world={"rank": 5}, margin_gib=None)
    written_out = {**given, "parallel": {"tp": 2}, "world": {"world_size": 8, "rank": 5}}
    assert changed.model_dump() == build_config(written_out).model_dump()
    assert (changed.parallel.dp_shard, changed.dims.coordinates(5).tp) == (4, 1)  # dp_shard: what tp 2 leaves
    assert changed.model is cfg.model and changed.training is cfg.training  # carried over, not rebuilt
    assert (cfg.parallel.tp, cfg.parallel.dp_shard, cfg.world.rank) == (1, 8, 0)
    # a field the section was not given stays ungiven: ac_selective is still no error under ac none
    assert cfg.with_changes(training={"ac": "none"}).training.ac_selective == "op"
    with pytest.raises(ConfigError, match=r"^world: rank=8 must be < world_size=8$"):
        cfg.with_changes(world={"rank": 8})
    with pytest.raises(ConfigError, match=r"world_size=8 is not divisible by dp_replicate\*cp\*tp\*pp=3"):
        cfg.with_changes(
            parallel={"tp": 3}
        )  # dp_shard was not given: the world's rest, which 3 does not divide


def test_dims_give_the_rank_coordinates():
    cfg = build_config(
        {
            "model": {"name": "llama-tiny"},
            "parallel": {"tp": 2, "pp": 2},
            "world": {"world_size": 8, "rank": 7},
            "training": {"num_micro_batches": 2},
        }
    )
    c = cfg.dims.coordinates(cfg.world.rank)
    # mesh (pp 2, dp_replicate 1, dp_shard 2, cp 1, tp 2), row-major: 7 = 1*4 + 1*2 + 1
    assert (c.pp, c.dp_shard, c.tp, c.stages) == (1, 1, 1, (1,))


def test_model_overrides_apply_to_the_preset_of_the_right_family():
    cfg = build_config({"model": {"name": "llama-tiny", "n_layers": 5, "dim": 128}})
    assert isinstance(cfg.model.args(), LlamaArgs)
    assert cfg.model.args() == PRESETS["llama-tiny"].replace(n_layers=5, dim=128)
    assert cfg.model.family.name == "llama" and not cfg.model.is_moe
    cfg = build_config({"model": {"name": "moe-tiny", "num_experts": 8}})
    assert isinstance(cfg.model.args(), MoEArgs)
    assert cfg.model.args().num_experts == 8 and cfg.model.args().top_k == MOE_PRESETS["moe-tiny"].top_k
    assert cfg.model.family.name == "moe" and cfg.model.is_moe


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"model": {"name": "gpt-2"}},
            "model.name: unknown model 'gpt-2'; choose one of deepseek-v3, deepseek-v3-debug, llama-debug, "
            "llama-tiny, llama3-405b, llama3-70b, llama3-8b, mixtral-8x7b, moe-debug, moe-tiny, qwen3-30b-a3b, "
            "qwen3-moe-debug",
        ),
        (
            {"model": {"name": "llama-tiny", "top_k": 2}},
            "model: model.top_k=2 needs an MoE model, 'llama-tiny' is dense",
        ),
        ({"training": {"seq_len": 0}}, "training.seq_len: Input should be greater than 0 (got 0)"),
        ({"world": {"world_size": 2, "rank": 2}}, "world: rank=2 must be < world_size=2"),
        (
            {"world": {"world_size": 6}, "parallel": {"tp": 4}},
            "world.world_size=6 is not divisible by dp_replicate*cp*tp*pp=4",
        ),
        (
            {"model": {"name": "llama-tiny"}, "world": {"world_size": 4}, "parallel": {"dp_shard": 2}},
            "world.world_size=4 != dp_replicate*dp_shard*cp*tp*pp = 1*2*1*1*1 = 2",
        ),
        (
            {"model": {"name": "llama-tiny", "n_heads": 3}},
            "model.dim=64 is not divisible by model.n_heads=3",
        ),
        (
            {"model": {"name": "llama-tiny"}, "world": {"world_size": 2}, "parallel": {"ep": 2}},
            "parallel.ep=2 needs an MoE model, 'llama-tiny' is dense",
        ),
        (
            {"model": {"name": "moe-tiny"}, "values": {"routing": "hotspot", "hot_expert": 4}},
            "values.hot_expert=4 must be < model.num_experts=4",
        ),
        (
            # one micro batch of moe-tiny: 1 x 64 tokens, top 2 -> 128 routed rows over 4 experts
            {
                "model": {"name": "moe-tiny"},
                "training": {"seq_len": 64},
                "values": {"routing": "explicit", "counts": [64, 64, 0]},
            },
            "values.counts=[64, 64, 0] must have model.num_experts=4 entries summing to "
            "micro_batch_size*seq_len*top_k = 128, each <= 64 tokens",
        ),
        (
            {"model": {"name": "llama-tiny"}, "training": {"ac": "selective", "ac_selective": "3"}},
            "training.ac_selective=3 exceeds model.n_layers=2",
        ),
        (
            {"training": {"ac_selective": "x"}},
            "training.ac_selective: must be 'op', 'op-save-all-matmuls' or a positive layer interval, got 'x'",
        ),
        ({"target_device": "tpu"}, "target_device: Input should be 'cuda' or 'cpu' (got 'tpu')"),
        ({"device_memory_gib": float("inf")}, "device_memory_gib: Input should be a finite number (got inf)"),
        ({"device_memory_gib": "80"}, "device_memory_gib: Input should be a valid number (got '80')"),
        (
            {"parallel": {"pp_stage_layers": []}},
            "parallel.pp_stage_layers: must be a non-empty list of layer counts from 0 to 10000, got []",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_field_and_value(data, message):
    assert error_of(data) == message


def test_the_first_layout_problem_is_raised():
    # Two problems: the world does not split over tp=4, and llama-tiny's 2 kv heads do not either.
    data = {"model": {"name": "llama-tiny"}, "world": {"world_size": 6}, "parallel": {"tp": 4}}
    dims = ParallelDims(world_size=6, tp=4)
    problems = dims.problems(PRESETS["llama-tiny"], JobConfig().training, model_name="llama-tiny")
    assert len(problems) == 2
    assert error_of(data) == problems[0] == "world.world_size=6 is not divisible by dp_replicate*cp*tp*pp=4"


@pytest.mark.parametrize(
    ("parallel", "per_rank"),
    [
        ({}, 1),
        ({"pp_schedule": "Interleaved1F1B"}, 2),
        ({"pp_schedule": "LoopedBFS", "pp_virtual_stages": 3}, 3),
    ],
)
def test_stages_per_rank_default_by_schedule(parallel, per_rank):
    cfg = build_config(
        {
            "model": {"name": "llama-tiny", "n_layers": 8},
            "parallel": {"pp": 2, **parallel},
            "world": {"world_size": 2},
            "training": {"num_micro_batches": 4},
        }
    )
    assert cfg.parallel.pp_stages_per_rank == cfg.dims.stages_per_rank == per_rank
    assert cfg.parallel.pp_num_stages == 2 * per_rank


def test_validation_leaves_the_input_dict_alone():
    data = {"model": {"name": "llama-tiny"}, "world": {"world_size": 4}}
    build_config(data)
    assert data == {"model": {"name": "llama-tiny"}, "world": {"world_size": 4}}


def test_yaml_errors_name_the_file(tmp_path):
    with pytest.raises(
        ConfigError, match=r"--config: cannot read '.*missing.yaml': No such file or directory"
    ):
        load_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match=r"--config: '.*bad.yaml' is not valid YAML: "):
        load_yaml(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"--config: '.*list.yaml' must hold a mapping, got list"):
        load_yaml(listed)
    for text in ("", "# only a comment\n", "{}\n"):  # issue 23: it would silently run the default llama3-8b
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        with pytest.raises(ConfigError, match=r"--config: '.*empty.yaml' is empty: it gives no job"):
            load_yaml(empty)


def test_rank_from_torchrun_environment():
    assert rank_from_env({"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1"}) == {
        "world_size": 8,
        "rank": 5,
        "local_rank": 1,
    }
    assert rank_from_env({}) == {}
    with pytest.raises(ConfigError, match=r"^RANK='x' is not an integer$"):
        rank_from_env({"RANK": "x"})
    with pytest.raises(ConfigError, match=r"^RANK=8 must satisfy 0 <= RANK < WORLD_SIZE=8$"):
        rank_from_env({"WORLD_SIZE": "8", "RANK": "8"})
    with pytest.raises(ConfigError, match=r"^WORLD_SIZE=0 must be >= 1$"):
        rank_from_env({"WORLD_SIZE": "0"})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        # llama-tiny: 4 heads; dim 60 gives a head dim of 15, which RoPE cannot rotate in pairs
        (
            {"model": {"name": "llama-tiny", "dim": 60}},
            "model.dim / model.n_heads = 15 must be even: RoPE rotates pairs of the head dimension",
        ),
        (
            {"training": {"seq_len": 10**20}},
            "training.seq_len: Input should be less than or equal to 1073741824 (got 100000000000000000000)",
        ),
        (
            {"model": {"dim": 2**40}},
            "model.dim: Input should be less than or equal to 4194304 (got 1099511627776)",
        ),
        (
            # 2**30 * 2**30 tokens of llama-tiny's 2048-word vocabulary: 2**71 elements, no tensor holds them
            {"model": {"name": "llama-tiny"}, "training": {"seq_len": 2**30, "micro_batch_size": 2**30}},
            "training.micro_batch_size * training.seq_len * model.dim = 1152921504606846976 * 64 elements do not "
            "fit one tensor (at most 1152921504606846975 8-byte elements)",
        ),
        ({"output_dir": ""}, "output_dir: String should have at least 1 character (got '')"),
        ({"output_dir": "a\0b"}, "output_dir: must be a path without NUL bytes, got 'a\\x00b'"),
        (
            {"model": {"name": "llama-tiny"}, "training": {"ac": "none", "ac_selective": "2"}},
            "training.ac_selective='2' has no effect with training.ac='none' (give training.ac: selective / --ac "
            "selective, or drop it)",
        ),
        (
            {"model": {"name": "moe-tiny"}, "values": {"hot_expert": 1}},
            "values.hot_expert=1 has no effect with values.routing='balanced' (it is for values.routing: hotspot or "
            "bound / --routing hotspot)",
        ),
        (
            {
                "model": {"name": "moe-tiny"},
                "training": {"seq_len": 64},  # 64 tokens x top 2 = 128 rows: 32 per expert
                "values": {"routing": "explicit", "counts": [32] * 4, "skew": 3},
            },
            "values.skew=3.0 has no effect with values.routing='explicit' (it is for values.routing: hotspot / "
            "--routing hotspot)",
        ),
        (
            {"model": {"name": "moe-tiny"}, "values": {"routing": "hotspot", "counts": [32] * 4}},
            "values.counts=[32, 32, 32, 32] has no effect with values.routing='hotspot' (it is for values.routing: "
            "explicit / --routing explicit)",
        ),
        (
            {"model": {"name": "llama-tiny"}, "values": {"routing": "hotspot"}},
            "values.routing='hotspot' has no effect: 'llama-tiny' is a dense model (no experts)",
        ),
        (
            {"model": {"name": "llama-tiny"}, "values": {"skew": 3}},
            "values.skew=3.0 has no effect: 'llama-tiny' is a dense model (no experts)",
        ),
    ],
)
def test_shapes_paths_and_fields_without_effect_are_named(data, message):
    assert error_of(data) == message


def test_fields_given_where_they_apply_are_accepted():
    cfg = build_config(
        {"model": {"name": "llama-tiny"}, "training": {"ac": "selective", "ac_selective": "2"}}
    )
    assert cfg.training.ac_selective == "2"
    cfg = build_config(
        {"model": {"name": "moe-tiny"}, "values": {"routing": "hotspot", "hot_expert": 3, "skew": 2}}
    )
    assert (cfg.values.hot_expert, cfg.values.skew) == (3, 2.0)


def test_a_config_rebuilt_from_its_dump_validates_alike():
    """The runner's workers rebuild the config from ``model_dump()``: every field is then given explicitly."""
    for data in (
        {"model": {"name": "llama-tiny"}},
        {"model": {"name": "moe-tiny"}, "values": {"routing": "hotspot", "hot_expert": 2, "skew": 3}},
        {"model": {"name": "llama-tiny"}, "training": {"ac": "selective", "ac_selective": "2"}},
    ):
        cfg = build_config(data)
        assert build_config(cfg.model_dump()) == cfg
