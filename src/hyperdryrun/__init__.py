"""HyperDryRun: how much accelerator memory each rank of a distributed training job needs, before you have it."""

from hyperdryrun.engine import SimulationError, StepTrace, simulate  # noqa: E402
from hyperdryrun.report import build_report, save_reports  # noqa: E402
from hyperdryrun.trace.blocks import Block, Category, Phase  # noqa: E402
from hyperdryrun.version import __version__
from hyperdryrun.world import SimulatedWorld  # noqa: E402

__all__ = [
    "Block",
    "Category",
    "Phase",
    "SimulatedWorld",
    "SimulationError",
    "StepTrace",
    "build_report",
    "save_reports",
    "simulate",
    "__version__",
]
