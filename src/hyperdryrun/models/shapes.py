"""The shapes of the built-in model families and their published presets: plain data, no torch.

The job config, ``--model``'s help and the layout rules read these without building a model, so they live apart
from the torch modules (:mod:`~hyperdryrun.models.llama`, :mod:`~hyperdryrun.models.moe`, which re-export them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal


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
    norm: Literal["fused", "fp32-unfused"] = "fused"
    """RMSNorm kind: ``fused`` is torch's ``nn.RMSNorm`` (torchtitan 0.3.0; one fused kernel on CUDA),
    ``fp32-unfused`` the reference's normalise-in-fp32 module of torchtitan's 2024 releases."""
    fuse_qkv: bool = True
    """One ``wqkv`` projection split into q, k, v (torchtitan 0.3.0) instead of ``wq``, ``wk``, ``wv``."""
    rope: Literal["per-layer", "shared"] = "per-layer"
    """RoPE table: one ``cache`` buffer per attention (torchtitan 0.3.0) or one ``rope_cache`` buffer of the model
    that every layer reads (torchtitan's 2024 releases)."""

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
LLAMA_PRESETS: dict[str, LlamaArgs] = {
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


@dataclass(frozen=True)
class MoEArgs:
    """Shapes of an MoE decoder. ``ffn_dim`` is the dense FFN of the first ``n_dense_layers`` layers; every other
    layer has ``num_experts`` routed experts of hidden size ``moe_ffn_dim`` (``top_k`` per token) plus
    ``num_shared_experts`` always-on experts of the same size."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    num_experts: int
    top_k: int
    moe_ffn_dim: int
    num_shared_experts: int = 0
    n_dense_layers: int = 0
    head_dim_override: int | None = None
    """Attention head size when it is not dim // n_heads (Qwen3)."""
    qk_norm: bool = False
    attention: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    norm: Literal["fused", "fp32-unfused"] = "fused"
    """RMSNorm kind, as the dense family's (:attr:`hyperdryrun.models.llama.LlamaArgs.norm`)."""
    fuse_qkv: bool = True
    """GQA: one ``wqkv`` projection split into q, k, v (torchtitan 0.3.0's qwen3) instead of ``wq``, ``wk``, ``wv``."""
    rope: Literal["per-layer", "shared"] = "per-layer"
    """RoPE table: one buffer per attention (torchtitan 0.3.0) or one of the model read by every layer (its 2024
    MoE models)."""
    rope_format: Literal["complex", "cos-sin"] = "complex"
    """How the table is held and applied: complex ``freqs_cis`` (torchtitan's llama3 and deepseek_v3) or real
    ``cos | sin`` rows with the rotate-half rotation in fp32 (its qwen3 ``CosSinRoPE``)."""
    moe_impl: Literal["torchtitan", "torchtitan-2024"] = "torchtitan"
    """Router and token reordering: ``torchtitan`` is 0.3.0's (gate under fp32 autocast, load-balancing buffers
    ``expert_bias_E`` and ``tokens_per_expert_E``, a boolean routing map, scores applied to the experts' outputs);
    ``torchtitan-2024`` the earlier one (fp32 cast of the gate's output, scores applied before the experts)."""

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    def attention_params(self) -> int:
        """Attention parameters of one layer, from the shapes."""
        d, h = self.dim, self.n_heads
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = d * h * qk  # one wq (q_lora_rank 0)
            if self.q_lora_rank:
                q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qk
            kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + h * self.v_head_dim * d
        hd = self.head_dim
        return 2 * d * h * hd + 2 * d * self.n_kv_heads * hd + (2 * hd if self.qk_norm else 0)

    def num_params(self, active: bool = False) -> int:
        """Parameter count from the shapes alone; ``active``: those one token uses (top_k routed experts)."""
        d = self.dim
        expert = 3 * d * self.moe_ffn_dim
        routed = self.top_k if active else self.num_experts
        moe_layer = (routed + self.num_shared_experts) * expert + d * self.num_experts
        n_moe = self.n_layers - self.n_dense_layers
        per_layer_common = self.attention_params() + 2 * d
        body = (
            self.n_layers * per_layer_common + self.n_dense_layers * 3 * d * self.ffn_dim + n_moe * moe_layer
        )
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return body + d + self.vocab_size * d + head

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> MoEArgs:
        return replace(self, **changes)


# Published shapes: Mixtral-8x7B (mistralai config.json), Qwen3-30B-A3B (Qwen config.json), DeepSeek-V3 (config.json,
# MTP module excluded); the small ones exist for tests.
MOE_PRESETS: dict[str, MoEArgs] = {
    "mixtral-8x7b": MoEArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
        num_experts=8, top_k=2, moe_ffn_dim=14336, rope_theta=1e6, route_norm=True,
    ),
    "qwen3-30b-a3b": MoEArgs(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144, vocab_size=151936,
        num_experts=128, top_k=8, moe_ffn_dim=768, head_dim_override=128, qk_norm=True,
        rope_theta=1e6, norm_eps=1e-6, route_norm=True, rope_format="cos-sin",
    ),
    "deepseek-v3": MoEArgs(
        dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_dim=18432, vocab_size=129280,
        num_experts=256, top_k=8, moe_ffn_dim=2048, num_shared_experts=1, n_dense_layers=3,
        attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, score_func="sigmoid", route_norm=True, norm_eps=1e-6,
    ),
    "moe-debug": MoEArgs(
        dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=512,
        num_experts=8, top_k=2, moe_ffn_dim=64, num_shared_experts=1, n_dense_layers=1,
    ),
    # torchtitan 0.3.0's qwen3 "debugmodel_moe" (--module qwen3 --config qwen3_moe_debug).
    "qwen3-moe-debug": MoEArgs(
        dim=256, n_layers=8, n_heads=16, n_kv_heads=8, ffn_dim=768, vocab_size=2048,
        num_experts=64, top_k=8, moe_ffn_dim=768, head_dim_override=128, qk_norm=True,
        rope_theta=1e6, norm_eps=1e-6, route_norm=True, rope_format="cos-sin",
    ),
    # torchtitan 0.3.0's deepseek_v3 "debugmodel" (--module deepseek_v3 --config deepseek_v3_debugmodel).
    "deepseek-v3-debug": MoEArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=16, ffn_dim=1024, vocab_size=2048,
        num_experts=8, top_k=3, moe_ffn_dim=256, num_shared_experts=2, n_dense_layers=1,
        attention="mla", q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    "moe-tiny": MoEArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256,
        num_experts=4, top_k=2, moe_ffn_dim=32,
    ),
}  # fmt: skip
