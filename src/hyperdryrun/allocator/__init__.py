"""What the CUDA caching allocator reserves for a rank's allocations: the bytes nvidia-smi and OOMs are about.

A stage over blocks: ``events_from_blocks`` turns a trace's blocks (dry run or ingested) into allocator events,
``replay`` runs them through ``CachingAllocatorModel`` under ``AllocatorOptions`` (PYTORCH_CUDA_ALLOC_CONF) and a
capacity, and returns reserved bytes over time, the reserved peak with its segments, and the first OOM;
``device_memory`` adds the runtime's own allocations (cuBLAS workspaces) and what it holds outside the allocator
(NCCL, the CUDA context): allocated, reserved and device bytes, and a verdict against a capacity.
``snapshot_replay`` checks the model against the real allocator: a CUDA snapshot's own events replayed from the
cache as recording began, compared address by address (``hyperdryrun compare --replay``).

Source read (the pinned torch 2.13.0 is git cf30153, a commit the reference index does not hold): the rules come
from the newest copy it holds, cyyever/pytorch (a fork at version 2.15.0a0):
c10/cuda/CUDACachingAllocator.cpp at 076f02792ce54ef5fe47818d061755430c9973e1,
c10/core/AllocatorConfig.cpp at 106319cb5704e5ec5a9680b3168f2b0075494760 and
c10/cuda/CUDAAllocatorConfig.cpp at 0b2b76de25c1def7ae856916faca9f017def8978; checked against the upstream
pytorch/pytorch copy of CUDACachingAllocator.cpp at eb42ad6eca0ce61e7c581212b4bf32f991425571 (older: same rules,
with kLargeBuffer where large_segment_size and max_non_split_rounding_size now stand, both 20 MiB by default).
The option keys match the pinned libc10.so (see ``options``).
"""

from typing import TYPE_CHECKING

# Eager: ``replay`` is both a submodule and a function; importing the submodule later (as allocator.device does)
# would rebind the package's ``replay`` to the module unless the function is bound after it, here.
from hyperdryrun.allocator.replay import (
    AllocatorEvent,
    AllocatorEventError,
    AllocatorOOM,
    AllocatorReplay,
    events_from_blocks,
    replay,
)
from hyperdryrun.lazy import lazy_exports

if TYPE_CHECKING:
    from hyperdryrun.allocator.device import DeviceMemory, OutsideCost, Workspace, device_memory
    from hyperdryrun.allocator.model import CachingAllocatorModel, OutOfMemory, Segment, SegmentBlock
    from hyperdryrun.allocator.options import AllocatorConfigError, AllocatorOptions

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "hyperdryrun.allocator.device": ("DeviceMemory", "OutsideCost", "Workspace", "device_memory"),
        "hyperdryrun.allocator.model": ("CachingAllocatorModel", "OutOfMemory", "Segment", "SegmentBlock"),
        "hyperdryrun.allocator.options": ("AllocatorConfigError", "AllocatorOptions"),
    },
)

__all__ = [
    "AllocatorConfigError",
    "AllocatorEvent",
    "AllocatorEventError",
    "AllocatorOOM",
    "AllocatorOptions",
    "AllocatorReplay",
    "CachingAllocatorModel",
    "DeviceMemory",
    "OutOfMemory",
    "OutsideCost",
    "Segment",
    "SegmentBlock",
    "Workspace",
    "device_memory",
    "events_from_blocks",
    "replay",
]
