"""CUDA kernels a composite torch op picks, and what they allocate or save for backward, where the CPU kernel of the
same op differs (torch 2.11 to 2.14: ``aten/src/ATen/native/Dropout.cpp``, ``layer_norm.cpp``, ``SoftMax.cpp``,
``torch/optim/optimizer.py``, ``torch/_refs``, ``torch/_decomp``): the rewrites and patches that make a simulation
device follow CUDA.

``F.dropout``, ``F.rms_norm``, ``F.softmax``/``F.log_softmax`` and the optimizer default are rewritten as CUDA runs
them; ``OUTPUT_FIXUPS`` are the CUDA outputs of ops whose CPU kernel returns others (applied by
:class:`hyperdryrun.world.kernels.TargetFakeTensorMode`). Which differences exist, and where the audit finds them,
is :data:`hyperdryrun.world.cuda_target.DIFFERENCES`. ``tests/world/test_kernels.py`` checks each rewrite against
torch's own CUDA kernel on fake "cuda", so a release that changes one fails there.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hyperdryrun.patches import Patch

_aten = torch.ops.aten
_orig_dropout = F.dropout
_orig_softmax = F.softmax
_orig_log_softmax = F.log_softmax
_orig_rms_norm = F.rms_norm


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
    """Whether every tensor is a plain (fake) tensor, or a DTensor whose local shard is one: the CUDA kernel rules
    hold for a DTensor's local tensors as for plain ones (on a GPU the DTensor's device type picks the kernel)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    def plain(t) -> bool:
        if isinstance(t, DTensor):
            t = t._local_tensor
        return type(t) in (torch.Tensor, torch.nn.Parameter, FakeTensor)

    return all(t is None or plain(t) for t in tensors)


def cuda_rms_norm(input, normalized_shape, weight=None, eps=None):
    """``F.rms_norm`` as CUDA runs it: the fused kernel unless input is complex or the weight's dtype differs.
    Inside a region torch.compile traces, ``F.rms_norm`` itself (Inductor decomposes and fuses it; dynamo cannot
    trace the fused kernel's ``autograd.Function``, whose forward dispatches below autograd)."""
    if (
        not torch.compiler.is_compiling()
        and _plain(input, weight)
        and not input.is_complex()
        and (weight is None or weight.dtype == input.dtype)
    ):
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


OUT_WITHOUT_META = frozenset({_aten._scaled_mm.out})
"""``out=`` overloads with no Meta kernel in torch 2.11 to 2.15 (``_scaled_mm.out``, which Inductor's generated code
calls for a compiled float8 GEMM as ``extern_kernels._scaled_mm(..., out=buf)``): FakeTensorMode runs such an op's
real CPU kernel on zero-filled tensors of the full size (``run_fallback_kernel``), minutes for one 405B layer. The
kernel writes into ``out`` and allocates nothing, so the simulation returns ``out``."""


def _group_size(group_name: str) -> int:
    import torch.distributed.distributed_c10d as c10d

    return c10d._get_group_size_by_name(group_name)


@functools.cache
def _signature(op_name: str) -> inspect.Signature:
    """The signature of torch's Meta kernel of ``symm_mem.<op_name>`` (``_<op_name>_fallback``): how a call's
    positional and keyword arguments bind to names, as the op receives them."""
    import torch.distributed._symmetric_memory as symm_mem

    return inspect.signature(getattr(symm_mem, f"_{op_name}_fallback"))


def _bound(op_name: str, args, kwargs) -> dict:
    bound = _signature(op_name).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _all_gather_matmul(args, kwargs) -> tuple[list[tuple[int, torch.dtype]], int, str]:
    """``symm_mem.fused_all_gather_matmul`` as torch 2.13's CUDA kernel runs it for a training step's M
    (``_fused_all_gather_matmul_impl``; the native and multicast variants are for env-enabled or M <= 4096 calls):
    the gathered input ``A_flat`` is allocated before the outputs and, where the op does not return it
    (``return_A=False``) or returns a concatenated copy (gathering the last dim), freed when the op returns; the
    shard is staged in the group's symmetric-memory workspace."""
    bound = _bound("fused_all_gather_matmul", args, kwargs)
    shard, gather_dim, group = bound["A_shard"], bound["gather_dim"], bound["group_name"]
    gathered = shard.numel() * _group_size(group)
    last_dim = gather_dim in (-1, shard.dim() - 1)
    transient = [(gathered, shard.dtype)] if (last_dim or not bound["return_A"]) else []
    return transient, shard.numel() * shard.element_size(), str(group)


def _reduce_scatter(op_name: str, args, kwargs) -> tuple[list[tuple[int, torch.dtype]], int, str]:
    """``symm_mem.fused_matmul_reduce_scatter`` and its float8 form ``fused_scaled_matmul_reduce_scatter`` as torch
    2.13's CUDA kernels run them (``_fused_matmul_reduce_scatter_impl``, ``_fused_scaled_matmul_reduce_scatter_impl``):
    every rank's partial product, ``stacked_partials`` (M x N in the output dtype), is allocated before the reduced
    output and freed when the op returns, and for row-wise float8 scales a contiguous copy of them with the scatter
    dim first where that is not a view; the all-to-all of the partials needs twice one rank's chunk of them in the
    group's symmetric-memory workspace."""
    bound = _bound(op_name, args, kwargs)
    a, b, group = bound["A"], bound["B"], bound["group_name"]
    dtype = bound.get("out_dtype") or a.dtype
    stacked = a.numel() // a.shape[-1] * b.shape[1]
    transient = [(stacked, dtype)]
    a_scale = bound.get("A_scale")
    if (
        a_scale is not None
        and a_scale.numel() > 1
        and not a_scale.movedim(bound["scatter_dim_after_maybe_reshape"], 0).is_contiguous()
    ):
        transient.append((a_scale.numel(), a_scale.dtype))
    return transient, 2 * stacked * dtype.itemsize // _group_size(group), str(group)


FUSED_COLLECTIVE_MATMULS = {
    "fused_all_gather_matmul": _all_gather_matmul,
    "fused_matmul_reduce_scatter": functools.partial(_reduce_scatter, "fused_matmul_reduce_scatter"),
    "fused_scaled_matmul_reduce_scatter": functools.partial(
        _reduce_scatter, "fused_scaled_matmul_reduce_scatter"
    ),
}
"""The ``symm_mem`` ops Inductor's async-TP pass fuses a TP all-gather or reduce-scatter and its matmul into, by op
name: ``fn(args, kwargs) -> (transients, workspace bytes, process group)``. Their Meta kernels (what a fake mode runs) return the
outputs only; the CUDA kernels also allocate ``transients`` (numel, dtype) while they run, and stage data in a
symmetric-memory workspace that lies outside the caching allocator. ``fused_all_gather_scaled_matmul`` is not
listed: its outputs only, and the report says so."""


def _foreach_devices(simulation_device: str):
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    def devices() -> list[str]:
        return [*_get_foreach_kernels_supported_devices(), simulation_device]

    return devices


def target_kernel_patches(
    target_device: str, simulation_device: str, sdpa: Callable[..., Any], needs_target_kernels: bool
) -> list[Patch]:
    """Patches that make the simulation device follow the target device's kernels: the optimizers' foreach default
    for fake parameters, and where the simulation device's own kernel choice differs (``needs_target_kernels``)
    ``sdpa`` for ``F.scaled_dot_product_attention`` and, off CUDA, the CUDA rewrites above.

    Each patch's reason names the torch 2.13 source it follows; torch 2.11 to 2.14 choose these kernels alike
    (``tests/world/test_kernels.py`` compares the rewrites with torch's own CUDA kernels on fake "cuda")."""
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
    if not needs_target_kernels:
        return patches
    patches += [
        Patch(
            F,
            "scaled_dot_product_attention",
            sdpa,
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
