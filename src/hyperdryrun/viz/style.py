"""Colours and units shared by the PNG plots and the HTML report, so a category looks the same everywhere."""

from __future__ import annotations

from hyperdryrun.report.schema import GIB, MIB
from hyperdryrun.trace.blocks import Category, Phase

CATEGORY_COLORS = {
    Category.PARAMETER: "#4e79a7",
    Category.BUFFER: "#76b7b2",
    Category.GRADIENT: "#f28e2b",
    Category.OPTSTATE: "#e15759",
    Category.ACTIVATION: "#59a14f",
    Category.TEMP: "#edc948",
    Category.OTHER: "#bab0ac",
}
"""Tableau 10 hues: distinguishable, and the ones PyTorch's memory viewer draws with."""

PHASE_COLORS = {
    Phase.INITIALIZATION: "#f2f2f2",
    Phase.FORWARD: "#e3edf7",
    Phase.BACKWARD: "#f9e9dd",
    Phase.RECOMPUTE: "#efe4f3",
    Phase.OPTIMIZER: "#e4f1e2",
}
"""Pale bands behind the timeline: they tint, the categories stay readable on top."""

SIDE_COLORS = ["#1f3b73", "#c0392b", "#16a085", "#8e44ad", "#d35400", "#2c3e50", "#7f8c8d", "#27ae60"]
"""One line per rank or per side of a comparison (cycled)."""

PEAK_COLOR = "#111111"
RESERVED_COLOR = "#6b4c9a"
DEVICE_COLOR = "#333333"


def byte_unit(max_bytes: int) -> tuple[str, int]:
    """The axis unit for values up to ``max_bytes``: GiB from 0.1 GiB up, else MiB (as the console prints)."""
    return ("GiB", GIB) if max_bytes >= GIB // 10 else ("MiB", MIB)
