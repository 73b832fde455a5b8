"""HyperDryRun: how much accelerator memory each rank of a distributed training job needs, before you have it.

The public names below are imported on first use (PEP 562), so ``import hyperdryrun.<module>`` loads only what that
module needs: ``hyperdryrun.parallel_dims`` and ``hyperdryrun --help`` do not import torch.
"""

from typing import TYPE_CHECKING

from hyperdryrun.lazy import lazy_exports

if TYPE_CHECKING:
    from hyperdryrun.compat.versions import UnsupportedTorchError
    from hyperdryrun.engine import SimulationError, StepTrace, simulate
    from hyperdryrun.report import build_report, save_reports
    from hyperdryrun.trace.blocks import Block, Category, Phase
    from hyperdryrun.version import __version__
    from hyperdryrun.world import SimulatedWorld

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "hyperdryrun.compat.versions": ("UnsupportedTorchError",),
        "hyperdryrun.engine": ("SimulationError", "StepTrace", "simulate"),
        "hyperdryrun.report": ("build_report", "save_reports"),
        "hyperdryrun.trace.blocks": ("Block", "Category", "Phase"),
        "hyperdryrun.version": ("__version__",),
        "hyperdryrun.world": ("SimulatedWorld",),
    },
)

__all__ = [
    "Block",
    "Category",
    "Phase",
    "SimulatedWorld",
    "SimulationError",
    "StepTrace",
    "UnsupportedTorchError",
    "build_report",
    "save_reports",
    "simulate",
    "__version__",
]
