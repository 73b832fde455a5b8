"""A built-in mixture-of-experts decoder (torchtitan's ``models/moe`` and ``deepseek_v3`` as the pattern).

Plain torch, no parallel code: a top-k token-choice router, optional shared experts, and routed experts run as one
grouped GEMM (``torch._grouped_mm``, which has fake/meta kernels in torch 2.13). Expert parallelism is applied from
outside by :mod:`hyperdryrun.parallel.expert`, which hooks the inputs and outputs of :class:`GroupedExperts`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hyperdryrun.models.llama import DecoderLM, FeedForward, apply_rope, local_shard, rms_norm, rope_cache
from hyperdryrun.models.shapes import MOE_PRESETS, MoEArgs

PRESETS = MOE_PRESETS


class Attention(nn.Module):
    """Grouped-query attention with an explicit head size and optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        hd = self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.q_norm = rms_norm(hd, args.norm_eps, args.norm) if args.qk_norm else None
        self.k_norm = rms_norm(hd, args.norm_eps, args.norm) if args.qk_norm else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_rep > 1)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seq, -1))


class MLAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention projections (low-rank q and compressed kv, decoupled RoPE part).

    The projections have MLA's exact shapes; the attention core is SDPA on q/k of ``nope + rope`` and v of
    ``v_head_dim`` per head, as torchtitan's deepseek_v3 runs it in training (no latent-cache absorption)."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        h = self.n_heads = args.n_heads
        self.nope, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_rank = args.kv_lora_rank
        self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = rms_norm(args.q_lora_rank, args.norm_eps, args.norm)
        self.wq_b = nn.Linear(args.q_lora_rank, h * (self.nope + self.rope_dim), bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = rms_norm(args.kv_lora_rank, args.norm_eps, args.norm)
        self.wkv_b = nn.Linear(args.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(h * self.v_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(bs, seq, -1, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_pe, rope)], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(2), rope)
        kv = self.wkv_b(self.kv_norm(kv)).view(bs, seq, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seq, -1))


class TokenChoiceRouter(nn.Module):
    """Top-k token-choice router: scores (softmax or sigmoid), top-k experts per token, tokens per expert."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.score_func, self.route_norm = args.score_func, args.route_norm
        self.gate = nn.Linear(args.dim, args.num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = self.gate(x).float()
        scores = torch.sigmoid(scores) if self.score_func == "sigmoid" else F.softmax(scores, dim=-1)
        top_scores, selected = torch.topk(scores, k=self.top_k, dim=-1)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        # An int64 count per expert: a fixed shape (bincount's would depend on the values), exact at any token count,
        # and not cast to bf16 by FSDP2's mixed precision as torchtitan's float histc is.
        flat = selected.view(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat))
        return top_scores, selected, counts


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored as 3-D weights and run as grouped GEMMs over expert-sorted tokens.

    ``forward(x, num_tokens_per_expert)``: ``x`` holds the tokens of expert 0, then expert 1, ... Expert parallel
    wraps this module (token dispatch before, combine after) and shards the expert dimension of the weights."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        # torch._grouped_mm runs in bf16 (CUDA's kernel), as torchtitan's _run_experts_grouped_mm casts.
        xb = x.bfloat16()
        h = F.silu(torch._grouped_mm(xb, w1.bfloat16().transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(xb, w3.bfloat16().transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x)


class MoE(nn.Module):
    """Router + routed experts (+ shared experts): tokens are sorted by expert, scaled by their router score,
    run through the grouped experts and summed back per token (torchtitan's MoE with score-before-experts)."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.router = TokenChoiceRouter(args)
        self.experts = GroupedExperts(args.dim, args.moe_ffn_dim, args.num_experts)
        shared = args.num_shared_experts * args.moe_ffn_dim
        self.shared_experts = FeedForward(args.dim, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected, counts = self.router(x)
        order = torch.argsort(selected.view(-1), stable=True)
        scores_sorted = top_scores.view(-1)[order]
        token_ids = order // self.top_k
        routed = (x[token_ids].float() * scores_sorted.unsqueeze(-1)).to(x.dtype)
        routed = self.experts(routed, counts)
        out = torch.zeros_like(x).scatter_add(0, token_ids.unsqueeze(-1).expand(-1, dim), routed)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(bs, seq, dim)


class MoEBlock(nn.Module):
    def __init__(self, args: MoEArgs, layer: int) -> None:
        super().__init__()
        self.attention_norm = rms_norm(args.dim, args.norm_eps, args.norm)
        self.attention = MLAttention(args) if args.attention == "mla" else Attention(args)
        self.ffn_norm = rms_norm(args.dim, args.norm_eps, args.norm)
        dense = layer < args.n_dense_layers
        self.feed_forward = FeedForward(args.dim, args.ffn_dim) if dense else None
        self.moe = None if dense else MoE(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class MoETransformer(DecoderLM):
    """Decoder-only MoE LM: tokens (bs, seq) -> logits (bs, seq, vocab); same stage interface as the Llama model."""

    def __init__(self, args: MoEArgs, max_seq_len: int) -> None:
        super().__init__()
        self.build_parts(args, rope_dim(args), max_seq_len, lambda i: MoEBlock(args, i))

    def init_weights(self) -> None:
        """Real initialisation (used only by real execution; a dry run needs no values)."""
        init_moe_weights(self)


def rope_dim(args: MoEArgs) -> int:
    """Per-head width that RoPE rotates: MLA's decoupled rope part, else the whole head."""
    return args.qk_rope_head_dim if args.attention == "mla" else args.head_dim


@torch.no_grad()
def init_moe_weights(model: MoETransformer) -> None:
    """Real values for an MoE model or pipeline stage, on this rank's local shards: weights ~ N(0, 1/dim), every
    norm 1, and the RoPE cache recomputed (``to_empty`` leaves buffers uninitialised)."""
    args = model.args
    for name, p in model.named_parameters():
        local = local_shard(p)
        if "norm" in name:
            local.fill_(1.0)
        else:
            local.normal_(std=1.0 / math.sqrt(args.dim))
    cache = model.rope_cache
    cache.copy_(rope_cache(rope_dim(args), cache.shape[0], args.rope_theta).to(cache.dtype))
