"""torch's DTensor sharding propagation (``torch/distributed/tensor/_sharding_prop.py``) and DeviceMesh
(``torch/distributed/device_mesh.py``), by release."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hyperdryrun.patches import Patch


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


def strided_shard_flag_patches() -> list[Patch]:
    """Patches that make DTensor's sharding propagation cheaper without changing any result: torch 2.12 and later
    call ``_propagate_use_strided_shard_flag`` once per child of a foreach op's strategy (see the reason); none
    where the release lacks it (:func:`strided_shard_flag_propagation`: torch 2.11)."""
    sharding_prop = strided_shard_flag_propagation()
    if sharding_prop is None:
        return []
    from torch.distributed.tensor.placement_types import _StridedShard

    original = sharding_prop._propagate_use_strided_shard_flag
    # The OpSchema seen last (held, so `is` cannot match a recycled id) and whether any input is _StridedShard.
    last: list[Any] = [None, False]

    def propagate_use_strided_shard_flag(op_strategy: Any, op_schema: Any) -> None:
        if last[0] is not op_schema:
            strided = any(
                isinstance(p, _StridedShard) for spec in op_schema.args_spec for p in spec.placements
            )
            last[0], last[1] = op_schema, strided
        if last[1]:
            original(op_strategy, op_schema)

    return [
        Patch(
            sharding_prop,
            "_propagate_use_strided_shard_flag",
            propagate_use_strided_shard_flag,
            reason="torch 2.12+ ShardingPropagator.propagate_op_sharding_non_cached calls "
            "_propagate_use_strided_shard_flag(child, op_schema) for every child of a foreach op's TupleStrategy, "
            "and each call flattens the whole foreach schema: O(tensors^2) per foreach op on a cache miss (5.4 s "
            "CPU of the first AdamW step of the Llama-3-8B FSDP8 job). With no _StridedShard among the inputs the "
            "call is a no-op, and OpSchema is immutable, so that answer is computed once per schema.",
        )
    ]


def untracked_propagation_patches(run_untracked: Callable[[Callable[[], Any]], Any]) -> list[Patch]:
    """DTensor's sharding propagation (torch 2.11 to 2.14 ``ShardingPropagator._propagate_tensor_meta_non_cached``,
    ``_sharding_prop.py``) runs each op once more on *global*-shape fake tensors, under the active fake mode, to
    learn the output's metadata: not device allocations. ``run_untracked(call)`` runs it (the world pauses its
    tracker)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    orig = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate_untracked(self: Any, op_schema: Any) -> Any:
        return run_untracked(lambda: orig(self, op_schema))

    return [
        Patch(
            ShardingPropagator,
            "_propagate_tensor_meta_non_cached",
            propagate_untracked,
            "torch 2.13 DTensor runs sharding propagation's shape inference on global-shape fake tensors under "
            "the active fake mode (and caches it per process)",
        )
    ]


def clear_caches() -> None:
    """torch 2.13 DTensor caches sharding decisions keyed by DeviceMesh, whose equality ignores the process groups:
    after one world is destroyed, the next world's equal-looking mesh would get specs naming the old, dead groups
    ("Could not resolve the process group registered under the name ..."). The world clears them on entry and
    exit (``_sharding_prop.py``, ``_redistribute.py``, ``debug/__init__.py``).

    ``debug._clear_sharding_prop_cache`` is two calls, made here directly where the release has both: importing
    ``torch.distributed.tensor.debug`` imports its ``CommDebugMode``, hence ``torch.distributed._tools`` and with it
    ``torch._inductor``, ``torch._dynamo`` and triton (about a third of a second of CPU for a command that uses
    none of them)."""
    from torch.distributed.tensor._api import DTensor
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    python_cache = getattr(
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None
    )
    fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if python_cache is not None and fast_path is not None:
        python_cache()  # debug._clear_python_sharding_prop_cache
        fast_path()  # debug._clear_fast_path_sharding_prop_cache
    else:  # another release: its own debug helper clears whatever caches it has
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()  # the Python LRU cache and the C++ fast path's
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    clear_redistribute_planner_cache()


def device_mesh_patches() -> list[Patch]:
    """``DeviceMesh.mesh`` read inside the dry run's fake mode has values again.

    torch 2.11 to 2.14 (``torch/distributed/device_mesh.py``): ``mesh`` is a property that remaps the mesh's rank
    map through its layout with tensor ops on every read (``_layout.remap_to_tensor(_rank_map)``); read under the
    active FakeTensorMode it returns a fake tensor, whose ``.tolist()`` has no values (torchtitan's DistMuon reads
    its parameters' mesh ranks that way). The rank map is a real CPU tensor (the world builds its meshes outside
    fake mode), so the property runs with the dispatch modes set aside: a small host tensor, never device memory.
    Feature detection: nothing to patch where ``mesh`` is not a property."""
    from torch.distributed.device_mesh import DeviceMesh

    prop = DeviceMesh.__dict__.get("mesh")
    if not isinstance(prop, property) or prop.fget is None:
        return []
    from torch.utils._python_dispatch import _disable_current_modes

    fget = prop.fget

    def mesh(self: Any) -> Any:
        with _disable_current_modes():
            return fget(self)

    return [
        Patch(
            DeviceMesh,
            "mesh",
            property(mesh, doc=prop.__doc__),
            "torch 2.11-2.14 DeviceMesh.mesh computes the mesh tensor with tensor ops on every read: under the dry "
            "run's FakeTensorMode it is a fake tensor without values (mesh.mesh.tolist() fails)",
        )
    ]
