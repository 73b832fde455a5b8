"""The built-in MoE decoder: preset shapes give the published parameter counts, and the grouped-GEMM MoE layer
computes what a per-token loop over the chosen experts computes (real CPU execution)."""

from __future__ import annotations

import pytest
import torch

from hyperdryrun.models.moe import PRESETS, LayerRoPE, MoE, MoETransformer


def _mixtral() -> tuple[int, int]:
    # config.json of mistralai/Mixtral-8x7B-v0.1: hidden 4096, 32 layers, 32 heads, 8 kv heads (head 128),
    # 8 experts of intermediate 14336, top-2, vocab 32000, untied head.
    attn = 4096 * 4096 * 2 + 4096 * 1024 * 2
    expert = 3 * 4096 * 14336
    layer_common = attn + 4096 * 8 + 2 * 4096  # + router + two norms
    embed = 32000 * 4096
    total = 32 * (layer_common + 8 * expert) + 4096 + 2 * embed
    active = 32 * (layer_common + 2 * expert) + 4096 + 2 * embed
    return total, active


def _qwen3() -> tuple[int, int]:
    # config.json of Qwen/Qwen3-30B-A3B: hidden 2048, 48 layers, 32 heads x 128, 4 kv heads, q/k norm (128 each),
    # 128 experts of intermediate 768, top-8, vocab 151936, untied head.
    attn = 2048 * 4096 * 2 + 2048 * 512 * 2 + 2 * 128
    expert = 3 * 2048 * 768
    layer_common = attn + 2048 * 128 + 2 * 2048
    embed = 151936 * 2048
    total = 48 * (layer_common + 128 * expert) + 2048 + 2 * embed
    active = 48 * (layer_common + 8 * expert) + 2048 + 2 * embed
    return total, active


def _deepseek_v3() -> tuple[int, int]:
    # config.json of deepseek-ai/DeepSeek-V3 (main model, MTP excluded): hidden 7168, 61 layers (3 dense, FFN 18432),
    # MLA with q_lora 1536, kv_lora 512, 128 heads of nope 128 + rope 64, v 128; 256 routed experts + 1 shared,
    # intermediate 2048, top-8; vocab 129280, untied head.
    mla = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    common = mla + 2 * 7168
    dense = 3 * 7168 * 18432
    expert = 3 * 7168 * 2048
    router = 7168 * 256
    embed = 129280 * 7168
    total = 3 * (common + dense) + 58 * (common + router + 257 * expert) + 7168 + 2 * embed
    active = 3 * (common + dense) + 58 * (common + router + 9 * expert) + 7168 + 2 * embed
    return total, active


# Published: Mixtral 46.7B total / 12.9B active (Mistral AI); Qwen3-30B-A3B 30.5B / 3.3B (Qwen3 model card);
# DeepSeek-V3 671B / 37B (technical report, arXiv 2412.19437, main model).
PUBLISHED = {
    "mixtral-8x7b": (_mixtral, 46.7e9, 12.9e9),
    "qwen3-30b-a3b": (_qwen3, 30.5e9, 3.3e9),
    "deepseek-v3": (_deepseek_v3, 671e9, 37e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_the_published_shapes(name):
    derive, total_pub, active_pub = PUBLISHED[name]
    total, active = derive()
    args = PRESETS[name]
    with torch.device("meta"):
        model = MoETransformer(args, max_seq_len=16)
    assert sum(p.numel() for p in model.parameters()) == total
    assert args.num_params() == total
    assert args.num_params(active=True) == active
    # Published figures are rounded; whether the embedding counts as "active" differs by source: within 2%.
    assert abs(total - total_pub) / total_pub < 0.002
    assert abs(active - active_pub) / active_pub < 0.02


@pytest.mark.parametrize("impl", ["torchtitan", "torchtitan-2024"])
def test_grouped_expert_layer_equals_a_per_token_loop_over_the_chosen_experts(impl):
    """torchtitan 0.3.0 scales each expert's output by the token's router score; its 2024 releases scaled the
    token before the expert."""
    torch.manual_seed(0)
    args = PRESETS["moe-tiny"].replace(num_shared_experts=1, moe_impl=impl)
    moe = MoE(args)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 8, args.dim)
    with torch.no_grad():
        out = moe(x)
        flat = x.view(-1, args.dim)
        # torchtitan 0.3.0's router returns all scores; the MoE counts tokens per expert into its buffer.
        scores, chosen, third = moe.router(flat)
        counts = third if impl == "torchtitan-2024" else moe.tokens_per_expert.long()
        ref = torch.zeros_like(flat)
        w1, w2, w3 = (w.bfloat16().float() for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
        for t in range(flat.shape[0]):
            for s, e in zip(scores[t], chosen[t], strict=True):
                before = s if impl == "torchtitan-2024" else 1.0
                h = (flat[t] * before).bfloat16().float()
                y = (torch.nn.functional.silu(w1[e] @ h) * (w3[e] @ h)).bfloat16().float()
                ref[t] += (w2[e] @ y) * (s / before)
        ref += moe.shared_experts(flat)
    assert counts.tolist() == torch.bincount(chosen.view(-1), minlength=args.num_experts).tolist()
    torch.testing.assert_close(out.view(-1, args.dim), ref, atol=2e-2, rtol=2e-2)


def test_dense_layers_come_first_and_moe_layers_after():
    args = PRESETS["moe-debug"]
    with torch.device("meta"):
        model = MoETransformer(args, max_seq_len=16)
    kinds = [("dense" if b.moe is None else "moe") for b in model.layers.values()]
    assert kinds == ["dense"] * args.n_dense_layers + ["moe"] * (args.n_layers - args.n_dense_layers)


def test_dry_run_peak_equals_real_cpu_execution_of_the_same_moe_step():
    """moe-debug (a dense layer, then router + grouped experts + a shared expert), batch 2 x 128, AdamW, no
    parallelism: the fake step on a CPU target and the real step recorded by torch.profiler allocate the same."""
    from hyperdryrun.engine import simulate
    from hyperdryrun.measure.step import measure
    from hyperdryrun.models.llama import cross_entropy_loss, rope_cache

    args = PRESETS["moe-debug"]

    def init(model):
        torch.manual_seed(0)
        for name, p in model.named_parameters():
            p.data.fill_(1.0) if "norm" in name else p.data.normal_(std=args.dim**-0.5)
        for module in model.modules():
            if isinstance(module, LayerRoPE):
                module.cache.copy_(rope_cache(args.head_dim, module.cache.shape[0], args.rope_theta))
            if isinstance(module, MoE):  # torchtitan's load-balancing counters start at zero
                module.expert_bias.zero_()
                module.tokens_per_expert.zero_()

    def batch(i, device):
        return (torch.randint(0, args.vocab_size, (2, 128), device=device),) * 2

    common = dict(loss_fn=lambda m, b: cross_entropy_loss(m(b[0]), b[1]), capture_stacks=False)
    fake = simulate(lambda: MoETransformer(args, 128), batch, target_device="cpu", **common)
    real = measure(lambda: MoETransformer(args, 128), batch, init_fn=init, **common)
    # Real CPU execution wraps the Python float of torchtitan's route_scale multiplication (top_scores * 1.0) into
    # a 0-dim CPU double tensor, 8 B, alive at the peak; a dry run does not allocate wrapped scalars (on a CUDA
    # target they are host tensors, not device memory).
    assert real.peak - fake.peak == 8
    assert fake.current == real.current
