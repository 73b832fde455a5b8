"""The simulated world: rank ``r`` of ``N`` with a fake process group, a device mesh and fake tensors (the class
behind ``hyperdryrun.world.SimulatedWorld``).

Everything it touches is restored on exit, also when the body raises: the process group, the dispatch-mode stack,
every patch of torch, the default dtype and device, and the environment.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hyperdryrun.compat import process, torch_dtensor
from hyperdryrun.compat.transformers import PACKED_SEQUENCES_OP, packed_sequence_patches
from hyperdryrun.trace.blocks import ALIGNMENT
from hyperdryrun.trace.tracker import MemoryTracker, TrackingFakeTensorMode
from hyperdryrun.world.autocast import CudaAutocast
from hyperdryrun.world.autocast import applies as cuda_autocast_applies
from hyperdryrun.world.compile import CompiledCode
from hyperdryrun.world.dtensor import untracked_sharding_propagation
from hyperdryrun.world.fsdp import gradient_accumulation_buffers
from hyperdryrun.world.kernels import (
    FusedCollectives,
    TargetFakeTensorMode,
    needs_target_kernels,
    target_kernel_patches,
)
from hyperdryrun.world.patches import PatchSet
from hyperdryrun.world.runtime import CudaRuntime
from hyperdryrun.world.streams import StreamRegistry, fsdp_stream_patches, record_stream_patch


class WorldError(RuntimeError):
    """The simulated world could not be set up."""


def default_simulation_device() -> str:
    """``cuda`` where torch can use a CUDA device, else ``cpu``; the CUDA semantics are then modelled in
    :mod:`hyperdryrun.world.kernels`.

    torch 2.13 CPU wheels: fake "cuda" tensors abort the process in autograd ("not linked with support for cuda
    devices"). torch 2.13 CUDA wheels without a GPU: a backward on fake "cuda" tensors raises in
    ``GraphTask::stash_current_streams`` ("hasPrimaryContext expects a valid device index"), and the SDPA backend
    choice needs device properties. Fake "cpu" works on both.
    """
    return "cuda" if torch.backends.cuda.is_built() and torch.cuda.is_available() else "cpu"


class SimulatedWorld:
    """Context manager for rank ``rank`` of a ``world_size`` world.

    >>> with SimulatedWorld(world_size=8, rank=3, mesh_shape=(8,), mesh_dim_names=("dp_shard",)) as world:
    ...     with world.fake():
    ...         x = torch.empty(1024, device=world.device)   # a fake tensor, no memory
    """

    def __init__(
        self,
        world_size: int = 1,
        rank: int = 0,
        local_rank: int | None = None,
        mesh_shape: tuple[int, ...] | None = None,
        mesh_dim_names: tuple[str, ...] | None = None,
        target_device: str = "cuda",
        simulation_device: str | None = None,
        cuda: CudaRuntime | None = None,
    ) -> None:
        if world_size < 1:
            raise WorldError(f"world_size={world_size} must be >= 1")
        if not 0 <= rank < world_size:
            raise WorldError(f"rank={rank} must satisfy 0 <= rank < world_size={world_size}")
        mesh_shape = tuple(mesh_shape) if mesh_shape else (world_size,)
        mesh_dim_names = (
            tuple(mesh_dim_names) if mesh_dim_names else tuple(f"dim{i}" for i in range(len(mesh_shape)))
        )
        if math.prod(mesh_shape) != world_size:
            raise WorldError(
                f"mesh_shape={mesh_shape} has {math.prod(mesh_shape)} ranks, world_size={world_size}"
            )
        if len(mesh_dim_names) != len(mesh_shape):
            raise WorldError(f"mesh_dim_names={mesh_dim_names} does not match mesh_shape={mesh_shape}")
        self.world_size, self.rank = world_size, rank
        self.local_rank = rank if local_rank is None else local_rank
        self.mesh_shape, self.mesh_dim_names = mesh_shape, mesh_dim_names
        self.target_device = target_device
        self.device = simulation_device or default_simulation_device()
        self.alignment = ALIGNMENT if target_device == "cuda" else 1
        self.cuda = cuda or CudaRuntime()
        self.cuda_target = self.cuda.target()
        self.cuda_settings: dict[str, Any] = {}
        self.streams: StreamRegistry | None = None
        self.mesh: Any = None
        self.fake_mode: TrackingFakeTensorMode | None = None
        self.tracker: MemoryTracker | None = None
        self.compiled: CompiledCode | None = None
        self.fused_collectives: FusedCollectives | None = None
        """The async-TP ops' record (a CUDA target simulated elsewhere: :class:`TargetFakeTensorMode`)."""
        self._stack: contextlib.ExitStack | None = None

    # ------------------------------------------------------------------ enter / exit
    def __enter__(self) -> SimulatedWorld:
        if dist.is_initialized():
            raise WorldError("a torch.distributed process group is already initialised in this process")
        stack = contextlib.ExitStack()
        self._stack = stack
        try:
            stack.callback(_restore_globals, _save_globals())
            stack.enter_context(PatchSet([process.excepthook_patch()]))  # init_process_group wraps it
            torch_dtensor.clear_caches()
            stack.callback(torch_dtensor.clear_caches)
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.world_size)
            stack.callback(_destroy_process_group)
            from torch.distributed.device_mesh import init_device_mesh

            # Built outside fake mode: mesh coordinates are computed with real tensor ops (nonzero/item).
            self.mesh = init_device_mesh(self.device, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)
            stack.enter_context(
                PatchSet(target_kernel_patches(self.target_device, self.device, self.cuda_target))
            )
            if cuda_autocast_applies(self.target_device, self.device):
                # after the kernel rewrites: it wraps F.rms_norm / F.scaled_dot_product_attention as they are now
                stack.enter_context(CudaAutocast(self.device, bf16_supported=self.cuda_target.sm >= (8, 0)))
            if self.target_device == "cuda":
                self.cuda_settings = self.cuda.settings()
                self.streams = StreamRegistry(self.device)
                streams = [
                    *fsdp_stream_patches(self.streams),
                    record_stream_patch(self.streams, lambda: self.tracker),
                ]
                stack.enter_context(PatchSet(streams))
            stack.enter_context(PatchSet(untracked_sharding_propagation(lambda: self.tracker)))
            stack.enter_context(PatchSet(torch_dtensor.device_mesh_patches()))
            stack.enter_context(PatchSet(gradient_accumulation_buffers(lambda: self.tracker)))
            mode = TrackingFakeTensorMode
            if self.device != "cuda" and needs_target_kernels(self.target_device, self.device):
                mode = TargetFakeTensorMode
            self.fake_mode = mode(allow_non_fake_inputs=True)
            if isinstance(self.fake_mode, TargetFakeTensorMode):
                self.fake_mode.fused = self.fused_collectives = FusedCollectives()
            self.compiled = stack.enter_context(
                CompiledCode(self.target_device, self.device, mode, lambda: self.tracker)
            )
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.tracker is not None:
            self.tracker.stop()
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
        self.mesh = None
        self.fake_mode = None
        self.streams = None

    @contextlib.contextmanager
    def fake(self) -> Iterator[TrackingFakeTensorMode]:
        """Run the body with fake tensors on the simulation device. Library code that reads tensor values to choose
        its path gets a real run's answer (:func:`~hyperdryrun.compat.transformers.packed_sequence_patches`: one
        sequence per row unless a ``branch`` value rule for ``hf.packed_sequences`` says otherwise)."""
        assert self.fake_mode is not None, "enter the world first"
        with self.fake_mode, PatchSet(packed_sequence_patches(_packed_sequences)):
            yield self.fake_mode

    def track(self, capture_stacks: bool = True) -> MemoryTracker:
        """Create the tracker that records this world's fake allocations (start it with ``tracker.start``)."""
        assert self.fake_mode is not None, "enter the world first"
        self.tracker = MemoryTracker(alignment=self.alignment, capture_stacks=capture_stacks)
        self.tracker.stream_of = self.streams.current if self.streams is not None else None
        self.fake_mode.tracker = self.tracker
        return self.tracker

    @property
    def limitations(self) -> list[str]:
        out = []
        if self.device != self.target_device:
            out.append(
                f"simulated on fake '{self.device}' tensors for a '{self.target_device}' target: "
                f"{self.target_device} kernels were not executed; where their allocations differ they are "
                f"modelled (512 B rounding, SDPA backend for {self.cuda_target.describe()}, fused dropout and "
                "rms_norm, fp32 norm statistics, optimizer implementation, CUDA autocast's op lists; `hyperdryrun "
                "audit-kernels` lists them)"
            )
        out += self.compiled.limitations if self.compiled is not None else []
        fused = self.fused_collectives.limitation if self.fused_collectives is not None else None
        return out + ([fused] if fused else [])


def _packed_sequences() -> bool:
    """Whether the active value rules say the batch packs several sequences per row (a ``branch`` rule for
    ``hf.packed_sequences`` matching the running module); no rule: one sequence per row."""
    from hyperdryrun.world.values import _current_module, active_rules

    rules = active_rules()
    rule = rules.lookup(_current_module(), PACKED_SEQUENCES_OP) if rules is not None else None
    return rule is not None and rule.handler == "branch" and rule.value is True


def _save_globals() -> dict[str, Any]:
    return {
        "dtype": torch.get_default_dtype(),
        "device": torch.get_default_device(),
        "environ": dict(os.environ),
        "grad": torch.is_grad_enabled(),
    }


def _restore_globals(saved: dict[str, Any]) -> None:
    torch.set_default_dtype(saved["dtype"])
    torch.set_default_device(saved["device"] if saved["device"].type != "cpu" else None)
    torch.set_grad_enabled(saved["grad"])
    if dict(os.environ) != saved["environ"]:
        os.environ.clear()
        os.environ.update(saved["environ"])


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
