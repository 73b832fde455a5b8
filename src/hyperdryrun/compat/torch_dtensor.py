"""torch's DTensor sharding propagation (``torch/distributed/tensor/_sharding_prop.py``), by release."""

from __future__ import annotations

from typing import Any


def strided_shard_flag_propagation() -> Any | None:
    """The module whose ``_propagate_use_strided_shard_flag`` DTensor calls on every sharding-cache miss, or None
    where torch has no such function.

    torch 2.12 and later (``torch/distributed/tensor/_sharding_prop.py``): after a strategy is produced,
    ``ShardingPropagator.propagate_op_sharding_non_cached`` calls ``_propagate_use_strided_shard_flag(strategy,
    op_schema)`` (once for an ``OpStrategy``, once per child of a foreach op's ``TupleStrategy``) to carry
    ``use_strided_shard_as_shard_order`` from the inputs' ``_StridedShard`` placements to the outputs. torch 2.11
    has neither the function nor the flag (feature detection: ``hasattr``), so there is nothing to speed up there.
    """
    import torch.distributed.tensor._sharding_prop as sharding_prop

    return sharding_prop if hasattr(sharding_prop, "_propagate_use_strided_shard_flag") else None
