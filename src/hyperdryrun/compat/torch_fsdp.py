"""torch's FSDP2 (``torch/distributed/fsdp/_fully_shard/``), by release."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperdryrun.patches import Patch


def accumulated_grad_copy() -> bool:
    """Whether FSDP2 accumulates a parameter's unsharded gradient in a copy of its own while gradient sync is off.

    torch 2.11 to 2.14 (``_fsdp_param.py``): ``FSDPParam.to_accumulated_grad_if_needed`` moves the unsharded
    gradient into ``unsharded_accumulated_grad``, cast to ``reduce_dtype``, a tensor no gradient hook sees
    (:func:`hyperdryrun.world.fsdp.gradient_accumulation_buffers` labels it). torch 2.15 removed the method: the
    autograd leaf owns accumulation and ``unsharded_accumulated_grad`` is a property returning the parameter's
    ``grad`` (feature detection: ``hasattr``).
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return hasattr(FSDPParam, "to_accumulated_grad_if_needed")


def accumulated_grad_patches(on_accumulated: Callable[[Any], None]) -> list[Patch]:
    """``FSDPParam.to_accumulated_grad_if_needed`` that then calls ``on_accumulated(self)`` (the world labels
    ``unsharded_accumulated_grad`` a gradient: no gradient hook sees that copy); none where the release has no such
    copy (:func:`accumulated_grad_copy`: torch 2.15)."""
    if not accumulated_grad_copy():
        return []
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    orig = FSDPParam.to_accumulated_grad_if_needed

    def to_accumulated_grad_if_needed(self: Any) -> None:
        orig(self)
        on_accumulated(self)

    return [
        Patch(
            FSDPParam,
            "to_accumulated_grad_if_needed",
            to_accumulated_grad_if_needed,
            "torch 2.13 FSDP2 accumulates unsharded gradients in a reduce_dtype copy that no gradient hook sees",
        )
    ]


def spmd_types_supported() -> bool:
    """Whether this torch's ``fully_shard`` takes spmd_types-annotated parameters (pytorch/pytorch#181519, after
    torch 2.13.0): torchtitan 0.3.0's default ``spmd_backend="spmd_types"`` shards through it.
    Feature detection: ``FSDPParam._spmd_types_to_dtensor`` (``_fsdp_param.py``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return hasattr(FSDPParam, "_spmd_types_to_dtensor")


def shard_placement_result() -> Any | None:
    """FSDP2's per-parameter mesh: a ``shard_placement_fn`` may return a ``ShardPlacementResult`` (placement and
    mesh) in torch 2.12 to 2.15 (``_fsdp_common.py``), which torchtitan 0.3.0's MoE units use to shard routed
    experts over their own mesh inside a block's unit; torch 2.11 has only a ``Shard`` (None: feature detection)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    return getattr(_fsdp_common, "ShardPlacementResult", None)
