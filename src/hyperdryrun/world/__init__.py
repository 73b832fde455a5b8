"""The simulated world: rank ``r`` of ``N`` with a fake process group, a device mesh and fake tensors.

``SimulatedWorld`` (in :mod:`~hyperdryrun.world.simulated`) restores everything it touches on exit, also when the
body raises: the process group, the dispatch-mode stack, every patch of torch, the default dtype and device, and the
environment. Its names are imported on first use, so the torch-free modules here (``gpus``, ``cuda_target``,
``runtime``) can be imported without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperdryrun.lazy import lazy_exports

if TYPE_CHECKING:
    from hyperdryrun.world.simulated import SimulatedWorld, WorldError, default_simulation_device

__getattr__, __dir__ = lazy_exports(
    __name__, {"hyperdryrun.world.simulated": ("SimulatedWorld", "WorldError", "default_simulation_device")}
)

__all__ = ["SimulatedWorld", "WorldError", "default_simulation_device"]
