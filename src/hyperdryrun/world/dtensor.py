"""DTensor behaviour that would put phantom allocations into the trace, and the patches that keep them out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperdryrun.world.patches import Patch


def untracked_sharding_propagation(tracker_of: Callable[[], Any]) -> list[Patch]:
    """DTensor's sharding propagation (torch 2.13 ``ShardingPropagator._propagate_tensor_meta_non_cached``) runs
    each op once more on *global*-shape fake tensors, under the active fake mode, to learn the output's metadata.
    Those are not device allocations; and since its results are cached per process, counting them would also make
    a second identical run in the same process differ from the first. The tracker is paused while it runs."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    orig = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate_untracked(self: Any, op_schema: Any) -> Any:
        tracker = tracker_of()
        if tracker is None:
            return orig(self, op_schema)
        with tracker.paused():
            return orig(self, op_schema)

    return [
        Patch(
            ShardingPropagator,
            "_propagate_tensor_meta_non_cached",
            propagate_untracked,
            "torch 2.13 DTensor runs sharding propagation's shape inference on global-shape fake tensors under "
            "the active fake mode (and caches it per process)",
        )
    ]
