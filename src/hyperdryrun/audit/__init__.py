"""The kernel audit: where CPU kernels allocate or save for backward differently from CUDA's.

A development tool, not part of the runtime (nothing under ``hyperdryrun.world`` or the engine imports it). The same
catalogue of common layers (:mod:`~hyperdryrun.audit.layers`) runs on fake tensors under an op recorder
(:mod:`~hyperdryrun.audit.recorder`): on the simulation device (fake "cpu" with the target-kernel patches of
:mod:`hyperdryrun.world.kernels`) and, on a CUDA build of torch, on fake "cuda" to record the reference, whose
backward walks the autograd graph by hand (:mod:`~hyperdryrun.audit.backward`). :mod:`~hyperdryrun.audit.diff`
compares two records; :mod:`~hyperdryrun.audit.reference` holds the record/compare entry points. The command line is
``hyperdryrun audit-kernels`` (``--record FILE`` on the CUDA wheel, ``--reference FILE`` anywhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperdryrun.lazy import lazy_exports

if TYPE_CHECKING:
    from hyperdryrun.audit.backward import walk_backward
    from hyperdryrun.audit.diff import diff_layer, summary
    from hyperdryrun.audit.layers import LAYERS
    from hyperdryrun.audit.recorder import OpRecorder, saved_tensors
    from hyperdryrun.audit.reference import (
        SCHEMA_VERSION,
        compare,
        describe_reference,
        load_reference,
        record,
        run_layer,
        simulation,
    )

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "hyperdryrun.audit.backward": ("walk_backward",),
        "hyperdryrun.audit.diff": (
            "diff_layer",
            "summary",
        ),
        "hyperdryrun.audit.layers": ("LAYERS",),
        "hyperdryrun.audit.recorder": (
            "OpRecorder",
            "saved_tensors",
        ),
        "hyperdryrun.audit.reference": (
            "SCHEMA_VERSION",
            "compare",
            "describe_reference",
            "load_reference",
            "record",
            "run_layer",
            "simulation",
        ),
    },
)

__all__ = [
    "LAYERS",
    "SCHEMA_VERSION",
    "OpRecorder",
    "compare",
    "describe_reference",
    "diff_layer",
    "load_reference",
    "record",
    "run_layer",
    "saved_tensors",
    "simulation",
    "summary",
    "walk_backward",
]
