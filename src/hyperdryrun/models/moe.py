"""A built-in mixture-of-experts decoder (torchtitan's ``models/moe`` and ``deepseek_v3`` as the pattern).

Plain torch, no parallel code: a top-k token-choice router, optional shared experts, and routed experts run as one
grouped GEMM (``torch._grouped_mm``, which has fake/meta kernels in torch 2.13). Expert parallelism is applied from
outside by :mod:`hyperdryrun.parallel.expert`: it replaces the MoE's :class:`TokenDispatcher` with an all-to-all one
(torchtitan 0.3.0's design), or hooks the inputs and outputs of :class:`GroupedExperts` (``moe_impl="torchtitan-2024"``
and expert tensor parallel).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hyperdryrun.models.llama import (
    DecoderLM,
    FeedForward,
    add_qkv_projections,
    apply_rope,
    local_shard,
    project_qkv,
    rms_norm,
    rope_cache,
)
from hyperdryrun.models.shapes import MOE_PRESETS, MoEArgs

PRESETS = MOE_PRESETS


def cos_sin_cache(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """RoPE rows ``cos | sin`` of shape (max_seq_len, 2 * head_dim) in fp32, as torchtitan's ``CosSinRoPE``."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=freqs.dtype), freqs).float()
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LayerRoPE(nn.Module):
    """One attention's RoPE table (torchtitan 0.3.0: every attention holds its own ``cache``), complex
    (``ComplexRoPE``) or ``cos | sin`` rows (``CosSinRoPE``); rotates q and k at positions 0..seq-1 (a gather of
    the table's rows, as torchtitan's positions do)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, fmt: str) -> None:
        super().__init__()
        self.head_dim, self.theta, self.format = head_dim, theta, fmt
        self.register_buffer("cache", self.table(max_seq_len), persistent=False)

    def table(self, max_seq_len: int) -> torch.Tensor:
        """The table's values (also what real initialisation writes back after ``to_empty``)."""
        if self.format == "cos-sin":
            return cos_sin_cache(self.head_dim, max_seq_len, self.theta)
        return rope_cache(self.head_dim, max_seq_len, self.theta)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = q.shape[1]
        rows = self.cache[torch.arange(seq, device=q.device)]
        if self.format == "complex":
            return apply_rope(q, rows), apply_rope(k, rows)
        hd = q.shape[-1]
        rows = rows.view(1, seq, 1, 2 * hd)
        cos, sin = rows[..., :hd], rows[..., hd:]
        qf, kf = q.float(), k.float()
        q_out = qf * cos + _rotate_half(qf) * sin
        k_out = kf * cos + _rotate_half(kf) * sin
        return q_out.type_as(q), k_out.type_as(k)


class Attention(nn.Module):
    """Grouped-query attention with an explicit head size and optional per-head q/k RMSNorm (Qwen3); one fused
    ``wqkv`` (torchtitan 0.3.0) or three projections, and the layer's own RoPE table unless the model shares one."""

    def __init__(self, args: MoEArgs, max_seq_len: int) -> None:
        super().__init__()
        hd = self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads
        kv = args.n_kv_heads * hd
        add_qkv_projections(self, args.dim, args.n_heads * hd, kv, args.fuse_qkv)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.q_norm = rms_norm(hd, args.norm_eps, args.norm) if args.qk_norm else None
        self.k_norm = rms_norm(hd, args.norm_eps, args.norm) if args.qk_norm else None
        per_layer = args.rope == "per-layer"
        self.rope = LayerRoPE(hd, max_seq_len, args.rope_theta, args.rope_format) if per_layer else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        bs, seq, _ = x.shape
        q, k, v = project_qkv(self, x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, k) if self.rope is not None else (apply_rope(q, rope), apply_rope(k, rope))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_rep > 1)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seq, -1))


class MLAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention projections (low-rank q, or one ``wq`` when ``q_lora_rank`` is 0,
    and compressed kv, decoupled RoPE part).

    The projections have MLA's exact shapes; the attention core is SDPA on q/k of ``nope + rope`` and v of
    ``v_head_dim`` per head, as torchtitan's deepseek_v3 runs it in training (no latent-cache absorption). With
    ``rope="per-layer"`` (torchtitan 0.3.0) the layer holds its own complex table of the rope part."""

    def __init__(self, args: MoEArgs, max_seq_len: int) -> None:
        super().__init__()
        h = self.n_heads = args.n_heads
        self.nope, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_rank = args.kv_lora_rank
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, h * (self.nope + self.rope_dim), bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = rms_norm(args.q_lora_rank, args.norm_eps, args.norm)
            self.wq_b = nn.Linear(args.q_lora_rank, h * (self.nope + self.rope_dim), bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = rms_norm(args.kv_lora_rank, args.norm_eps, args.norm)
        self.wkv_b = nn.Linear(args.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(h * self.v_dim, args.dim, bias=False)
        per_layer = args.rope == "per-layer"
        self.rope = LayerRoPE(self.rope_dim, max_seq_len, args.rope_theta, "complex") if per_layer else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bs, seq, -1, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        if self.rope is not None:
            q_pe, k_pe = self.rope(q_pe, k_pe.unsqueeze(2))
        else:
            q_pe, k_pe = apply_rope(q_pe, rope), apply_rope(k_pe.unsqueeze(2), rope)
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(bs, seq, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seq, -1))


class TokenChoiceRouter(nn.Module):
    """Top-k token-choice router: scores (softmax or sigmoid), top-k experts per token, tokens per expert.

    ``moe_impl="torchtitan"`` is torchtitan 0.3.0's ``TokenChoiceTopKRouter``: the gate under fp32 autocast, the
    expert bias added for the choice only, unsorted top-k, the chosen scores gathered, scaled by ``route_scale`` (1),
    and all scores returned (the MoE counts tokens per expert from them); ``torchtitan-2024`` the earlier router,
    which returns the tokens per expert instead."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.score_func, self.route_norm = args.score_func, args.route_norm
        self.impl = args.moe_impl
        self.gate = nn.Linear(args.dim, args.num_experts, bias=False)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top-k scores, top-k expert ids, all scores) of ``x`` (tokens x dim, or batch x seq x dim); with
        ``torchtitan-2024``, tokens per expert in place of all scores."""
        if self.impl == "torchtitan-2024":
            return self._forward_2024(x)
        with torch.autocast(device_type=x.device.type, dtype=torch.float32):
            scores = self.gate(x)
        scores = torch.sigmoid(scores) if self.score_func == "sigmoid" else F.softmax(scores, dim=-1)
        choice = scores if expert_bias is None else scores + expert_bias
        _, selected = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)
        top_scores = scores.gather(dim=-1, index=selected)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * 1.0  # torchtitan's route_scale (1.0 in its presets)
        return top_scores, selected, scores

    def _forward_2024(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


class TokenDispatcher:
    """torchtitan 0.3.0's ``LocalTokenDispatcher``: tokens sorted by expert for the grouped GEMMs (``dispatch``), the
    experts' outputs scaled by their router score in fp32 and summed back per token (``combine``). Expert parallel
    swaps in a subclass whose ``exchange`` / ``exchange_back`` are the all-to-alls. The code keeps torchtitan's
    lifetimes, which set the MoE's peak: the sorted input lives until ``dispatch`` returns, the output buffer is made
    before the fp32 product, and the caller holds the experts' output until ``combine`` returns."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k

    def dispatch(
        self, x: torch.Tensor, top_scores: torch.Tensor, selected: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(expert-sorted rows for the local experts, their tokens per expert, what ``combine`` needs)."""
        order = torch.argsort(selected.view(-1), stable=True)
        scores_sorted = top_scores.view(-1)[order]
        token_ids = order // self.top_k
        routed_input = x[token_ids]
        received, tokens_per_expert = self.exchange(routed_input, counts)
        return received, tokens_per_expert, (token_ids, scores_sorted)

    def combine(
        self, routed_output: torch.Tensor, meta: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        """The experts' rows scaled by their scores (in fp32) and added back at their tokens: ``x``'s shape."""
        token_ids, scores_sorted = meta
        routed_output = self.exchange_back(routed_output)
        out = torch.zeros_like(x)
        routed_output = (routed_output.to(torch.float32) * scores_sorted.reshape(-1, 1)).to(
            routed_output.dtype
        )
        return out.scatter_add(0, token_ids.reshape(-1, 1).expand(-1, out.shape[-1]), routed_output)

    def exchange(self, routed_input: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows and tokens per expert to the ranks that hold the experts: here, none (all experts local)."""
        return routed_input, counts

    def exchange_back(self, routed_output: torch.Tensor) -> torch.Tensor:
        """The experts' rows back to the ranks their tokens came from: here, already there."""
        return routed_output


class MoE(nn.Module):
    """Router + routed experts (+ shared experts): tokens are sorted by expert, run through the grouped experts,
    scaled by their router score and summed back per token (torchtitan 0.3.0's ``MoE`` with its
    ``LocalTokenDispatcher``; ``moe_impl="torchtitan-2024"`` scales the tokens before the experts instead)."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.impl = args.moe_impl
        self.router = TokenChoiceRouter(args)
        self.experts = GroupedExperts(args.dim, args.moe_ffn_dim, args.num_experts)
        self.token_dispatcher = TokenDispatcher(args.top_k)
        shared = args.num_shared_experts * args.moe_ffn_dim
        self.shared_experts = FeedForward(args.dim, shared) if shared else None
        if self.impl == "torchtitan":
            # Auxiliary-loss-free load balancing: the bias the router adds for the choice, and the tokens each
            # expert got (accumulated in forward), both fp32 (torchtitan's expert_bias_E, tokens_per_expert_E).
            self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32))
            self.register_buffer(
                "tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32), persistent=False
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "torchtitan-2024":
            return self._forward_2024(x)
        bs, seq, dim = x.shape
        top_scores, selected, scores = self.router(x, self.expert_bias)
        # torchtitan's MoE.forward holds its boolean routing map (tokens x experts) until it returns.
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, selected, True)
        counts = routing_map.sum(dim=tuple(range(routing_map.dim() - 1)))
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        out = self._routed(x.view(-1, dim), top_scores, selected, counts).view(bs, -1, dim)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _routed(
        self, x: torch.Tensor, top_scores: torch.Tensor, selected: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """torchtitan 0.3.0's ``RoutedExperts.forward``: dispatch, experts, combine; its locals (the experts' input
        and output) live until the combine is done, before the shared experts run."""
        routed_input, tokens_per_expert, meta = self.token_dispatcher.dispatch(
            x, top_scores, selected, counts
        )
        routed_output = self.experts(routed_input, tokens_per_expert)
        return self.token_dispatcher.combine(routed_output, meta, x)

    def _forward_2024(self, x: torch.Tensor) -> torch.Tensor:
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
    def __init__(self, args: MoEArgs, layer: int, max_seq_len: int) -> None:
        super().__init__()
        self.attention_norm = rms_norm(args.dim, args.norm_eps, args.norm)
        self.attention = (
            MLAttention(args, max_seq_len) if args.attention == "mla" else Attention(args, max_seq_len)
        )
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
        shared = args.rope == "shared"
        self.build_parts(
            args, rope_dim(args) if shared else None, max_seq_len, lambda i: MoEBlock(args, i, max_seq_len)
        )

    def rope_input(self, h: torch.Tensor) -> torch.Tensor | None:
        """The model's one table, or None where each attention holds its own."""
        return getattr(self, "rope_cache", None)

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
    if hasattr(model, "rope_cache"):
        cache = model.rope_cache
        cache.copy_(rope_cache(rope_dim(args), cache.shape[0], args.rope_theta).to(cache.dtype))
    for module in model.modules():
        if isinstance(module, LayerRoPE):
            module.cache.copy_(module.table(module.cache.shape[0]).to(module.cache.dtype))
        if isinstance(module, MoE) and module.impl == "torchtitan":
            module.expert_bias.zero_()
            module.tokens_per_expert.zero_()
