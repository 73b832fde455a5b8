"""Train specs: each model family's TP plan, EP plan and parallelize function, and a family registered from
outside running through config and recipe without any dispatch to edit."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from hyperdryrun.config import build_config
from hyperdryrun.models import registry
from hyperdryrun.models.llama import PRESETS, LlamaArgs, LlamaTransformer
from hyperdryrun.models.moe import PRESETS as MOE_PRESETS
from hyperdryrun.models.moe import MoETransformer
from hyperdryrun.parallel import train_spec as specs
from hyperdryrun.parallel.expert import NoParallel, apply_ep, parallelize_moe
from hyperdryrun.parallel.llama import parallelize_llama
from hyperdryrun.parallel.tp import block_tp_plan
from hyperdryrun.trace.blocks import Category


def test_each_family_has_its_spec():
    llama, moe = specs.get_train_spec("llama"), specs.get_train_spec("moe")
    assert llama.family is registry.LLAMA and llama.parallelize is parallelize_llama and llama.ep_plan is None
    assert moe.family is registry.MOE and moe.parallelize is parallelize_moe and moe.ep_plan is apply_ep
    cfg = build_config({"model": {"name": "moe-tiny"}})
    assert specs.get_train_spec(cfg.model.family.name) is moe
    with pytest.raises(KeyError, match="model family 'gpt' has no train spec"):
        specs.get_train_spec("gpt")
    with pytest.raises(ValueError, match="model family 'llama' already has a train spec"):
        specs.register_train_spec(llama)


def _styles(plan: dict) -> dict[str, type]:
    return {name: type(style) for name, style in plan.items()}


def test_llama_block_plan_splits_attention_and_ffn_megatron_style():
    from torch.distributed.tensor import Shard

    with torch.device("meta"):
        block = LlamaTransformer(PRESETS["llama-tiny"], 16).layers["0"]
    assert _styles(specs.LLAMA_SPEC.tp_plan(block, Shard(1))) == {
        "attention": PrepareModuleInput,
        "attention.wo": RowwiseParallel,
        "attention.wqkv": ColwiseParallel,  # torchtitan 0.3.0's fused projection, whole KV groups per rank
        "feed_forward": PrepareModuleInput,
        "feed_forward.w1": ColwiseParallel,
        "feed_forward.w2": RowwiseParallel,
        "feed_forward.w3": ColwiseParallel,
        "attention_norm": SequenceParallel,
        "ffn_norm": SequenceParallel,
    }


def test_moe_block_plan_replicates_mla_low_rank_projections_and_skips_the_missing_ffn():
    from torch.distributed.tensor import Replicate

    args = MOE_PRESETS["moe-tiny"].replace(
        attention="mla", q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
    )
    with torch.device("meta"):
        block = MoETransformer(args, 16).layers["0"]  # an MoE layer: no dense feed_forward
    assert _styles(specs.MOE_SPEC.tp_plan(block, Replicate())) == {
        "attention": PrepareModuleInput,
        "attention.wo": RowwiseParallel,
        "attention.wq_a": NoParallel,
        "attention.q_norm": NoParallel,
        "attention.wkv_a": NoParallel,
        "attention.kv_norm": NoParallel,
        "attention.wq_b": ColwiseParallel,
        "attention.wkv_b": ColwiseParallel,
    }
    # A GQA MoE block is planned like a Llama block's attention.
    with torch.device("meta"):
        gqa = MoETransformer(MOE_PRESETS["moe-tiny"], 16).layers["0"]
    assert _styles(specs.MOE_SPEC.tp_plan(gqa, Replicate())) == _styles(block_tp_plan(gqa, Replicate()))


class NarrowArgs(LlamaArgs):
    """A family of its own that reuses the Llama model (what a user's family would bring)."""


@pytest.fixture
def narrow_family(monkeypatch):
    """Register a new family and its train spec in copies of the registries, undone after the test."""
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    monkeypatch.setattr(registry, "_BY_PRESET", dict(registry._BY_PRESET))
    monkeypatch.setattr(specs, "_SPECS", dict(specs._SPECS))
    built: list = []

    def build(args, max_seq_len):
        built.append(args)
        return LlamaTransformer(args, max_seq_len)

    args = NarrowArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=128)
    family = registry.register_family(
        registry.ModelFamily(
            name="narrow",
            args_cls=NarrowArgs,
            presets={"narrow-1": args},
            build=build,
            init_weights=registry.LLAMA.init_weights,
            pipeline_cut=registry.LLAMA.pipeline_cut,
            label="Narrow",
        )
    )
    specs.register_train_spec(specs.TrainSpec(family, parallelize=parallelize_llama, tp_plan=block_tp_plan))
    return args, built


def test_a_registered_family_runs_through_config_and_recipe(narrow_family):
    from hyperdryrun.recipe import run_job

    args, built = narrow_family
    assert registry.presets_help().endswith("; Narrow: narrow-1")
    cfg = build_config({"model": {"name": "narrow-1", "n_layers": 2}, "training": {"seq_len": 16}})
    assert cfg.model.family.name == "narrow" and not cfg.model.is_moe
    trace = run_job(cfg)
    assert built == [args.replace(n_layers=2)]
    # Parameters in fp32 (one rank, so FSDP2 keeps them whole): embedding and head 128*32 each, final norm 32,
    # per layer q and o 32*32, k and v 32*16, SwiGLU 3*32*64 and two norms of 32.
    layer = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32
    params = sum(b.requested for b in trace.blocks if b.category is Category.PARAMETER and b.start == 0)
    assert params == 4 * (2 * 128 * 32 + 32 + 2 * layer)
