"""The model registry: every preset belongs to one family, the --model help and the config's choices come from it,
and each family's initialiser gives a built model the values a real run starts from (real CPU tensors)."""

from __future__ import annotations

import math

import pytest
import torch

from hyperdryrun.models import registry
from hyperdryrun.models.llama import PRESETS, LlamaArgs, LlamaTransformer, rope_cache
from hyperdryrun.models.moe import PRESETS as MOE_PRESETS
from hyperdryrun.models.moe import MoEArgs, MoETransformer


def test_every_preset_belongs_to_its_family():
    assert [f.name for f in registry.families()] == ["llama", "moe", "hf"]
    for name in PRESETS:
        assert registry.family_of(name) is registry.LLAMA
    for name in MOE_PRESETS:
        assert registry.family_of(name) is registry.MOE
    assert registry.preset_names() == sorted([*PRESETS, *MOE_PRESETS])
    assert registry.LLAMA.is_moe is False and registry.MOE.is_moe is True


def test_family_of_args_prefers_the_exact_class():
    class NarrowArgs(LlamaArgs):
        pass

    assert registry.family_of_args(PRESETS["llama-tiny"]) is registry.LLAMA
    assert registry.family_of_args(MOE_PRESETS["moe-tiny"]) is registry.MOE
    assert registry.family_of_args(NarrowArgs(**PRESETS["llama-tiny"].to_dict())) is registry.LLAMA
    with pytest.raises(KeyError, match="no model family takes int"):
        registry.family_of_args(3)


def test_model_help_lists_the_presets_per_family():
    assert registry.presets_help() == (
        "llama3-8b, llama3-70b, llama3-405b, llama-debug, llama-tiny; "
        "MoE: mixtral-8x7b, qwen3-30b-a3b, deepseek-v3, moe-debug, qwen3-moe-debug, deepseek-v3-debug, moe-tiny"
    )


def test_a_taken_family_or_preset_name_is_refused():
    with pytest.raises(ValueError, match="model family 'llama' is already registered"):
        registry.register_family(registry.LLAMA)
    clash = registry.ModelFamily(
        name="other",
        args_cls=LlamaArgs,
        presets={"llama-tiny": PRESETS["llama-tiny"]},
        build=LlamaTransformer,
        init_weights=registry.LLAMA.init_weights,
        pipeline_cut=registry.LLAMA.pipeline_cut,
    )
    with pytest.raises(ValueError, match="model preset 'llama-tiny' is already registered by 'llama'"):
        registry.register_family(clash)
    assert "other" not in [f.name for f in registry.families()]


def _scramble(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(7.0)


@pytest.mark.parametrize(
    ("family", "args", "rope_dim"),
    [
        (registry.LLAMA, PRESETS["llama-tiny"], 64 // 4),
        (registry.LLAMA, PRESETS["llama-tiny"].replace(rope="shared"), 64 // 4),
        (registry.MOE, MOE_PRESETS["moe-tiny"], 64 // 4),
        (registry.MOE, MOE_PRESETS["moe-tiny"].replace(rope="shared", moe_impl="torchtitan-2024"), 64 // 4),
        # MLA rotates only the decoupled rope part of each head
        (
            registry.MOE,
            MOE_PRESETS["moe-tiny"].replace(
                attention="mla",
                q_lora_rank=32,
                kv_lora_rank=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=4,
                v_head_dim=8,
            ),
            4,
        ),
    ],
)
def test_initialiser_sets_norms_to_one_weights_to_the_dim_scale_and_recomputes_rope(family, args, rope_dim):
    torch.manual_seed(0)
    model = family.build(args, 32)
    assert isinstance(model, LlamaTransformer if family is registry.LLAMA else MoETransformer)
    _scramble(model)
    family.init_weights(model)
    weights = []
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            weights.append(p.flatten())
    std = torch.cat(weights).std().item()
    assert std == pytest.approx(1 / math.sqrt(args.dim), rel=0.05)
    # torchtitan 0.3.0: one table per attention (MLA: of its rope part); its 2024 releases (rope: shared): one.
    per_layer = args.rope == "per-layer"
    names = (
        [f"layers.{i}.attention.rope.cache" for i in range(args.n_layers)] if per_layer else ["rope_cache"]
    )
    buffers = dict(model.named_buffers())
    # torchtitan 0.3.0's MoE layers hold two fp32 load-balancing counters, both zero after initialisation.
    counters = []
    if getattr(args, "moe_impl", None) == "torchtitan":
        counters = [
            f"layers.{i}.moe.{name}"
            for i in range(args.n_dense_layers, args.n_layers)
            for name in ("expert_bias", "tokens_per_expert")
        ]
    assert sorted(buffers) == sorted(names + counters)
    for name in names:
        assert torch.equal(buffers[name], rope_cache(rope_dim, 32, args.rope_theta)), name
    for name in counters:
        assert torch.equal(buffers[name], torch.zeros(args.num_experts)), name


def test_pipeline_cut_keeps_the_stage_modules():
    model = registry.LLAMA.build(PRESETS["llama-tiny"].replace(n_layers=4), 16)
    registry.LLAMA.pipeline_cut(model, range(1, 3), embedding=False, head=True)
    assert list(model.layers) == ["1", "2"]
    assert model.tok_embeddings is None and model.output is not None and model.norm is not None


def test_moe_args_are_their_own_family():
    assert isinstance(MOE_PRESETS["deepseek-v3"], MoEArgs)
    assert registry.MOE.presets is MOE_PRESETS and registry.LLAMA.presets is PRESETS
