"""Target-device kernel semantics on a different simulation device.

Where the CPU kernel of an op allocates or saves for backward differently from the CUDA kernel of the same op, the
dry run must follow CUDA. ``DIFFERENCES`` is the audited list: ``hyperdryrun audit-kernels`` prints it and, with
``--reference``, re-runs the audit of :mod:`hyperdryrun.world.audit` (ops, new storages and saved tensors of common
layers on the simulation device against a reference recorded on fake "cuda" with a CUDA build of torch 2.13);
``tests/world/test_kernels.py`` asserts it layer by layer.

The SDPA backend a CUDA device picks depends on the GPU and the cuDNN in the torch build, which no GPU-less machine
can observe; :class:`CudaTarget` names them (default: the torch 2.13.0 PyPI wheel, CUDA 13.0 with cuDNN 9.20, on
an sm90 H100/H200) and :func:`cuda_sdpa_backend` applies torch 2.13's ``sdp_utils.cpp`` rules to it.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from hyperdryrun.trace.tracker import TrackingFakeTensorMode
from hyperdryrun.world.patches import Patch

_aten = torch.ops.aten


@dataclass(frozen=True)
class KernelDifference:
    """One place where a CPU kernel allocates or saves differently from the CUDA kernel of the same op."""

    layer: str
    cpu: str
    cuda: str
    handling: str
    handled_by: tuple[str, ...] = ()
    """Names of the patches (``Patch.name``) or fixed-up ops (``OUTPUT_FIXUPS``) that model it."""
    audit_layers: tuple[str, ...] = ()
    """Layers of :data:`hyperdryrun.world.audit.LAYERS` in which the audit finds it without ``handled_by``."""


@dataclass(frozen=True)
class CudaTarget:
    """The CUDA device and build whose kernel choice is simulated (SDPA depends on both)."""

    sm: tuple[int, int] = (9, 0)
    """Compute capability: (8, 0) A100, (9, 0) H100/H200, (10, 0) B200."""
    cudnn: int = 92000
    """Runtime cuDNN version as torch reports it (``torch.backends.cudnn.version()``); 9.20.0 ships with the
    torch 2.13.0 cu130 wheel (nvidia-cudnn-cu13 9.20.0.48)."""
    cuda: int = 13000
    """CUDA version the torch build was compiled with (13.0 for the default PyPI wheel)."""

    def as_dict(self) -> dict:
        """JSON-ready (lists, not tuples), so that a reference file's ``cuda_target`` compares equal."""
        return {**asdict(self), "sm": list(self.sm)}

    @property
    def prefers_cudnn(self) -> bool:
        """torch 2.13 ``check_prefer_cudnn_attention``: cuDNN SDPA goes first on sm90/sm10x with cuDNN > 9.15."""
        if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").lower() in ("1", "true", "on", "yes", "y"):
            return False
        major, minor = self.sm
        ok = self.cudnn > 91500 and major in (9, 10)
        return ok if self.cuda >= 13000 else ok and minor in (0, 3)


DEFAULT_CUDA_TARGET = CudaTarget()

DIFFERENCES: list[KernelDifference] = [
    KernelDifference(
        "storage allocation",
        "CPU allocator: exact bytes (64-byte aligned)",
        "CUDA caching allocator: every block rounded up to 512 B",
        "each block's size is rounded to 512 B when target_device is cuda (the tracker's alignment)",
    ),
    KernelDifference(
        "F.scaled_dot_product_attention (backend)",
        "_fused_sdp_choice_cpp: _scaled_dot_product_flash_attention_for_cpu for any float dtype, masks allowed; "
        "a CUDA build without a GPU picks math (S x S scores): no device properties",
        "select_sdp_backend (sdp_utils.cpp): cuDNN first on sm90/sm10x with cuDNN > 9.15 (bf16/fp16, head_dim "
        "<= 128 and % 8, GQA, masks), then flash (bf16/fp16, no mask, head_dim <= 256, GQA), then "
        "memory-efficient (fp32 too, masks, no GQA in 2.13), then math",
        "cuda_sdpa_backend applies the CUDA rules for CudaTarget (default sm90, cuDNN 9.20, CUDA 13.0) and the "
        "chosen fused op is called, so its outputs and saved tensors are recorded",
        ("scaled_dot_product_attention",),
        ("sdpa_causal_bf16_mha", "sdpa_causal_bf16_gqa", "sdpa_causal_fp32_mha", "sdpa_bool_mask_bf16"),
    ),
    KernelDifference(
        "F.scaled_dot_product_attention (composite)",
        "flash_for_cpu takes the mask as is and any head_dim",
        "attention.cpp: bool mask -> additive mask (logical_not + where; a 1-element device scalar, a host one "
        "for cuDNN); efficient pads an unaligned mask's last dim to 8; flash pads head_dim to a multiple of 8",
        "the same ops are issued on the simulation device",
        ("scaled_dot_product_attention",),
        ("sdpa_causal_bf16_hd100", "sdpa_bool_mask_fp32"),
    ),
    KernelDifference(
        "F.dropout (training)",
        "composite _dropout: bernoulli mask of the input's dtype, x * mask / (1-p)",
        "aten.native_dropout: one fused kernel, bool mask saved",
        "dropout is routed to aten.native_dropout",
        ("dropout",),
        ("dropout_bf16", "dropout_fp32"),
    ),
    KernelDifference(
        "F.rms_norm",
        "_fused_rms_norm is the composite on CPU: pow/mean/rsqrt/mul, saving three fp32 input-sized tensors",
        "_fused_rms_norm CUDA kernel: saves input and rstd (fp32, one per row); one _fused_rms_norm_backward",
        "F.rms_norm calls _fused_rms_norm below autograd with the CUDA derivative formula",
        ("rms_norm",),
        ("rms_norm_functional_fp32", "rms_norm_functional_bf16"),
    ),
    KernelDifference(
        "LayerNorm (bf16/fp16)",
        "native_layer_norm returns mean/rstd in the input dtype",
        "native_layer_norm returns mean/rstd in fp32 (accumulate type); autograd saves them",
        "the fake mode returns fp32 mean/rstd for native_layer_norm",
        ("native_layer_norm",),
        ("layernorm_bf16",),
    ),
    KernelDifference(
        "F.logsigmoid",
        "log_sigmoid_forward returns an input-sized buffer, saved for backward",
        "log_sigmoid_forward returns an empty buffer",
        "the fake mode returns an empty buffer for log_sigmoid_forward",
        ("log_sigmoid_forward",),
        ("logsigmoid_fp32",),
    ),
    KernelDifference(
        "softmax / log_softmax (fp16 input, dtype=float32)",
        "input converted to fp32 first (a full-size copy), then _softmax",
        "_softmax(half_to_float=True) reads fp16 directly (SoftMax.cpp, CUDA only)",
        "F.softmax / F.log_softmax with fp16 input and dtype=float32 call the half_to_float kernel",
        ("softmax", "log_softmax"),
        ("softmax_fp16_to_fp32", "log_softmax_fp16_to_fp32"),
    ),
    KernelDifference(
        "optimizer implementation",
        "torch's default on CPU tensors is the per-parameter for-loop",
        "torch's default on CUDA tensors is foreach (whole-list temporaries)",
        "the configured implementation (default foreach, as on CUDA) is passed explicitly; with foreach/fused "
        "unset, _default_to_fused_or_foreach counts the simulation device as a foreach device",
        ("_get_foreach_kernels_supported_devices",),
    ),
    KernelDifference(
        "optimizer implementation (fake parameters)",
        "any fake device: a FakeTensor parameter fails _default_to_fused_or_foreach's type(p) check: for-loop",
        "real CUDA parameters: foreach",
        "FakeTensor counts as a foreach-supported type",
        ("_foreach_supported_types",),
        ("adamw_default", "sgd_default"),
    ),
    KernelDifference(
        "BatchNorm",
        "native_batch_norm (CPU kernel)",
        "cudnn_batch_norm: the same output and statistics bytes, plus an empty reserve tensor saved; backward "
        "cudnn_batch_norm_backward",
        "not modelled: the bytes agree exactly, only the producing op's name differs",
        (),
        ("batchnorm_train_fp32", "batchnorm_eval_fp32"),
    ),
]
"""Audited differences; every other layer of the audit catalogue agrees exactly (ops, bytes, saved tensors)."""

_orig_sdpa = F.scaled_dot_product_attention
_orig_dropout = F.dropout
_orig_softmax = F.softmax
_orig_log_softmax = F.log_softmax
_orig_rms_norm = F.rms_norm
# torch 2.13 Context default: flash, efficient, math, cudnn, overrideable
DEFAULT_SDP_PRIORITY = [1, 2, 0, 3, 4]
CUDNN_SDP_PRIORITY = [3, 1, 2, 0]
_BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}


# ---------------------------------------------------------------------------------------------- SDPA
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


def _can_use_cudnn(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, t: CudaTarget) -> bool:
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


def _can_use_flash(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, t: CudaTarget) -> bool:
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


def _can_use_efficient(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, t: CudaTarget) -> bool:
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


def cuda_sdpa_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
    target: CudaTarget = DEFAULT_CUDA_TARGET,
) -> str:
    """The backend torch 2.13's CUDA ``select_sdp_backend`` picks on ``target``: cudnn, flash, efficient or math.

    Honours the ``torch.nn.attention.sdpa_kernel`` switches and priority order, which are process globals.
    """
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "math"
    order = [b for b in torch._C._get_sdp_priority_order() if b in _BACKEND_NAMES]
    if order == DEFAULT_SDP_PRIORITY[:4] and target.prefers_cudnn:
        order = CUDNN_SDP_PRIORITY
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


def cuda_scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``F.scaled_dot_product_attention`` as torch 2.13's ``attention.cpp`` runs it on a CUDA device."""
    backend = cuda_sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    requires_lse = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
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


# ---------------------------------------------------------------------------------------------- others
def cuda_dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as CUDA runs it: the fused ``native_dropout`` with a bool mask."""
    if training and 0.0 < p < 1.0 and input.numel() > 0 and not inplace:
        return torch.native_dropout(input, p, True)[0]
    return _orig_dropout(input, p, training, inplace)


def _half_to_float(x, dim, dtype) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and x.dtype == torch.float16
        and dtype == torch.float32
        and dim is not None
    )


def cuda_softmax(input, dim=None, _stacklevel=3, dtype=None):
    """``F.softmax`` as CUDA runs it: fp16 input with ``dtype=float32`` uses ``_softmax(half_to_float=True)``."""
    if _half_to_float(input, dim, dtype):
        return _aten._softmax(input, dim, True)
    return _orig_softmax(input, dim, _stacklevel, dtype)


def cuda_log_softmax(input, dim=None, _stacklevel=3, dtype=None):
    """``F.log_softmax`` as CUDA runs it (see :func:`cuda_softmax`)."""
    if _half_to_float(input, dim, dtype):
        return _aten._log_softmax(input, dim, True)
    return _orig_log_softmax(input, dim, _stacklevel, dtype)


class _FusedRMSNorm(torch.autograd.Function):
    """``_fused_rms_norm`` with its CUDA autograd formula (derivatives.yaml: saves input, weight and rstd; backward
    is one ``_fused_rms_norm_backward``); both ops run below autograd, so the fake mode sees them as single ops."""

    @staticmethod
    def forward(ctx, input, normalized_shape, weight, eps):
        with torch._C._AutoDispatchBelowAutograd():
            out, rstd = _aten._fused_rms_norm.default(input, normalized_shape, weight, eps)
        ctx.normalized_shape = normalized_shape
        ctx.has_weight = weight is not None
        ctx.save_for_backward(input, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        input, weight, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.has_weight and ctx.needs_input_grad[2]]
        with torch._C._AutoDispatchBelowAutograd():
            gi, gw = _aten._fused_rms_norm_backward.default(
                grad, input, ctx.normalized_shape, rstd, weight, mask
            )
        return gi, None, gw, None


def _plain(*tensors) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return all(t is None or type(t) in (torch.Tensor, torch.nn.Parameter, FakeTensor) for t in tensors)


def cuda_rms_norm(input, normalized_shape, weight=None, eps=None):
    """``F.rms_norm`` as CUDA runs it: the fused kernel unless input is complex or the weight's dtype differs."""
    if _plain(input, weight) and not input.is_complex() and (weight is None or weight.dtype == input.dtype):
        return _FusedRMSNorm.apply(input, list(normalized_shape), weight, eps)
    return _orig_rms_norm(input, normalized_shape, weight, eps)


def _fp32_stats(args, kwargs, out):
    """native_layer_norm: CUDA returns mean/rstd in the accumulate type (fp32 for fp16/bf16 input); the CPU kernel
    (and torch._refs.native_layer_norm for CPU) returns them in the input dtype."""
    result, mean, rstd = out
    if mean.dtype in (torch.float16, torch.bfloat16):
        mean = mean.new_empty(mean.shape, dtype=torch.float32)
        rstd = rstd.new_empty(rstd.shape, dtype=torch.float32)
    return result, mean, rstd


def _empty_buffer(args, kwargs, out):
    """log_sigmoid_forward: CUDA returns an empty buffer; CPU returns (and autograd saves) a full-size one."""
    result, buffer = out
    return result, buffer.new_empty((0,))


OUTPUT_FIXUPS = {
    _aten.native_layer_norm.default: _fp32_stats,
    _aten.log_sigmoid_forward.default: _empty_buffer,
}
"""Ops whose CPU kernel returns different outputs than the CUDA kernel (found in the audit and in the device
branches of torch 2.13's ``torch/_refs`` and ``torch/_decomp``): the simulation returns the CUDA outputs."""


class TargetFakeTensorMode(TrackingFakeTensorMode):
    """The tracking fake mode, with the outputs of ``OUTPUT_FIXUPS`` ops replaced by the CUDA kernel's (the
    replacement is what the tracker and autograd see: it is recorded as the op's own outputs)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        fix = OUTPUT_FIXUPS.get(func)
        if fix is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        kwargs = kwargs or {}
        tracker = self.tracker
        active = tracker is not None and tracker.active
        if active:
            tracker.begin_op()
        out = None
        try:
            out = fix(args, kwargs, FakeTensorMode.__torch_dispatch__(self, func, types, args, kwargs))
        finally:
            if active:
                tracker.end_op(func, args, kwargs, out)
        return out


def _foreach_devices(simulation_device: str):
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    def devices() -> list[str]:
        return [*_get_foreach_kernels_supported_devices(), simulation_device]

    return devices


def needs_target_kernels(target_device: str, simulation_device: str) -> bool:
    """Whether the simulation device's own kernel choice differs from the target's: always for a CUDA target
    simulated elsewhere, and for fake "cuda" on a build without a usable GPU (no device properties to choose by)."""
    if target_device != "cuda":
        return False
    return simulation_device != "cuda" or not torch.cuda.is_available()


def target_kernel_patches(target_device: str, simulation_device: str) -> list[Patch]:
    """Patches that make the simulation device follow the target device's kernels."""
    if target_device != "cuda":
        return []
    import torch.distributed.tensor  # noqa: F401  (its import appends DTensor to _foreach_supported_types)
    import torch.optim.optimizer as optim_module
    from torch._subclasses.fake_tensor import FakeTensor

    patches = [
        Patch(
            optim_module,
            "_foreach_supported_types",
            [*optim_module._foreach_supported_types, FakeTensor],
            "torch 2.13 _default_to_fused_or_foreach requires type(p) in (Tensor, Parameter); a fake parameter is a "
            "FakeTensor, so optimizers left at their default would run the for-loop instead of CUDA's foreach",
        )
    ]
    if not needs_target_kernels(target_device, simulation_device):
        return patches
    patches += [
        Patch(
            F,
            "scaled_dot_product_attention",
            cuda_scaled_dot_product_attention,
            "torch 2.13 picks the SDPA backend from the device: CPU -> _scaled_dot_product_flash_attention_for_cpu, "
            "CUDA without a GPU -> math; a CUDA GPU picks by sdp_utils.cpp rules",
        )
    ]
    if simulation_device != "cuda":
        patches += [
            Patch(
                F,
                "dropout",
                cuda_dropout,
                "torch 2.13 ATen dropout uses native_dropout only for CUDA/XPU tensors; CPU saves a dtype-sized mask",
            ),
            Patch(
                F,
                "rms_norm",
                cuda_rms_norm,
                "torch 2.13 rms_norm calls _fused_rms_norm, a CUDA kernel saving input and rstd; on CPU it is the "
                "composite (fp32 copies of the input saved)",
            ),
            Patch(
                F,
                "softmax",
                cuda_softmax,
                "torch 2.13 SoftMax.cpp: half_to_float only for CUDA tensors; CPU copies fp16 input to fp32 first",
            ),
            Patch(
                F,
                "log_softmax",
                cuda_log_softmax,
                "torch 2.13 SoftMax.cpp: half_to_float only for CUDA tensors; CPU copies fp16 input to fp32 first",
            ),
            Patch(
                optim_module,
                "_get_foreach_kernels_supported_devices",
                _foreach_devices(simulation_device),
                "torch 2.13 optimizers default to foreach only on cuda/xpu/mtia tensors, for-loop on CPU",
            ),
        ]
    return patches
