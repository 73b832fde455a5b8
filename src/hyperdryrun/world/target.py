"""The device a job is judged against, resolved once: :class:`DeviceTarget`.

Every front door (``run``, ``script``, ``torchtitan``, ``fit``) takes the same flags for it (``--target-device``,
``--gpu``, ``--alloc-conf``, ``--device-memory-gib``, ``--margin-gib`` / ``--margin-pct``); the job config holds
them (:attr:`hyperdryrun.config.JobConfig.target`), and what follows from them (the GPU preset's capacity, rates,
SDPA rules and cuBLAS workspace, the CUDA runtime's settings, the capacity the verdict uses and its margin) is read
here and nowhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hyperdryrun.allocator.verdict import Margin
from hyperdryrun.world.gpus import DEFAULT_GPU, GiB, GpuPreset, Rates, gpu_preset
from hyperdryrun.world.runtime import CudaRuntime


@dataclass(frozen=True)
class DeviceTarget:
    """A resolved device target: the device whose memory is estimated, its CUDA runtime (GPU preset and
    caching-allocator settings: ``runtime.gpu``, ``runtime.alloc_conf``), the capacity override and the verdict's
    margin. Plain, typed and picklable, so it travels to worker processes as it is."""

    device: str = "cuda"
    """``cuda`` or ``cpu``."""
    runtime: CudaRuntime = field(default_factory=CudaRuntime)
    device_memory_gib: float | None = None
    """The capacity per device given by hand (``--device-memory-gib``); None: the GPU preset's, if one is named."""
    margin: Margin = field(default_factory=Margin)

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"target_device={self.device!r}: choose cuda or cpu")
        gib = self.device_memory_gib
        if gib is not None and not (isinstance(gib, int | float) and gib > 0 and math.isfinite(gib * GiB)):
            raise ValueError(f"device_memory_gib: must be a finite number > 0 (got {gib})")

    @property
    def gpu(self) -> str | None:
        """The GPU preset named (``--gpu``), or None."""
        return self.runtime.gpu

    @property
    def preset(self) -> GpuPreset | None:
        """The named GPU preset (its capacity, rates, SDPA rules, cuBLAS workspace), or None."""
        return None if self.runtime.gpu is None else gpu_preset(self.runtime.gpu)

    @property
    def kernel_preset(self) -> GpuPreset:
        """The GPU whose kernels a CUDA target runs: the named one, else :data:`~hyperdryrun.world.gpus.DEFAULT_GPU`."""
        return self.preset or gpu_preset(DEFAULT_GPU)

    @property
    def capacity_bytes(self) -> int | None:
        """The capacity the verdict uses: ``--device-memory-gib`` when given, else the named GPU's, else None."""
        if self.device_memory_gib is not None:
            return int(round(self.device_memory_gib * GiB))
        preset = self.preset
        return None if preset is None else preset.capacity_bytes

    @property
    def margin_bytes(self) -> int | None:
        """The verdict's margin for :attr:`capacity_bytes` (None without a capacity)."""
        capacity = self.capacity_bytes
        return None if capacity is None else self.margin.bytes_for(capacity)

    @property
    def rates(self) -> Rates:
        """The step-time estimate's rates: the named GPU's, else :data:`~hyperdryrun.world.gpus.DEFAULT_GPU`'s."""
        return self.kernel_preset.rates

    def label(self) -> str:
        """``h100-80gb (79.11 GiB)``, ``64.00 GiB``, or ``no capacity``: what a table's title says of the device."""
        capacity = self.capacity_bytes
        size = "no capacity" if capacity is None else f"{capacity / GiB:.2f} GiB"
        return f"{self.gpu} ({size})" if self.gpu and capacity is not None else size


__all__ = ["DeviceTarget"]
