"""``F.scaled_dot_product_attention`` as torch runs it on a CUDA GPU, for a simulation on another device (torch
2.13 ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` and ``attention.cpp``).

:func:`cuda_sdpa_backend` is the backend choice of ``select_sdp_backend`` (``priority_order``,
``can_use_cudnn_attention``, ``can_use_flash_attention``, ``can_use_mem_efficient_attention``) applied to a target
(a :class:`hyperdryrun.world.cuda_target.CudaTarget`: ``sm``, ``cudnn``, ``prefers_cudnn``), which no GPU-less
machine can observe; :func:`cuda_scaled_dot_product_attention` is the composite of attention.cpp around it (mask
conversion, padding) calling the chosen fused op, so that its outputs and saved tensors are what gets recorded.
:mod:`hyperdryrun.world.sdpa` binds them to the default target.

Read from pytorch/pytorch sdp_utils.cpp at commit 001f694a (main, later than v2.13.0, whose source is not stored
here: its memory-efficient GQA came after 2.13, see ``_can_use_efficient``): ``check_prefer_cudnn_attention``
(l. 93-120; with CUDA >= 13: cuDNN > 9.15 and major 9 or 10, l. 109, :func:`prefers_cudnn`) and
``priority_order`` (l. 123-135). ``tests/world/test_sdpa.py`` checks the choice against torch's own on a GPU-less
CUDA build where it can.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F

_aten = torch.ops.aten
# torch 2.13 Context default: flash, efficient, math, cudnn, overrideable
DEFAULT_SDP_PRIORITY = [1, 2, 0, 3, 4]
CUDNN_SDP_PRIORITY = [3, 1, 2, 0]
_BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}


def _dense_heads_ok(q, k, v, enable_gqa: bool, supports_gqa: bool, requires_same_num_heads: bool) -> bool:
    """sdp_utils_cpp.h ``check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>``."""
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if enable_gqa and supports_gqa:
        if requires_same_num_heads and hk != hv:
            return False
        return hq % hk == 0 and (requires_same_num_heads or hq % hv == 0)
    return hq == hk == hv


def _stride1(q, k, v, attn_mask, ignore_singleton: bool) -> bool:
    ok = all(t.stride(-1) == 1 for t in (q, k, v)) or (ignore_singleton and q.shape[-1] == 1)
    return ok and (attn_mask is None or attn_mask.stride(-1) == 1)


def _mask_shape_ok(q, k, attn_mask) -> bool:
    """sdp_utils_cpp.h ``check_attn_mask_shape`` (cuDNN): 2-D (L|1, S|1) or 4-D (B|1, H|1, L|1, S|1)."""
    if attn_mask is None:
        return True
    L, S = q.shape[2], k.shape[2]
    if attn_mask.shape[-2] not in (L, 1) or attn_mask.shape[-1] not in (S, 1):
        return False
    if attn_mask.dim() == 2:
        return True
    return (
        attn_mask.dim() == 4
        and attn_mask.shape[0] in (1, q.shape[0])
        and attn_mask.shape[1] in (1, q.shape[1])
    )


def _can_use_cudnn(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, t: Any) -> bool:
    if not torch.backends.cuda.cudnn_sdp_enabled() or t.cudnn < 90000:
        return False
    if dropout_p > 0.0 and 91100 < t.cudnn < 91400:
        return False
    if (
        torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled()
    ):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not _mask_shape_ok(q, k, attn_mask):
        return False
    if not (8, 0) <= t.sm <= (12, 1) or dropout_p * 16.0 != math.floor(dropout_p * 16.0):
        return False
    if q.shape[-2] == 0 or k.shape[-2] == 0 or not _stride1(q, k, v, attn_mask, True):
        return False
    if not _dense_heads_ok(q, k, v, enable_gqa, supports_gqa=True, requires_same_num_heads=False):
        return False
    b, h, s_q, d_qk = q.shape
    s_k, d_v = k.shape[2], v.shape[3]
    if b > 65535 or h > 65535:
        return False
    sm90_or_10x = t.sm == (9, 0) or t.sm[0] == 10
    unsupported_sm107 = t.sm == (10, 7) and t.cudnn <= 92500
    # torch 2.13 also needs cuDNN frontend >= 1.24 for head_dim 256 (not knowable here); cuDNN > 9.22 is assumed
    # to come with it.
    supports_d256 = sm90_or_10x and not unsupported_sm107 and t.cudnn > 92200
    limit = 128
    if supports_d256:
        limit = 256
    elif sm90_or_10x and t.cudnn >= 91100 and d_qk == 192 and d_v == 128:
        limit = 192
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8 or s_k == 1 or (dropout_p != 0.0 and s_q == 1):
        return False
    requires_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if supports_d256 and requires_grad:
        return (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))
    return True


def _can_use_flash(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, t: Any) -> bool:
    if not torch.backends.cuda.flash_sdp_enabled() or attn_mask is not None:
        return False
    d = q.shape[-1]
    if not (k.shape[-1] == d and v.shape[-1] == d and d <= 256) or not (8, 0) <= t.sm <= (12, 1):
        return False
    requires_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if requires_grad and ((8, 6) <= t.sm <= (8, 9) or (12, 0) <= t.sm <= (12, 1)):
        if not (d <= 192 or (dropout_p == 0.0 and d > 224)):
            return False
    if is_causal and q.shape[-2] != k.shape[-2]:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not _dense_heads_ok(q, k, v, enable_gqa, supports_gqa=True, requires_same_num_heads=True):
        return False
    return q.shape[-2] > 0 and k.shape[-2] > 0 and _stride1(q, k, v, attn_mask, True)


def _can_use_efficient(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, t: Any) -> bool:
    if not torch.backends.cuda.mem_efficient_sdp_enabled() or not (5, 0) <= t.sm <= (12, 1):
        return False
    half = q.dtype in (torch.float16, torch.bfloat16)
    # minimum_gemm_alignment: tensor cores on sm80+ (and sm70+ for half): 128 bits per row.
    tensor_cores = t.sm[0] >= 8 or (t.sm[0] >= 7 and half)
    align = max(4 if t.sm[0] >= 8 else 1, (128 // (16 if half else 32)) if tensor_cores else 1)
    dq, dv = q.shape[-1], v.shape[-1]
    if not (k.shape[-1] == dq and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return False
    if t.sm[0] >= 8 and any(
        (x.storage_offset() * x.element_size()) % (align * x.element_size()) for x in (q, k, v)
    ):
        return False
    if q.shape[-2] == 0 or k.shape[-2] == 0 or not _stride1(q, k, v, attn_mask, False):
        return False
    # No GQA for memory-efficient attention in torch 2.13: its backward (and the meta kernel) return key/value
    # gradients with the query's head count; native GQA came later (pytorch/pytorch#191085).
    if not _dense_heads_ok(q, k, v, enable_gqa, supports_gqa=False, requires_same_num_heads=True):
        return False
    allowed = (
        (torch.float16, torch.float32, torch.bfloat16) if t.sm[0] >= 8 else (torch.float16, torch.float32)
    )
    return q.dtype in allowed


def _priority(target: Any) -> list[int]:
    """sdp_utils.cpp ``priority_order``: torch's current order, or cuDNN first where the default order is in force
    and the target prefers cuDNN."""
    order = [b for b in torch._C._get_sdp_priority_order() if b in _BACKEND_NAMES]
    return CUDNN_SDP_PRIORITY if order == DEFAULT_SDP_PRIORITY[:4] and target.prefers_cudnn else order


def sdpa_priority(target: Any) -> tuple[str, ...]:
    """The SDPA backends torch 2.13 tries in turn on ``target`` (first usable wins), e.g. cudnn first on sm90."""
    return tuple(_BACKEND_NAMES[b] for b in _priority(target))


def cuda_sdpa_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    target: Any,
) -> str:
    """The backend torch 2.13's CUDA ``select_sdp_backend`` picks on ``target``: cudnn, flash, efficient or math.

    Honours the ``torch.nn.attention.sdpa_kernel`` switches and priority order, which are process globals.
    """
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "math"
    order = _priority(target)
    checks = {3: _can_use_cudnn, 1: _can_use_flash, 2: _can_use_efficient}
    for b in order:
        if b == 0:
            if torch.backends.cuda.math_sdp_enabled():
                return "math"
        elif checks[b](q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, target):
            return _BACKEND_NAMES[b]
    raise RuntimeError("No available kernel. Aborting execution. (simulated CUDA SDPA backend selection)")


def _host_scalar(value: float, dtype: torch.dtype) -> torch.Tensor:
    """A real CPU 0-d tensor, made outside any fake mode: on CUDA it is host memory, not a device block."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.scalar_tensor(value, dtype=dtype)


def _bool_to_additive(mask: torch.Tensor | None, dtype: torch.dtype, cudnn: bool) -> torch.Tensor | None:
    """attention.cpp ``convert_boolean_attn_mask`` (fill -inf, 0.0 on the mask's device) and its cuDNN variant
    (fill -65504, 0.0 a host scalar; both fills are host scalars here so that no device block appears)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    if cudnn:
        return torch.where(mask.logical_not(), _host_scalar(-65504.0, dtype), _host_scalar(0.0, dtype))
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), -math.inf, zero)


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    r = x.shape[-1] % multiple
    return x if r == 0 else F.pad(x, (0, multiple - r))


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """attention.cpp ``preprocess_mask``: pad an unaligned mask's last dim to 8, slice back, expand to 4-D."""
    aligned = all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1)) and mask.stride(-1) == 1
    if not aligned:
        last = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _spec(x: torch.Tensor | None) -> tuple[Any, ...] | None:
    """What the backend checks read of a tensor, as Python constants: shape, stride, dtype, requires_grad. The
    storage offset is taken as 0: dynamo cannot read it (an int from a torch call), and inside a compiled region the
    layout of an intermediate is Inductor's to choose (its fallback for a fused attention op copies an unaligned
    input)."""
    if x is None:
        return None
    return (tuple(x.shape), tuple(x.stride()), 0, x.dtype, x.requires_grad)


def _meta(spec: tuple[Any, ...] | None) -> torch.Tensor | None:
    """A meta tensor with ``spec``'s metadata (no memory)."""
    if spec is None:
        return None
    shape, stride, offset, dtype, requires_grad = spec
    extent = (
        offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) if all(shape) else offset
    )
    t = torch.empty(max(extent, 1), dtype=dtype, device="meta").as_strided(shape, stride, offset)
    return t.requires_grad_() if requires_grad else t


@torch.compiler.assume_constant_result
def _compiled_backend(
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    target: Any,
    grad: bool,
) -> str:
    """:func:`cuda_sdpa_backend` of tensors described by :func:`_spec`: dynamo cannot trace the choice itself
    (``torch._C._get_sdp_priority_order`` is a builtin it skips, which broke every compiled attention block into
    eager frames), so it calls this at trace time and keeps the answer as a constant of the graph."""
    with torch.set_grad_enabled(grad):
        return cuda_sdpa_backend(
            _meta(q), _meta(k), _meta(v), _meta(mask), dropout_p, is_causal, enable_gqa, target
        )


def cuda_scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask,
    dropout_p,
    is_causal,
    scale,
    enable_gqa,
    *,
    target: Any,
):
    """``F.scaled_dot_product_attention`` as torch 2.13's ``attention.cpp`` runs it on ``target``. Inside a region
    torch.compile traces, the backend is chosen from the tensors' metadata as a constant of the graph
    (:func:`_compiled_backend`), so that dynamo puts the chosen fused op in the graph, as the CUDA composite does when
    AOTAutograd decomposes it."""
    if torch.compiler.is_compiling():
        backend = _compiled_backend(
            _spec(query),
            _spec(key),
            _spec(value),
            _spec(attn_mask),
            dropout_p,
            is_causal,
            enable_gqa,
            target,
            torch.is_grad_enabled(),
        )
    else:
        backend = cuda_sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, target)
    requires_lse = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    )
    if backend == "cudnn":
        mask = _bool_to_additive(attn_mask, query.dtype, cudnn=True)
        return _aten._scaled_dot_product_cudnn_attention(
            query, key, value, mask, requires_lse, dropout_p, is_causal, False, scale=scale
        )[0]
    mask = _bool_to_additive(attn_mask, query.dtype, cudnn=False)
    if backend == "flash":
        head_dim = query.shape[-1]
        og_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        q, k, v = (_pad_last(x, 8) for x in (query, key, value))
        out = _aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=og_scale)[
            0
        ]
        return out[..., :head_dim] if out.shape[-1] != head_dim else out
    if backend == "efficient":
        if mask is not None:
            mask = _preprocess_mask(mask, query, key)
        return _aten._scaled_dot_product_efficient_attention(
            query, key, value, mask, requires_lse, dropout_p, is_causal, scale=scale
        )[0]
    return _aten._scaled_dot_product_attention_math(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]


def prefers_cudnn(sm: tuple[int, int], cudnn: int, cuda: int) -> bool:
    """torch 2.13 ``check_prefer_cudnn_attention``: cuDNN SDPA goes first on sm90/sm10x with cuDNN > 9.15 (with a
    CUDA < 13 build only on sm90 and sm103); ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` turns it off."""
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").lower() in ("1", "true", "on", "yes", "y"):
        return False
    major, minor = sm
    ok = cudnn > 91500 and major in (9, 10)
    return ok if cuda >= 13000 else ok and minor in (0, 3)
