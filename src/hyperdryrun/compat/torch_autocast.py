"""CUDA autocast's op lists and the autocast internals a CUDA target on fake "cpu" tensors replaces (torch 2.13
``aten/src/ATen/autocast_mode.cpp`` / ``autocast_mode.h``, ``torch/amp/autocast_mode.py``), by release.

The lists are torch 2.13's ``TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m)`` registrations; 2.11, 2.12 and 2.14 register
the same (``tests/world/test_autocast.py`` compares :data:`CUDA_POLICIES` with the AutocastCUDA registrations of
the installed torch, and each op with torch's own AutocastCUDA kernel on fake "cuda", so a release that changes
them fails there). :mod:`hyperdryrun.world.autocast` holds the casts themselves (``CastRules``, the kernels).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hyperdryrun.patches import Patch

LOWER_PRECISION_FP = (
    "_convolution.deprecated",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
)
"""``AT_FORALL_LOWER_PRECISION_FP`` plus the two cuDNN convolutions registered next to it: every floating input
is cast to the autocast dtype."""

FP32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)
"""``AT_FORALL_FP32``: every floating input (other than fp64) is cast to fp32."""

FP32_SET_OPT_DTYPE = (
    "prod",
    "prod.dim_int",
    "softmax.int",
    "log_softmax.int",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
)
"""``AT_FORALL_FP32_SET_OPT_DTYPE`` (the overloads torch 2.13 registers): if the first argument is eligible and no
``dtype`` is given, ``dtype=float32``; an explicit dtype is kept (``cross_entropy`` passes its input's)."""

FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}
"""``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``: redispatch to the overload with ``dtype``, fp32 when the first
argument is eligible, else its own dtype."""

PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
)
"""``AT_FORALL_PROMOTE``: run in the widest floating type among the inputs (fp32 if any is fp32)."""

BANNED = ("binary_cross_entropy",)
"""``binary_cross_entropy_banned``: raises under CUDA autocast."""

CUDA_POLICIES: dict[str, str] = {
    **dict.fromkeys(LOWER_PRECISION_FP, "lower_precision_fp"),
    **dict.fromkeys(FP32, "fp32"),
    **dict.fromkeys(FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
    **dict.fromkeys(FP32_APPEND_DTYPE, "fp32_append_dtype"),
    **dict.fromkeys(PROMOTE, "promote"),
    **dict.fromkeys(BANNED, "banned"),
}
"""aten op (``name`` or ``name.overload``) -> its cast policy under CUDA autocast in torch 2.13."""

BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)

_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutocastCUDA
)
"""``WrapFunction_`` excludes every autocast key while it casts and redispatches."""
_OVERRIDE_WARNING = "(?s).*Overriding a previously registered kernel"


def _autocast_class() -> type:
    from torch.amp.autocast_mode import autocast

    return autocast


def autocast_patches(
    rules: Any,
    bf16_supported: bool,
    with_policy: Callable[[Callable[..., Any], str, Any], Callable[..., Any]],
) -> list[Patch]:
    """``torch.autocast`` for device "cuda" enabled and carried by CPU autocast; the cache clear (``rules.cache``,
    the simulated kernels' weight cache, cleared with torch's); the Python rewrites of aten ops in CUDA's lists with
    those ops' casts (``with_policy(fn, policy, rules)``).

    torch 2.11 to 2.14 ``torch/amp/autocast_mode.py``: ``autocast.__init__`` disables ``autocast("cuda")`` when
    CUDA is unavailable and checks bf16 support; ``__exit__`` calls ``torch.clear_autocast_cache`` at the
    outermost exit."""
    cls = _autocast_class()
    init, enter, exit_ = cls.__init__, cls.__enter__, cls.__exit__
    clear = torch.clear_autocast_cache

    def __init__(self, device_type: str, dtype=None, enabled: bool = True, cache_enabled=None) -> None:
        if device_type not in ("cuda", rules.device) or torch._jit_internal.is_scripting():
            init(self, device_type, dtype, enabled, cache_enabled)
            return
        # A region for the simulation device's type (code that asks its tensors, torch.autocast(x.device.type,
        # ...)) is the region a GPU opens for its CUDA tensors: CPU autocast would refuse fp32 and disable itself.
        device_type = "cuda"
        # enabled=False skips exactly the CUDA-only checks (availability, which would disable it with a warning,
        # and bf16 support, checked here against the target GPU); the rest is set as torch sets it.
        init(self, device_type, dtype, False, cache_enabled)
        if enabled and self.fast_dtype == torch.bfloat16 and not bf16_supported:
            raise RuntimeError(
                "Current CUDA Device does not support bfloat16. Please switch dtype to float16."
            )
        self._enabled = enabled

    def __enter__(self):
        out = enter(self)
        if getattr(self, "device", None) == "cuda" and not torch._jit_internal.is_scripting():
            self._hdr_cpu = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
            torch.set_autocast_enabled("cpu", self._enabled)
            torch.set_autocast_dtype("cpu", self.fast_dtype)
        return out

    def __exit__(self, exc_type, exc_val, exc_tb):
        out = exit_(self, exc_type, exc_val, exc_tb)
        saved = self.__dict__.pop("_hdr_cpu", None)
        if saved is not None:
            torch.set_autocast_enabled("cpu", saved[0])
            torch.set_autocast_dtype("cpu", saved[1])
        return out

    def clear_autocast_cache() -> None:
        rules.cache.clear()
        clear()

    why = (
        "torch 2.13 autocast.__init__ disables autocast('cuda') with a warning when CUDA is not available, and the "
        "AutocastCUDA key never fires on the simulation's 'cpu' tensors: the region runs on AutocastCPU, whose "
        "kernels are CUDA's lists while the world lasts; a region for the simulation device's type is CUDA's "
        "(CPU autocast refuses an fp32 dtype and disables itself)"
    )
    patches = [
        Patch(cls, "__init__", __init__, why),
        Patch(cls, "__enter__", __enter__, why),
        Patch(cls, "__exit__", __exit__, why),
        Patch(
            torch,
            "clear_autocast_cache",
            clear_autocast_cache,
            "torch 2.13 autocast.__exit__ clears the C++ weight cache at the outermost exit; the simulated CUDA "
            "kernels keep their casts in a Python cache, cleared at the same point",
        ),
    ]
    for fname, policy in (("rms_norm", "fp32"), ("scaled_dot_product_attention", "lower_precision_fp")):
        patches.append(
            Patch(
                F,
                fname,
                with_policy(getattr(F, fname), policy, rules),
                f"torch 2.13 CUDA autocast casts at aten::{fname} ({policy}); the CUDA-kernel rewrite of "
                f"F.{fname} calls the kernels below it, so the casts are applied first",
            )
        )
    return patches


def register_cuda_lists(kernel: Callable[[str, str], Callable[..., Any]]) -> torch.library.Library:
    """AutocastCPU kernels for aten (``torch.library``): ``kernel(name, policy)`` for every op in CUDA's lists, a
    fallthrough for ops only CPU lists; the caller destroys the library to remove them (CPU's C++ kernels
    return)."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            # torch 2.13 OperatorEntry warns (once per process) when a kernel replaces a registered one.
            warnings.filterwarnings("ignore", message=_OVERRIDE_WARNING)
            for name, policy in CUDA_POLICIES.items():
                lib.impl(name, kernel(name, policy), "AutocastCPU")
            for name in cpu_only_ops():
                lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
    except BaseException:
        lib._destroy()
        raise
    return lib


def cpu_only_ops() -> list[str]:
    """aten ops with a CPU autocast kernel and none in CUDA's lists (torch 2.13: cat, stack, cross_entropy_loss,
    the fft and linalg ops, ...)."""
    out = []
    for full in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"):
        ns, _, name = full.partition("::")
        if ns == "aten" and name not in CUDA_POLICIES:
            out.append(name)
    return sorted(out)
