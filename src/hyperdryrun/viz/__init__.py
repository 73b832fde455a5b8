"""Pictures of a memory report: a PyTorch memory snapshot, PNG plots and a self-contained HTML report.

Each writer reads plain data (report dicts and traces, see :mod:`hyperdryrun.viz.data`) and writes one kind of file,
so a command or a reporter calls it after a run, a measurement, an ingestion or a comparison alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperdryrun.lazy import lazy_exports

if TYPE_CHECKING:
    from hyperdryrun.viz.data import Side, VizInputError, load_output_dir, load_side
    from hyperdryrun.viz.snapshot import Segment, SnapshotError, build_snapshot, write_snapshot

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "hyperdryrun.viz.data": (
            "Side",
            "VizInputError",
            "load_output_dir",
            "load_side",
        ),
        "hyperdryrun.viz.snapshot": (
            "Segment",
            "SnapshotError",
            "build_snapshot",
            "write_snapshot",
        ),
    },
)

__all__ = [
    "Segment",
    "Side",
    "SnapshotError",
    "VizInputError",
    "build_snapshot",
    "load_output_dir",
    "load_side",
    "write_snapshot",
]
