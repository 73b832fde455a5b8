"""``torch.autocast("cuda", ...)`` as CUDA runs it, for a CUDA target simulated on fake "cpu" tensors.

On a CPU-only build torch 2.13 disables CUDA autocast (``autocast.__init__``: "CUDA is not available ... Disabling
autocast"), and the AutocastCUDA dispatch key never fires on "cpu" tensors anyway, so user code in
``torch.autocast("cuda", dtype=torch.bfloat16)`` would run in fp32. :class:`CudaAutocast` makes it run as on a GPU:

- ``torch.autocast("cuda", ...)`` (also ``torch.amp.autocast`` and ``torch.cuda.amp.autocast``, the same class and
  its subclass) stays enabled and sets CUDA's autocast state as torch does (``torch.is_autocast_enabled("cuda")``,
  ``torch.get_autocast_dtype("cuda")`` answer as on a GPU); on entering it also enables CPU autocast with the same
  dtype and cache setting, because AutocastCPU is the key the fake "cpu" tensors carry (exit restores both).
- For the world's duration the AutocastCPU kernels of aten are replaced by CUDA's lists (``CUDA_POLICIES`` of
  :mod:`hyperdryrun.compat.torch_autocast`, the
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
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hyperdryrun.compat import torch_autocast
from hyperdryrun.compat.torch_autocast import (
    _KEYS,
    BANNED,
    BANNED_MESSAGE,
    CUDA_POLICIES,
    FP32,
    FP32_APPEND_DTYPE,
    FP32_SET_OPT_DTYPE,
    LOWER_PRECISION_FP,
    PROMOTE,
    cpu_only_ops,
)
from hyperdryrun.patches import Patch, PatchSet


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


def autocast_patches(rules: CastRules, bf16_supported: bool = True) -> list[Patch]:
    """``torch.autocast`` for device "cuda" enabled and carried by CPU autocast; the cache clear; the Python
    rewrites of aten ops in CUDA's lists with those ops' casts (:func:`hyperdryrun.compat.torch_autocast.
    autocast_patches`)."""
    return torch_autocast.autocast_patches(rules, bf16_supported, with_policy)


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
    """AutocastCPU kernels for aten: CUDA's policy for every op in its lists, a fallthrough for ops only CPU lists
    (:func:`hyperdryrun.compat.torch_autocast.register_cuda_lists`)."""
    return torch_autocast.register_cuda_lists(lambda name, policy: make_kernel(name, policy, rules))


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
