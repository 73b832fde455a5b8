"""CUDA kernel semantics on a different simulation device: the rewrites and patches the dry run applies.

Where the CPU kernel of an op allocates or saves for backward differently from the CUDA kernel of the same op, the
dry run follows CUDA: ``F.dropout``, ``F.rms_norm``, ``F.softmax``/``F.log_softmax`` and the optimizer default are
rewritten as CUDA runs them (:mod:`hyperdryrun.compat.torch_kernels`, which depends on the torch release),
``F.scaled_dot_product_attention`` by :mod:`hyperdryrun.world.sdpa` for a
:class:`~hyperdryrun.world.cuda_target.CudaTarget`, and :class:`TargetFakeTensorMode` returns the CUDA outputs of the
ops in ``OUTPUT_FIXUPS``. Which differences exist, and where the audit finds them, is
:data:`hyperdryrun.world.cuda_target.DIFFERENCES`.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hyperdryrun.compat import torch_kernels, torchao
from hyperdryrun.compat.torch_kernels import (
    OUTPUT_FIXUPS,
    cuda_dropout,
    cuda_log_softmax,
    cuda_rms_norm,
    cuda_softmax,
)
from hyperdryrun.patches import Patch
from hyperdryrun.trace.tracker import TrackingFakeTensorMode
from hyperdryrun.world.cuda_target import DEFAULT_CUDA_TARGET, DIFFERENCES, CudaTarget, KernelDifference
from hyperdryrun.world.sdpa import cuda_scaled_dot_product_attention, cuda_sdpa_backend, sdpa_for


class TargetFakeTensorMode(TrackingFakeTensorMode):
    """The tracking fake mode, with the outputs of ``OUTPUT_FIXUPS`` ops replaced by the CUDA kernel's (the
    replacement is what the tracker and autograd see: it is recorded as the op's own outputs), and the ``out=``
    kernels without a Meta kernel (``OUT_WITHOUT_META``) returning ``out`` instead of running for real."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        fix = OUTPUT_FIXUPS.get(func)
        if fix is None and func not in torch_kernels.OUT_WITHOUT_META:
            return super().__torch_dispatch__(func, types, args, kwargs)
        kwargs = kwargs or {}
        tracker = self.tracker
        active = tracker is not None and tracker.active
        if active:
            tracker.begin_op()
        out = None
        try:
            if fix is None:  # an out= kernel FakeTensorMode would run for real: it writes into out
                out = kwargs["out"]
            else:
                out = fix(args, kwargs, FakeTensorMode.__torch_dispatch__(self, func, types, args, kwargs))
        finally:
            if active:
                tracker.end_op(func, args, kwargs, out)
        return out


def needs_target_kernels(target_device: str, simulation_device: str) -> bool:
    """Whether the simulation device's own kernel choice differs from the target's: always for a CUDA target
    simulated elsewhere, and for fake "cuda" on a build without a usable GPU (no device properties to choose by)."""
    if target_device != "cuda":
        return False
    return simulation_device != "cuda" or not torch.cuda.is_available()


def target_kernel_patches(
    target_device: str, simulation_device: str, cuda_target: CudaTarget = DEFAULT_CUDA_TARGET
) -> list[Patch]:
    """Patches that make the simulation device follow the target device's kernels (``cuda_target``'s SDPA choice;
    :func:`hyperdryrun.compat.torch_kernels.target_kernel_patches`; torchao's MXFP8 casts where torchao is loaded,
    :func:`hyperdryrun.compat.torchao.mx_kernel_patches`)."""
    if target_device != "cuda":
        return []
    return torch_kernels.target_kernel_patches(
        target_device,
        simulation_device,
        sdpa_for(cuda_target),
        needs_target_kernels(target_device, simulation_device),
    ) + [
        *torchao.mx_kernel_patches(cuda_target.sm, cuda_target.gpu.name),
        *torchao.scaled_mm_patches(cuda_target.sm, cuda_target.gpu.name),
    ]


__all__ = [
    "DEFAULT_CUDA_TARGET",
    "DIFFERENCES",
    "OUTPUT_FIXUPS",
    "CudaTarget",
    "KernelDifference",
    "TargetFakeTensorMode",
    "cuda_dropout",
    "cuda_log_softmax",
    "cuda_rms_norm",
    "cuda_scaled_dot_product_attention",
    "cuda_sdpa_backend",
    "cuda_softmax",
    "needs_target_kernels",
    "target_kernel_patches",
]
