"""Pictures of a memory report: a PyTorch memory snapshot, PNG plots and a self-contained HTML report.

Each writer reads plain data (report dicts and traces, see :mod:`hyperdryrun.viz.data`) and writes one kind of file,
so a command or a reporter calls it after a run, a measurement, an ingestion or a comparison alike.
"""

from __future__ import annotations

from hyperdryrun.viz.data import Side, VizInputError, load_output_dir, load_side
from hyperdryrun.viz.snapshot import Segment, SnapshotError, build_snapshot, write_snapshot

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
