"""``torch.autocast("cuda", ...)`` as CUDA runs it, for a CUDA target simulated on fake "cpu" tensors.

On a CPU-only build torch 2.13 disables CUDA autocast (``autocast.__init__``: "CUDA is not available ... Disabling
autocast"), and the AutocastCUDA dispatch key never fires on "cpu" tensors anyway, so user code in
``torch.autocast("cuda", dtype=torch.bfloat16)`` would run in fp32. :class:`CudaAutocast` makes it run as on a GPU:

- ``torch.autocast("cuda", ...)`` (also ``torch.amp.autocast`` and ``torch.cuda.amp.autocast``, the same class and
  its subclass) stays enabled and sets CUDA's autocast state as torch does (``torch.is_autocast_enabled("cuda")``,
  ``torch.get_autocast_dtype("cuda")`` answer as on a GPU); on entering it also enables CPU autocast with the same
  dtype and cache setting, because AutocastCPU is the key the fake "cpu" tensors carry (exit restores both).
- For the world's duration the AutocastCPU kernels of aten are replaced by CUDA's lists (``CUDA_POLICIES``, the
  ``TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m)`` registrations of torch 2.13 aten/src/ATen/autocast_mode.cpp with
  the ``AT_FORALL_*`` lists of autocast_mode.h): Python kernels that cast as ``WrapFunction_<policy>`` does, with
  autocast's weight cache (``cached_cast``); the ops only CPU lists fall through, as unlisted ops do on CUDA. The
  registrations are removed on exit, which brings CPU's own C++ kernels back.
- ``F.rms_norm`` and ``F.scaled_dot_product_attention``, which :mod:`hyperdryrun.world.kernels` rewrites to call the
  CUDA kernels below ``aten::rms_norm`` / ``aten::scaled_dot_product_attention``, get those ops' autocast policy
  (fp32 and lower_precision_fp) applied first, as the dispatcher would.

Casts happen at the autocast key, above autograd, so autograd saves the cast tensors exactly as on CUDA.
A ``torch.autocast("cpu", ...)`` region inside a CUDA-target world simulated on "cpu" is a CUDA region: the simulated
tensors stand for CUDA tensors, so code that opens its region for its tensors' device (torchtitan's MoE router:
``torch.autocast(x.device.type, dtype=torch.float32)``) gets CUDA's semantics, where CPU autocast would refuse fp32
("CPU Autocast only supports dtypes of torch.bfloat16, torch.float16") and run the region without autocast. A region
hard-coded to "cpu" in a GPU job (which on a GPU would not touch CUDA tensors) is simulated as CUDA's too.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hyperdryrun.world.patches import Patch, PatchSet

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


def applies(target_device: str, simulation_device: str) -> bool:
    """CUDA autocast is simulated for a CUDA target on another device (fake "cuda" on a GPU has its own)."""
    return target_device == "cuda" and simulation_device != "cuda"


def _op(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


class WeightCache:
    """autocast's ``cached_casts``: lower-precision copies of fp32 leaf tensors that require grad, kept until the
    outermost autocast region exits (``torch.clear_autocast_cache``)."""

    def __init__(self) -> None:
        self._casts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def get(self, t: torch.Tensor, to: torch.dtype) -> torch.Tensor:
        hit = self._casts.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        out = t.to(to)
        self._casts[id(t)] = (weakref.ref(t), out)
        return out

    def clear(self) -> None:
        self._casts.clear()

    def __len__(self) -> int:
        return len(self._casts)


class CastRules:
    """``cached_cast`` / ``promote_type`` / ``set_opt_dtype`` of torch 2.13 autocast_mode.h, with tensors on the
    simulation device standing for CUDA tensors (``is_autocast_eligible``: on the device and floating point)."""

    def __init__(self, device: str, cache: WeightCache) -> None:
        self.device = device
        self.cache = cache

    @staticmethod
    def lower() -> torch.dtype:
        """The autocast dtype: CPU's, which the simulated CUDA region set (a checkpoint's recompute restores it)."""
        return torch.get_autocast_dtype("cpu")

    def eligible(self, t: Any) -> bool:
        return (
            isinstance(t, torch.Tensor)
            and t.device.type == self.device
            and t.is_floating_point()
            and t.dtype != torch.float64
        )

    def cast(self, to: torch.dtype, t: Any) -> Any:
        """``cached_cast`` of one argument: a tensor, or a list of tensors (``Tensor[]``), else unchanged."""
        if isinstance(t, (list, tuple)) and t and all(isinstance(x, torch.Tensor) for x in t):
            return type(t)(self.cast(to, x) for x in t)
        if not self.eligible(t) or t.dtype == to:
            return t
        if (
            to == self.lower()
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
            and torch.is_autocast_cache_enabled()
        ):
            return self.cache.get(t, to)
        return t.to(to)

    def promote(self, values: list[Any]) -> torch.dtype:
        """``promote_type``: fp32 if any eligible input is fp32, else the autocast dtype (fp64 inputs ignored)."""
        lower, current = self.lower(), self.lower()
        for v in values:
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if not self.eligible(t):
                    continue
                if current == torch.float32 or t.dtype == torch.float32:
                    current = torch.float32
                elif not (current == lower and t.dtype == lower):
                    raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
        return current

    def cast_all(self, to: torch.dtype, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Every argument cast, in C++'s evaluation order of a call's arguments (last first, as GCC builds torch)."""
        new_kwargs = {k: self.cast(to, kwargs[k]) for k in reversed(list(kwargs))}
        new_args = [self.cast(to, a) for a in reversed(args)][::-1]
        return tuple(new_args), {k: new_kwargs[k] for k in kwargs}


def _castable(op: torch._ops.OpOverload) -> set[str]:
    """Names of the arguments ``cached_cast`` touches: ``Tensor``, ``Tensor?`` and ``Tensor[]`` (not ``Tensor?[]``)."""
    return {
        a.name for a in op._schema.arguments if str(a.type) in ("Tensor", "Optional[Tensor]", "List[Tensor]")
    }


def _split(op: torch._ops.OpOverload, args: tuple, kwargs: dict, names: set[str]) -> tuple[tuple, dict]:
    """Only the castable arguments, others replaced by None (so casting the rest is a no-op)."""
    schema = op._schema.arguments
    pos = tuple(a if schema[i].name in names else None for i, a in enumerate(args))
    return pos, {k: (v if k in names else None) for k, v in kwargs.items()}


def _merge(orig: tuple[tuple, dict], cast: tuple[tuple, dict], names: set[str], op) -> tuple[tuple, dict]:
    schema = op._schema.arguments
    args = tuple(cast[0][i] if schema[i].name in names else a for i, a in enumerate(orig[0]))
    kwargs = {k: (cast[1][k] if k in names else v) for k, v in orig[1].items()}
    return args, kwargs


def make_kernel(name: str, policy: str, rules: CastRules) -> Callable[..., Any]:
    """The AutocastCPU kernel applying CUDA's ``policy`` to aten op ``name`` (``WrapFunction_<policy>::call``)."""
    op = _op(name)
    names = _castable(op)
    schema = op._schema.arguments
    dtype_index = next((i for i, a in enumerate(schema) if a.name == "dtype"), None)
    target = _op(FP32_APPEND_DTYPE[name]) if policy == "fp32_append_dtype" else op

    def first(args: tuple, kwargs: dict) -> Any:
        return args[0] if args else kwargs.get(schema[0].name)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_KEYS), torch._C.DisableTorchFunction():
            if policy == "banned":
                raise RuntimeError(BANNED_MESSAGE)
            if policy == "fp32_set_opt_dtype":
                if rules.eligible(first(args, kwargs)):
                    if dtype_index is not None and dtype_index < len(args):
                        if args[dtype_index] is None:
                            args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1 :])
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            if policy == "fp32_append_dtype":
                x = first(args, kwargs)
                return target(*args, **kwargs, dtype=torch.float32 if rules.eligible(x) else x.dtype)
            only = _split(op, args, kwargs, names)
            if policy == "lower_precision_fp":
                to = rules.lower()
            elif policy == "fp32":
                to = torch.float32
            else:  # promote
                to = rules.promote([*only[0], *only[1].values()])
            args, kwargs = _merge((args, kwargs), rules.cast_all(to, *only), names, op)
            return op(*args, **kwargs)

    kernel.__name__ = f"cuda_autocast_{name.replace('.', '_')}"
    return kernel


def with_policy(fn: Callable[..., Any], policy: str, rules: CastRules) -> Callable[..., Any]:
    """``fn`` (a Python rewrite of the aten op of that policy) with CUDA autocast's casts first, every autocast key
    excluded while it runs: what the op's AutocastCUDA kernel does before its redispatch."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_autocast_enabled("cpu"):
            return fn(*args, **kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_KEYS):
            to = rules.lower() if policy == "lower_precision_fp" else torch.float32
            args, kwargs = rules.cast_all(to, args, kwargs)
            return fn(*args, **kwargs)

    return wrapper


def _autocast_class() -> type:
    from torch.amp.autocast_mode import autocast

    return autocast


def autocast_patches(rules: CastRules, bf16_supported: bool = True) -> list[Patch]:
    """``torch.autocast`` for device "cuda" enabled and carried by CPU autocast; the cache clear; the Python
    rewrites of aten ops in CUDA's lists with those ops' casts."""
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


class CudaAutocast:
    """For a world's duration: CUDA's autocast lists on the AutocastCPU key, ``torch.autocast("cuda")`` enabled
    and carried by CPU autocast, and the autocast state of the thread restored on exit (also after an error)."""

    reason = (
        "torch 2.13 has no CUDA autocast for 'cpu' tensors: AutocastCPU's kernels (CPU's lists) are overridden by "
        "Python kernels with CUDA's lists via torch.library, deregistered on exit"
    )

    def __init__(self, device: str = "cpu", bf16_supported: bool = True) -> None:
        self.cache = WeightCache()
        self.rules = CastRules(device, self.cache)
        self.bf16_supported = bf16_supported
        self._lib: torch.library.Library | None = None
        self._patches: PatchSet | None = None
        self._state: tuple | None = None

    def __enter__(self) -> CudaAutocast:
        self._state = autocast_state()
        try:
            self._lib = register_cuda_lists(self.rules)
            self._patches = PatchSet(autocast_patches(self.rules, self.bf16_supported)).__enter__()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._patches is not None:
            self._patches.__exit__()
            self._patches = None
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None
        self.cache.clear()
        if self._state is not None:
            set_autocast_state(self._state)
            self._state = None


def register_cuda_lists(rules: CastRules) -> torch.library.Library:
    """AutocastCPU kernels for aten: CUDA's policy for every op in its lists, a fallthrough for ops only CPU lists."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            # torch 2.13 OperatorEntry warns (once per process) when a kernel replaces a registered one.
            warnings.filterwarnings("ignore", message=_OVERRIDE_WARNING)
            for name, policy in CUDA_POLICIES.items():
                lib.impl(name, make_kernel(name, policy, rules), "AutocastCPU")
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


def autocast_state() -> tuple:
    """The thread's autocast state a simulation may change (enabled and dtype for CPU and CUDA, the cache flag)."""
    return (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        torch.is_autocast_cache_enabled(),
    )


def set_autocast_state(state: tuple) -> None:
    cpu_on, cpu_dtype, cuda_on, cuda_dtype, cache_on = state
    torch.set_autocast_enabled("cpu", cpu_on)
    torch.set_autocast_dtype("cpu", cpu_dtype)
    torch.set_autocast_enabled("cuda", cuda_on)
    torch.set_autocast_dtype("cuda", cuda_dtype)
    torch.set_autocast_cache_enabled(cache_on)


__all__ = [
    "BANNED",
    "CUDA_POLICIES",
    "FP32",
    "FP32_APPEND_DTYPE",
    "FP32_SET_OPT_DTYPE",
    "LOWER_PRECISION_FP",
    "PROMOTE",
    "CastRules",
    "CudaAutocast",
    "WeightCache",
    "applies",
    "autocast_patches",
    "autocast_state",
    "cpu_only_ops",
    "register_cuda_lists",
    "set_autocast_state",
    "with_policy",
]
