"""A Llama-style dense decoder in plain torch, free of any parallelism code.

Shaped after torchtitan's ``models/llama3/model.py`` so that the torch-native parallel plans (FSDP2, TP with
sequence parallel, loss parallel) apply from outside: attention infers its local head count from the projection
output, so a column-sharded ``wq`` simply yields fewer heads on each rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyperdryrun.models.shapes import LLAMA_PRESETS, LlamaArgs

PRESETS = LLAMA_PRESETS


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, unfused (torchtitan's 2024 releases, Meta's reference code)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementation, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rms_norm(dim: int, eps: float, kind: str) -> nn.Module:
    """An RMSNorm of ``kind``: ``fused`` (``nn.RMSNorm``, torchtitan 0.3.0) or ``fp32-unfused`` (:class:`RMSNorm`)."""
    return nn.RMSNorm(dim, eps=eps) if kind == "fused" else RMSNorm(dim, eps)


def rope_cache(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """Complex rotations ``freqs_cis`` of shape (max_seq_len, head_dim // 2), as torchtitan's ``precompute_freqs_cis``.

    Complex, not real cos/sin: FSDP2's mixed precision casts floating-point forward inputs of each block to
    ``param_dtype`` and would rotate in bf16; complex inputs are left alone, as in torchtitan.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    t = torch.arange(max_seq_len).float()
    angles = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of the last dim in fp32 (torchtitan's ``apply_rotary_emb``); ``x`` is (bs, seq, heads, hd)."""
    seq = x.shape[1]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rot = freqs_cis[:seq].view(1, seq, 1, xc.shape[-1])
    return torch.view_as_real(xc * rot).flatten(3).type_as(x)


class RotaryEmbedding(nn.Module):
    """One layer's RoPE table (torchtitan 0.3.0's ``ComplexRoPE``: every attention holds its own ``cache``
    buffer) and the rotation of q and k at the given positions (a gather of their rows, as torchtitan does)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("cache", rope_cache(head_dim, max_seq_len, theta), persistent=False)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Positions 0..seq-1 of q's (gathered) sequence when none are given: one document per row.
        positions = torch.arange(q.shape[1], device=q.device) if positions is None else positions
        rows = self.cache[positions]
        return apply_rope(q, rows), apply_rope(k, rows)


def add_qkv_projections(attention: nn.Module, dim: int, q_out: int, kv_out: int, fuse: bool) -> None:
    """Register the q/k/v projections of grouped-query attention on ``attention``: one ``wqkv`` laid out per KV
    group, its ``n_rep`` query heads, then its key and its value head (torchtitan's FusedQKVLinear, so a
    column-sharded wqkv holds whole groups), or ``wq``, ``wk``, ``wv``."""
    if fuse:
        attention.wqkv = nn.Linear(dim, q_out + 2 * kv_out, bias=False)
    else:
        attention.wq = nn.Linear(dim, q_out, bias=False)
        attention.wk = nn.Linear(dim, kv_out, bias=False)
        attention.wv = nn.Linear(dim, kv_out, bias=False)


def project_qkv(attention: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of ``x`` as (batch, seq, local heads, ``attention.head_dim``) through the projections of
    :func:`add_qkv_projections`; ``attention.n_rep`` query heads per KV head."""
    bs, seq, _ = x.shape
    hd = attention.head_dim
    if not hasattr(attention, "wqkv"):
        # -1: the local head count, which tensor parallelism divides.
        return tuple(w(x).view(bs, seq, -1, hd) for w in (attention.wq, attention.wk, attention.wv))
    qkv = attention.wqkv(x).view(bs, seq, -1, attention.n_rep + 2, hd)
    q, k, v = torch.split(qkv, [attention.n_rep, 1, 1], dim=-2)
    # Each made contiguous, as torchtitan does (copies of the strided split).
    return tuple(t.reshape(bs, seq, -1, hd).contiguous() for t in (q, k, v))


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, max_seq_len: int) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads
        kv = args.n_kv_heads * self.head_dim
        add_qkv_projections(self, args.dim, args.n_heads * self.head_dim, kv, args.fuse_qkv)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        per_layer = args.rope == "per-layer"
        self.rope = RotaryEmbedding(self.head_dim, max_seq_len, args.rope_theta) if per_layer else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        """``rope``: the model's shared table, or None (positions 0..seq-1 of this layer's own table)."""
        bs, seq, _ = x.shape
        q, k, v = project_qkv(self, x)
        q, k = self.rope(q, k, rope) if self.rope is not None else (apply_rope(q, rope), apply_rope(k, rope))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_rep > 1)
        out = out.transpose(1, 2).contiguous().view(bs, seq, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs, max_seq_len: int) -> None:
        super().__init__()
        self.attention_norm = rms_norm(args.dim, args.norm_eps, args.norm)
        self.attention = Attention(args, max_seq_len)
        self.ffn_norm = rms_norm(args.dim, args.norm_eps, args.norm)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class DecoderLM(nn.Module):
    """What every built-in decoder shares: tokens -> embedding -> layers (with the RoPE table) -> norm -> logits,
    and the cut to one pipeline stage. Subclasses build those parts with :meth:`build_parts`, giving their block."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage is this model with some parts removed (``keep_stage``): it then takes or returns
        # hidden states instead of tokens or logits, as torchtitan's stage models do.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope_input(h)
        for layer in self.layers.values():
            h = layer(h, rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None and not self.skip_output else h

    skip_output = False
    """Return the normed hidden states instead of logits: a chunked loss applies ``output`` per chunk."""

    def rope_input(self, h: torch.Tensor) -> torch.Tensor | None:
        """What every layer's attention takes for RoPE: the model's one table (layers with their own RoPE module
        take positions instead)."""
        return self.rope_cache

    def build_parts(
        self, args: Any, rope_dim: int | None, max_seq_len: int, block: Callable[[int], nn.Module]
    ) -> None:
        """Build the shared parts, in this order (it is the parameters' order): the embedding, the model's one RoPE
        table of ``rope_dim`` per head (none where ``rope_dim`` is None: each layer holds its own), ``block(i)`` for
        each layer, the final norm of ``args.norm``'s kind and the output head (tied if asked)."""
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        if rope_dim is not None:
            self.register_buffer(
                "rope_cache", rope_cache(rope_dim, max_seq_len, args.rope_theta), persistent=False
            )
        # A ModuleDict keyed by layer index, as torchtitan does, so that FQNs stay stable under splitting.
        self.layers = nn.ModuleDict({str(i): block(i) for i in range(args.n_layers)})
        self.norm = rms_norm(args.dim, args.norm_eps, args.norm)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def keep_stage(self, layers: range, embedding: bool, head: bool) -> None:
        """Reduce the model to one pipeline stage: decoder layers ``layers`` (global indices, so FQNs stay those
        of the whole model), the embedding if ``embedding``, the final norm and output head if ``head``."""
        for key in [k for k in self.layers if int(k) not in layers]:
            del self.layers[key]
        if not embedding:
            self.tok_embeddings = None
        if not head:
            self.norm = None
            self.output = None


class LlamaTransformer(DecoderLM):
    """The dense Llama decoder-only LM: tokens (bs, seq) -> logits (bs, seq, vocab)."""

    def __init__(self, args: LlamaArgs, max_seq_len: int) -> None:
        super().__init__()
        rope = args.head_dim if args.rope == "shared" else None
        self.build_parts(args, rope, max_seq_len, lambda i: TransformerBlock(args, max_seq_len))

    def rope_input(self, h: torch.Tensor) -> torch.Tensor | None:
        """The shared table, or None: each layer's RoPE gathers rows 0..seq-1 of its own table (torchtitan's data
        loader gives one document per row)."""
        return self.rope_cache if self.args.rope == "shared" else None

    def init_weights(self) -> None:
        """Real initialisation (used only by real execution; a dry run needs no values)."""
        init_llama_weights(self)


Transformer = LlamaTransformer
"""The dense model's name before the MoE family existed (kept for tests/test_bytes.py and user code)."""


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token cross entropy in fp32, as torchtitan computes it."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


# Code above the loss runs in traced steps: reports name its lines, so new code goes below.


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The values this rank holds of a (possibly DTensor) parameter or buffer: writing them writes the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def init_llama_weights(model: DecoderLM) -> None:
    """Real values for a Llama model or pipeline stage, on this rank's local shards: weights ~ N(0, 1/dim), norms
    1, and the RoPE cache recomputed (``to_empty`` leaves buffers uninitialised)."""
    args = model.args
    for name, p in model.named_parameters():
        local = local_shard(p)
        if name.endswith("norm.weight"):
            local.fill_(1.0)
        else:
            local.normal_(std=1.0 / math.sqrt(args.dim))
    if args.rope == "shared":
        cache = model.rope_cache
        cache.copy_(rope_cache(args.head_dim, cache.shape[0], args.rope_theta).to(cache.dtype))
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            cache = module.cache
            cache.copy_(rope_cache(module.head_dim, cache.shape[0], module.theta).to(cache.dtype))
