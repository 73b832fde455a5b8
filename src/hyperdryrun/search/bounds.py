"""Lower bounds on a rank's dry-run peak, from the parameter shapes alone: what a search prunes with.

When the optimizer step starts, every local parameter, its gradient and its optimizer states are alive at once
(the step reads all of them), so the peak of the step is at least their sum. Each term is counted at the bytes of
the rank's local shard (:func:`hyperdryrun.search.classes.local_shape`) in the stored dtype, without the 512-byte
rounding or FSDP2's padding to equal shards, both of which only add: the bound never exceeds the dry-run peak
(``tests/search/test_bounds.py`` checks it against simulated peaks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperdryrun.search.classes import group_index, group_sizes, local_shape, stage_params

if TYPE_CHECKING:
    from hyperdryrun.config import JobConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def optimizer_states(cfg: JobConfig) -> int:
    """Optimizer state tensors per parameter, each of the parameter's shape and dtype: AdamW/Adam ``exp_avg`` and
    ``exp_avg_sq``; SGD a ``momentum_buffer`` when momentum is not 0 (torch 2.13 creates none otherwise)."""
    t = cfg.training
    if t.optimizer in ("AdamW", "Adam"):
        return 2
    return 1 if t.momentum != 0 else 0


@dataclass(frozen=True)
class StateBound:
    """A rank's local parameter elements and what they hold at the optimizer step."""

    rank: int
    param_elements: int
    bytes_per_element: int
    """Parameter + gradient + optimizer states, in the stored dtype."""

    @property
    def bytes(self) -> int:
        return self.param_elements * self.bytes_per_element


def state_bound(cfg: JobConfig, rank: int) -> StateBound:
    """Rank ``rank``'s sharded parameters + gradients + optimizer states: a lower bound on its peak."""
    dims = cfg.dims
    c = dims.coordinates(rank)
    sizes, index = group_sizes(dims), group_index(dims, c)
    elements = sum(s.count * math.prod(local_shape(s, sizes, index)) for s in stage_params(cfg, c.stages))
    per = DTYPE_BYTES[cfg.training.dtype] * (2 + optimizer_states(cfg))
    return StateBound(rank, elements, per)


def worst_state_bound(cfg: JobConfig, ranks: list[int]) -> StateBound:
    """The largest :func:`state_bound` over ``ranks`` (one per rank class suffices: a class shares its shapes)."""
    return max((state_bound(cfg, r) for r in ranks), key=lambda b: (b.bytes, -b.rank))
