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

import collections
from dataclasses import dataclass, field

import torch

from hyperdryrun.compat import torch_kernels, torchao
from hyperdryrun.compat.torch_dispatch_mode import fake_tensor_dispatch, unwrapped_dispatch
from hyperdryrun.compat.torch_kernels import (
    FUSED_COLLECTIVE_MATMULS,
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


@dataclass
class FusedCollectives:
    """What the async-TP ops of a CUDA target did in a dry run: calls per op, and the symmetric-memory workspace
    each process group needed (the largest request: torch's ``get_symm_mem_workspace`` grows it to that)."""

    calls: collections.Counter = field(default_factory=collections.Counter)
    unmodelled: collections.Counter = field(default_factory=collections.Counter)
    workspace: dict[str, int] = field(default_factory=dict)

    @property
    def limitation(self) -> str | None:
        if not self.calls and not self.unmodelled:
            return None
        line = "async TP: compiled regions ran Inductor's fused collective matmuls"
        if self.calls:
            ops = ", ".join(f"{name} x{n}" for name, n in sorted(self.calls.items()))
            spaces = ", ".join(f"{group}: {size:,} B" for group, size in sorted(self.workspace.items()))
            line += (
                f" ({ops}) with the buffers torch's CUDA kernels allocate (the gathered input, the stacked partial "
                "products); the symmetric-memory workspace they stage through lies outside the caching allocator "
                f"and is not counted (per process group, kept after the step: {spaces})"
            )
        if self.unmodelled:
            ops = ", ".join(f"{name} x{n}" for name, n in sorted(self.unmodelled.items()))
            line += (
                f"{';' if self.calls else ':'} {ops} counted by their outputs only (the kernels' temporaries "
                "and workspace are not modelled)"
            )
        return line


# The classes below without torch's Dynamo wrapper: TargetFakeTensorMode's own wrapper holds Dynamo's frame
# callback off for every frame below it (compat/torch_dispatch_mode.py)
_TRACKING_DISPATCH = unwrapped_dispatch(TrackingFakeTensorMode)
_FAKE_DISPATCH = fake_tensor_dispatch()


class TargetFakeTensorMode(TrackingFakeTensorMode):
    """The tracking fake mode, with the outputs of ``OUTPUT_FIXUPS`` ops replaced by the CUDA kernel's (the
    replacement is what the tracker and autograd see: it is recorded as the op's own outputs), the ``out=``
    kernels without a Meta kernel (``OUT_WITHOUT_META``) returning ``out`` instead of running for real, and the
    async-TP ops (``FUSED_COLLECTIVE_MATMULS``) holding the CUDA kernel's temporaries while they run."""

    fused: FusedCollectives | None = None
    """Set by the world: where the async-TP ops' calls and workspaces are recorded."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        fix = OUTPUT_FIXUPS.get(func)
        if fix is None and func not in torch_kernels.OUT_WITHOUT_META:
            if getattr(func, "_namespace", None) == "symm_mem" and func._opname.startswith("fused_"):
                return self._fused_collective(func, types, args, kwargs or {})
            return _TRACKING_DISPATCH(self, func, types, args, kwargs)
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
                out = fix(args, kwargs, _FAKE_DISPATCH(self, func, types, args, kwargs))
        finally:
            if active:
                tracker.end_op(func, args, kwargs, out)
        return out

    def _fused_collective(self, func, types, args, kwargs):
        model = FUSED_COLLECTIVE_MATMULS.get(func._opname)
        if model is None:  # a float8 variant: its Meta kernel's outputs
            if self.fused is not None:
                self.fused.unmodelled[func._opname] += 1
            return _TRACKING_DISPATCH(self, func, types, args, kwargs)
        transients, workspace, group = model(args, kwargs)
        if self.fused is not None:
            self.fused.calls[func._opname] += 1
            self.fused.workspace[group] = max(self.fused.workspace.get(group, 0), workspace)
        device = args[0].device
        empty = torch.ops.aten.empty.memory_format
        held = []
        for numel, dtype in transients:
            held.append(
                _TRACKING_DISPATCH(self, empty, types, ((numel,),), {"dtype": dtype, "device": device})
            )
        out = _TRACKING_DISPATCH(self, func, types, args, kwargs)
        del held
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
    "FusedCollectives",
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
