"""Real memory, in the dry run's format: allocation events from real runs -> blocks, tasks and peak.

:mod:`hyperdryrun.ingest.events` is the common core; each source (profiler, trace file, snapshot) has a module that
turns it into :class:`AllocEvent` lists.
"""

from hyperdryrun.ingest.events import AllocEvent, FrameTable, normalize_device, same_device, trace_from_events

__all__ = ["AllocEvent", "FrameTable", "normalize_device", "same_device", "trace_from_events"]
