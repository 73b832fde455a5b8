"""A Llama-style dense decoder in plain torch, free of any parallelism code.

Shaped after torchtitan's ``models/llama3/model.py`` so that the torch-native parallel plans (FSDP2, TP with
sequence parallel, loss parallel) apply from outside: attention infers its local head count from the projection
output, so a column-sharded ``wq`` simply yields fewer heads on each rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaArgs:
    """Shape of a Llama-style decoder. ``ffn_dim`` is the SwiGLU hidden width."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count derived from the shapes alone (independent of any module)."""
        kv = self.n_kv_heads * self.head_dim
        per_layer = 2 * self.dim * self.dim + 2 * self.dim * kv + 3 * self.dim * self.ffn_dim + 2 * self.dim
        embed = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * per_layer + self.dim + embed + head

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> LlamaArgs:
        return replace(self, **changes)


# Published shapes (Meta's Llama 3 / 3.1 model cards); the small ones exist for tests and CPU ground truth.
PRESETS: dict[str, LlamaArgs] = {
    "llama3-8b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256),
    "llama3-70b": LlamaArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256
    ),
    "llama3-405b": LlamaArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, vocab_size=128256
    ),
    "llama-debug": LlamaArgs(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=512, vocab_size=1024),
    "llama-tiny": LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementation, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


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


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1: the local head count, which tensor parallelism divides.
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
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
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class DecoderLM(nn.Module):
    """What every built-in decoder shares: tokens -> embedding -> layers (with the RoPE table) -> norm -> logits,
    and the cut to one pipeline stage. Subclasses build those parts with :meth:`build_parts`, giving their block."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage is this model with some parts removed (``keep_stage``): it then takes or returns
        # hidden states instead of tokens or logits, as torchtitan's stage models do.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def build_parts(
        self, args: Any, rope_dim: int, max_seq_len: int, block: Callable[[int], nn.Module]
    ) -> None:
        """Build the shared parts, in this order (it is the parameters' order): the embedding, the RoPE table of
        ``rope_dim`` per head, ``block(i)`` for each layer, the final norm and the output head (tied if asked)."""
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer(
            "rope_cache", rope_cache(rope_dim, max_seq_len, args.rope_theta), persistent=False
        )
        # A ModuleDict keyed by layer index, as torchtitan does, so that FQNs stay stable under splitting.
        self.layers = nn.ModuleDict({str(i): block(i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
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
        self.build_parts(args, args.head_dim, max_seq_len, lambda i: TransformerBlock(args))

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
    cache = model.rope_cache
    cache.copy_(rope_cache(args.head_dim, cache.shape[0], args.rope_theta).to(cache.dtype))
