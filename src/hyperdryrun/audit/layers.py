"""The layer catalogue: common layers (linear, norms, activations, softmax, losses, SDPA variants, a Llama block,
optimizers) at small shapes, each a builder that makes its inputs on a given (fake) device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Case:
    """What one layer runs: ``forward()`` returns the output to differentiate, or ``step()`` runs on its own."""

    forward: Callable[[], torch.Tensor] | None = None
    step: Callable[[], None] | None = None
    keep: list[Any] = field(default_factory=list)


Builder = Callable[[torch.device], Case]
LAYERS: dict[str, Builder] = {}
"""The catalogue: layer name -> a builder that makes the layer's case on a (fake) device."""


def layer(name: str) -> Callable[[Builder], Builder]:
    """Decorator: add the builder to :data:`LAYERS` under ``name``."""

    def register(fn: Builder) -> Builder:
        LAYERS[name] = fn
        return fn

    return register


def _module(factory: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Build on meta outside the fake mode and materialise on the (fake) device, as the engine does."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.device("meta"):
        mod = factory().to(dtype)
    return mod.to_empty(device=device)


def _x(device: torch.device, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_()


B, S, D = 2, 48, 64


def _unary(fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> Builder:
    def build(device: torch.device) -> Case:
        x = _x(device, B, S, D, dtype=dtype)
        return Case(forward=lambda: fn(x), keep=[x])

    return build


def _linear(bias: bool, dtype: torch.dtype) -> Builder:
    def build(device: torch.device) -> Case:
        mod = _module(lambda: nn.Linear(D, 96, bias=bias), device, dtype)
        x = _x(device, B, S, D, dtype=dtype)
        return Case(forward=lambda: mod(x), keep=[mod, x])

    return build


layer("linear_bias_fp32")(_linear(True, torch.float32))
layer("linear_bias_bf16")(_linear(True, torch.bfloat16))
layer("linear_nobias_bf16")(_linear(False, torch.bfloat16))


@layer("embedding_fp32")
def _embedding(device: torch.device) -> Case:
    mod = _module(lambda: nn.Embedding(256, D), device, torch.float32)
    idx = torch.randint(0, 256, (B, S), device=device)
    return Case(forward=lambda: mod(idx), keep=[mod, idx])


def _llama_rmsnorm(dtype: torch.dtype) -> Builder:
    def build(device: torch.device) -> Case:
        from hyperdryrun.models.llama import RMSNorm

        mod = _module(lambda: RMSNorm(D, 1e-5), device, dtype)
        x = _x(device, B, S, D, dtype=dtype)
        return Case(forward=lambda: mod(x), keep=[mod, x])

    return build


layer("rmsnorm_plain_bf16")(_llama_rmsnorm(torch.bfloat16))


def _f_rms_norm(dtype: torch.dtype) -> Builder:
    def build(device: torch.device) -> Case:
        w = torch.ones(D, device=device, dtype=dtype).requires_grad_()
        x = _x(device, B, S, D, dtype=dtype)
        return Case(forward=lambda: F.rms_norm(x, (D,), w, 1e-5), keep=[w, x])

    return build


layer("rms_norm_functional_fp32")(_f_rms_norm(torch.float32))
layer("rms_norm_functional_bf16")(_f_rms_norm(torch.bfloat16))


@layer("rms_norm_sequence_parallel_bf16")
def _rms_norm_sequence_parallel(device: torch.device) -> Case:
    """``nn.RMSNorm`` under tensor parallelism's sequence parallel (a DTensor sharded on the sequence, as in every
    TP+SP decoder block), on a one-rank mesh of the device: the kernel choice for a DTensor input."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    with unset_fake_temporarily():  # mesh coordinates are computed with real tensor ops
        mesh = DeviceMesh(device.type, [0])
    mod = _module(lambda: nn.RMSNorm(D), device, torch.bfloat16)
    mod = parallelize_module(mod, mesh, SequenceParallel(sequence_dim=1))
    x = _x(device, B, S, D)
    return Case(forward=lambda: mod(x).to_local(), keep=[mod, x, mesh])


def _layernorm(dtype: torch.dtype) -> Builder:
    def build(device: torch.device) -> Case:
        mod = _module(lambda: nn.LayerNorm(D), device, dtype)
        x = _x(device, B, S, D, dtype=dtype)
        return Case(forward=lambda: mod(x), keep=[mod, x])

    return build


layer("layernorm_fp32")(_layernorm(torch.float32))
layer("layernorm_bf16")(_layernorm(torch.bfloat16))


def _norm2d(factory: Callable[[], nn.Module], dtype: torch.dtype, train: bool = True) -> Builder:
    def build(device: torch.device) -> Case:
        mod = _module(factory, device, dtype).train(train)
        for name, buf in list(mod.named_buffers()):  # to_empty leaves running statistics uninitialised
            setattr(mod, name, torch.zeros_like(buf))
        x = _x(device, B, 32, 8, 8, dtype=dtype)
        return Case(forward=lambda: mod(x), keep=[mod, x])

    return build


layer("batchnorm_train_fp32")(_norm2d(lambda: nn.BatchNorm2d(32), torch.float32))
layer("batchnorm_eval_fp32")(_norm2d(lambda: nn.BatchNorm2d(32), torch.float32, train=False))
layer("groupnorm_fp32")(_norm2d(lambda: nn.GroupNorm(4, 32), torch.float32))
layer("groupnorm_bf16")(_norm2d(lambda: nn.GroupNorm(4, 32), torch.bfloat16))
layer("silu_bf16")(_unary(F.silu, torch.bfloat16))
layer("gelu_bf16")(_unary(F.gelu, torch.bfloat16))
layer("gelu_tanh_bf16")(_unary(lambda x: F.gelu(x, approximate="tanh"), torch.bfloat16))
layer("softmax_fp32")(_unary(lambda x: F.softmax(x, -1), torch.float32))
layer("softmax_bf16")(_unary(lambda x: F.softmax(x, -1), torch.bfloat16))
layer("softmax_fp16_to_fp32")(_unary(lambda x: F.softmax(x, -1, dtype=torch.float32), torch.float16))
layer("softmax_bf16_to_fp32")(_unary(lambda x: F.softmax(x, -1, dtype=torch.float32), torch.bfloat16))
layer("log_softmax_fp32")(_unary(lambda x: F.log_softmax(x, -1), torch.float32))
layer("log_softmax_fp16_to_fp32")(_unary(lambda x: F.log_softmax(x, -1, dtype=torch.float32), torch.float16))
layer("logsigmoid_fp32")(_unary(F.logsigmoid, torch.float32))
layer("dropout_bf16")(_unary(lambda x: F.dropout(x, 0.1, training=True), torch.bfloat16))
layer("dropout_fp32")(_unary(lambda x: F.dropout(x, 0.25, training=True), torch.float32))


def _cross_entropy(dtype: torch.dtype, upcast: bool) -> Builder:
    def build(device: torch.device) -> Case:
        vocab = 256
        logits = _x(device, B * S, vocab, dtype=dtype)
        labels = torch.randint(0, vocab, (B * S,), device=device)

        def fwd() -> torch.Tensor:
            return F.cross_entropy(logits.float() if upcast else logits, labels)

        return Case(forward=fwd, keep=[logits, labels])

    return build


layer("cross_entropy_fp32")(_cross_entropy(torch.float32, False))
layer("cross_entropy_bf16")(_cross_entropy(torch.bfloat16, False))
layer("cross_entropy_bf16_upcast")(_cross_entropy(torch.bfloat16, True))


def _sdpa(
    heads: int = 8,
    kv_heads: int | None = None,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    mask: bool = False,
    causal: bool = True,
    dropout: float = 0.0,
) -> Builder:
    def build(device: torch.device) -> Case:
        kvh = kv_heads or heads
        q = _x(device, B, heads, S, head_dim, dtype=dtype)
        k = _x(device, B, kvh, S, head_dim, dtype=dtype)
        v = _x(device, B, kvh, S, head_dim, dtype=dtype)
        m = torch.ones(S, S, device=device, dtype=torch.bool).tril() if mask else None

        def fwd() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=m,
                dropout_p=dropout,
                is_causal=causal and not mask,
                enable_gqa=kvh != heads,
            )

        return Case(forward=fwd, keep=[q, k, v, m])

    return build


layer("sdpa_causal_bf16_mha")(_sdpa())
layer("sdpa_causal_bf16_gqa")(_sdpa(kv_heads=2))
layer("sdpa_causal_fp32_mha")(_sdpa(dtype=torch.float32))
layer("sdpa_causal_fp32_gqa")(_sdpa(kv_heads=2, dtype=torch.float32))
layer("sdpa_bool_mask_bf16")(_sdpa(mask=True))
layer("sdpa_bool_mask_fp32")(_sdpa(mask=True, dtype=torch.float32))
layer("sdpa_causal_bf16_hd256")(_sdpa(heads=2, head_dim=256))
layer("sdpa_causal_bf16_hd320")(_sdpa(heads=2, head_dim=320))
layer("sdpa_causal_bf16_hd100")(_sdpa(heads=2, head_dim=100))
layer("sdpa_causal_bf16_dropout")(_sdpa(dropout=0.125))


@layer("llama_block_bf16")
def _llama_block(device: torch.device) -> Case:
    from hyperdryrun.models.llama import PRESETS, TransformerBlock, rope_cache

    # The block as recorded on a GPU in tests/audit/fixtures/cuda_kernels.json: torchtitan's 2024 layout (unfused fp32
    # RMSNorm, separate q/k/v, the model's shared RoPE table), not the 0.3.0 preset's defaults.
    args = PRESETS["llama-tiny"].replace(norm="fp32-unfused", fuse_qkv=False, rope="shared")
    mod = _module(lambda: TransformerBlock(args, S), device, torch.bfloat16)
    rope = rope_cache(args.head_dim, S, args.rope_theta).to(device)
    x = _x(device, B, S, args.dim)
    return Case(forward=lambda: mod(x, rope), keep=[mod, rope, x])


def _optimizer(factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> Builder:
    def build(device: torch.device) -> Case:
        params = [nn.Parameter(torch.empty(n, device=device)) for n in (D * 96, 96, 1000)]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = factory(params)
        opt.step()  # steady state: states exist, as from step 2 onwards
        return Case(step=opt.step, keep=[params, opt])

    return build


layer("adamw_foreach")(_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)))
layer("adamw_fused")(_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)))
layer("adamw_default")(_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-3)))
layer("adam_foreach")(_optimizer(lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True)))
layer("sgd_foreach")(_optimizer(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True)))
layer("sgd_fused")(_optimizer(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True)))
layer("sgd_default")(_optimizer(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)))


__all__ = ["LAYERS", "Case", "layer"]
