"""Real memory, in the dry run's format: allocation events from real runs -> blocks, tasks and peak.

:mod:`hyperdryrun.ingest.events` is the common core; each source (profiler, trace file, snapshot) has a module that
turns it into :class:`AllocEvent` lists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperdryrun.lazy import lazy_exports

if TYPE_CHECKING:
    from hyperdryrun.ingest.events import (
        AllocEvent,
        FrameTable,
        normalize_device,
        same_device,
        trace_from_events,
    )

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "hyperdryrun.ingest.events": (
            "AllocEvent",
            "FrameTable",
            "normalize_device",
            "same_device",
            "trace_from_events",
        ),
    },
)

__all__ = ["AllocEvent", "FrameTable", "normalize_device", "same_device", "trace_from_events"]
