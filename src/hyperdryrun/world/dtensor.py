"""DTensor behaviour that would put phantom allocations into the trace, and the patches that keep them out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperdryrun.compat import torch_dtensor
from hyperdryrun.patches import Patch


def untracked_sharding_propagation(tracker_of: Callable[[], Any]) -> list[Patch]:
    """DTensor's sharding propagation (torch 2.13 ``ShardingPropagator._propagate_tensor_meta_non_cached``) runs
    each op once more on *global*-shape fake tensors, under the active fake mode, to learn the output's metadata.
    Those are not device allocations; and since its results are cached per process, counting them would also make
    a second identical run in the same process differ from the first. The tracker is paused while it runs
    (:func:`hyperdryrun.compat.torch_dtensor.untracked_propagation_patches`)."""

    def run_untracked(call: Callable[[], Any]) -> Any:
        tracker = tracker_of()
        if tracker is None:
            return call()
        with tracker.paused():
            return call()

    return torch_dtensor.untracked_propagation_patches(run_untracked)
