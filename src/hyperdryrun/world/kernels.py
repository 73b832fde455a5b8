"""Target-device kernel semantics on a different simulation device.

Where the CPU kernel of an op allocates or saves for backward differently from the CUDA kernel of the same op, the
dry run must follow CUDA. ``DIFFERENCES`` is the audited list (see ``hyperdryrun audit-kernels`` and
``tests/world/test_kernels.py``, which compare the ops and saved tensors of common layers on the simulation device
against the CUDA kernels' derivative formulas in ``tools/autograd/derivatives.yaml`` of torch 2.13).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyperdryrun.world.patches import Patch

_aten = torch.ops.aten


@dataclass(frozen=True)
class KernelDifference:
    layer: str
    cpu: str
    cuda: str
    handling: str


DIFFERENCES: list[KernelDifference] = [
    KernelDifference(
        "storage allocation",
        "CPU allocator: exact bytes (64-byte aligned)",
        "CUDA caching allocator: every block rounded up to 512 B",
        "each block's size is rounded to 512 B when target_device is cuda",
    ),
    KernelDifference(
        "F.scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention_for_cpu (any float dtype, masks allowed)",
        "flash (fp16/bf16, no mask, GQA native) > memory-efficient (mask, fp32, no GQA) > math (S x S scores)",
        "the CUDA backend is chosen by the CUDA rules and its op is called, so its saved tensors are recorded",
    ),
    KernelDifference(
        "F.dropout (training)",
        "composite: bernoulli mask of the input's dtype, x * mask / (1-p)",
        "aten.native_dropout: one fused kernel, bool mask saved",
        "dropout is routed to aten.native_dropout",
    ),
    KernelDifference(
        "optimizer implementation",
        "torch's default on CPU tensors is the per-parameter for-loop",
        "torch's default on CUDA tensors is foreach (whole-list temporaries)",
        "the configured implementation (default foreach, as on CUDA) is passed explicitly",
    ),
]
"""Audited differences. Layers found to agree (same saved tensors on both): Linear/mm/addmm, Embedding,
RMSNorm written in plain torch, F.rms_norm's composite, LayerNorm (mean, rstd in fp32), SiLU/GELU, softmax,
log_softmax + nll_loss (cross entropy), element-wise ops; see the audit test."""

_orig_sdpa = F.scaled_dot_product_attention
_orig_dropout = F.dropout


def cuda_sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask, dropout_p: float) -> str:
    """The backend CUDA's ``select_sdp_backend`` picks on sm80+ (priority flash > efficient > math)."""
    head_dim = q.shape[-1]
    same_dims = k.shape[-1] == head_dim and v.shape[-1] == head_dim
    gqa = q.dim() == 4 and k.shape[-3] != q.shape[-3]
    if (
        q.dtype in (torch.float16, torch.bfloat16)
        and attn_mask is None
        and same_dims
        and head_dim <= 256
        and q.dim() == 4
    ):
        return "flash"
    if q.dtype in (torch.float16, torch.bfloat16, torch.float32) and same_dims and not gqa and q.dim() == 4:
        return "efficient"
    return "math"


def cuda_scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``F.scaled_dot_product_attention`` as a CUDA build would run it (works on fake CPU tensors)."""
    backend = cuda_sdpa_backend(query, key, value, attn_mask, dropout_p)
    if backend == "flash":
        return _aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    if backend == "efficient":
        bias = attn_mask
        if is_causal and bias is None:
            return _aten._scaled_dot_product_efficient_attention(
                query, key, value, None, True, dropout_p, True, scale=scale
            )[0]
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill_(~bias, -math.inf)
        return _aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, dropout_p, is_causal, scale=scale
        )[0]
    return _aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]


def cuda_dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as CUDA runs it: the fused ``native_dropout`` with a bool mask."""
    if training and 0.0 < p < 1.0 and input.numel() > 0 and not inplace:
        return torch.native_dropout(input, p, True)[0]
    return _orig_dropout(input, p, training, inplace)


def target_kernel_patches(target_device: str, simulation_device: str) -> list[Patch]:
    """Patches that make the simulation device follow the target device's kernels."""
    if target_device == simulation_device or target_device != "cuda":
        return []
    return [
        Patch(
            F,
            "scaled_dot_product_attention",
            cuda_scaled_dot_product_attention,
            "torch 2.13 CPU dispatches SDPA to _scaled_dot_product_flash_attention_for_cpu; CUDA picks by its rules",
        ),
        Patch(
            F,
            "dropout",
            cuda_dropout,
            "torch 2.13 ATen dropout uses native_dropout only for CUDA/XPU tensors; CPU saves a dtype-sized mask",
        ),
    ]
