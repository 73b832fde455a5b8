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


def foreach_strategy_expansion() -> Any | None:
    """The module whose ``_expand_single_dim_strategy_to_mesh`` DTensor's sharding propagation calls by name, or
    None where torch has none (feature detection)."""
    import torch.distributed.tensor._sharding_prop as sharding_prop

    return sharding_prop if hasattr(sharding_prop, "_expand_single_dim_strategy_to_mesh") else None


def _child_key(child: Any) -> tuple[Any, ...] | None:
    """What a foreach child's input strategy is, as DTensor's strategy expansion reads it, or None where it is not
    the plain form sharding propagation wraps an input in (one ``OpSpec`` per strategy, a single ``DTensorSpec``
    output, no input specs): its specs (``DTensorSpec`` equality: mesh, placements, shard order, shape, stride,
    dtype) and, explicitly, each spec's tensor meta and ``use_strided_shard_as_shard_order`` flag."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpStrategy

    if not isinstance(child, OpStrategy):
        return None
    key: list[Any] = []
    for spec in child.strategies:
        out = spec.output_specs
        if not isinstance(out, DTensorSpec) or spec.input_specs is not None:
            return None
        key.append((out, out.tensor_meta, getattr(out, "use_strided_shard_as_shard_order", None)))
    return tuple(key)


def foreach_strategy_patches() -> list[Patch]:
    """Patches that expand a foreach op's sharding strategy once per distinct element instead of once per element
    (:func:`foreach_strategy_expansion`; none where the release lacks it)."""
    sharding_prop = foreach_strategy_expansion()
    if sharding_prop is None:
        return []
    from torch.distributed.tensor._op_schema import OpSchema, TupleStrategy

    original = sharding_prop._expand_single_dim_strategy_to_mesh

    def expand(mesh: Any, op_schema: Any, strategy_info: Any, output_tensor_meta: Any) -> Any:
        fn = original(mesh, op_schema, strategy_info, output_tensor_meta)
        if getattr(fn, "__name__", None) != "expanded_foreach_strategy":
            return fn
        lists = [a for a in op_schema.args_schema if isinstance(a, TupleStrategy)]
        count = len(lists[0].children) if lists else 0
        if not lists or any(len(a.children) != count for a in lists):
            return fn  # torch's own function raises for mismatched lists
        firsts: dict[Any, int] = {}
        slots: list[int] = []  # element -> its distinct element
        reps: list[int] = []  # distinct element -> the first element like it
        try:
            for k in range(count):
                keys = tuple(_child_key(a.children[k]) for a in lists)
                if any(key is None for key in keys):
                    return fn
                meta = None if output_tensor_meta is None else output_tensor_meta[k]
                slot = firsts.setdefault((keys, meta), len(firsts))
                if slot == len(reps):
                    reps.append(k)
                slots.append(slot)
        except TypeError:  # unhashable: symbolic sizes
            return fn
        if len(firsts) == count:
            return fn
        reduced = OpSchema(
            op_schema.op,
            tuple(
                TupleStrategy(children=[a.children[k] for k in reps]) if isinstance(a, TupleStrategy) else a
                for a in op_schema.args_schema
            ),
            op_schema.kwargs_schema,
            schema_info=op_schema.schema_info,
        )
        reduced_meta = None if output_tensor_meta is None else [output_tensor_meta[k] for k in reps]
        reduced_fn = original(mesh, reduced, strategy_info, reduced_meta)

        def expanded_foreach_strategy(op: Any, args_schema: Any, kwargs_schema: Any) -> Any:
            children = reduced_fn(op, reduced.args_meta, reduced.kwargs_meta).children
            return TupleStrategy(children=[children[j] for j in slots])

        return expanded_foreach_strategy

    return [
        Patch(
            sharding_prop,
            "_expand_single_dim_strategy_to_mesh",
            expand,
            reason="torch 2.11 to 2.15 DTensor (_ops/single_dim_strategy.py) expands a foreach op's strategy per "
            "element: for each index it builds that element's OpSchema (the i-th child of every tensor-list "
            "argument, the same other arguments, the i-th output TensorMeta) and expands it alone, about 1.4 ms "
            "CPU each (the first AdamW step of the Llama-3-8B FSDP8 job: 7 foreach ops x 227 shards, ~2 s). "
            "An element's strategy depends on nothing else, so elements whose inputs and output metadata are "
            "equal get one expansion, shared (read-only downstream: child selection and the strided-shard flag, "
            "which is the same for every child of one schema).",
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
        distinct = _distinct_foreach_elements(op_schema)
        if distinct is not None:
            reduced, slots = distinct
            out = run_untracked(lambda: orig(self, reduced))
            if out is None:
                return None
            if isinstance(out, (list, tuple)) and len(out) == max(slots) + 1:
                return type(out)(out[j] for j in slots)
        return run_untracked(lambda: orig(self, op_schema))

    return [
        Patch(
            ShardingPropagator,
            "_propagate_tensor_meta_non_cached",
            propagate_untracked,
            "torch 2.13 DTensor runs sharding propagation's shape inference on global-shape fake tensors under "
            "the active fake mode (and caches it per process); for a foreach op, over every element (the 8B "
            "FSDP8 job's AdamW: 7 ops x 227 parameters), where the elements of equal metadata are run once",
        )
    ]


def _distinct_foreach_elements(op_schema: Any) -> tuple[Any, list[int]] | None:
    """For a foreach op whose list arguments are lists of DTensor specs and of Python scalars: the schema with one
    element per distinct element (equal ``TensorMeta`` in every spec list: what ``OpSchema.gen_fake_args`` builds
    the global-shape fake tensor from, and the equal scalar, type and value, in every scalar list) and, per element,
    the index of its representative; None otherwise (another op, a list of something else, symbolic sizes,
    nothing to share).

    A foreach op's i-th output is computed from the i-th elements of its lists and the shared arguments alone
    (that is what ``foreach`` means, and why torch can fall back to a loop of the per-element op), so its metadata
    is that of the representative's output."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema

    if not str(op_schema.op.name()).startswith("aten::_foreach_"):
        return None
    positions, specs, scalars = [], [], []
    for i, arg in enumerate(op_schema.args_schema):
        if isinstance(arg, (list, tuple)):
            if arg and all(isinstance(x, DTensorSpec) for x in arg):
                specs.append(i)
            elif arg and all(type(x) in (bool, int, float) for x in arg):
                scalars.append(i)  # a ScalarList (AdamW's per-parameter step sizes): each element's own value
            else:
                return None
            positions.append(i)
    if not specs or any(isinstance(v, (list, tuple)) for v in op_schema.kwargs_schema.values()):
        return None
    count = len(op_schema.args_schema[positions[0]])
    if any(len(op_schema.args_schema[i]) != count for i in positions):
        return None
    firsts: dict[Any, int] = {}
    slots: list[int] = []
    reps: list[int] = []
    try:
        for k in range(count):
            metas = tuple(op_schema.args_schema[i][k].tensor_meta for i in specs)
            if any(meta is None for meta in metas):
                return None
            metas += tuple((type(v), v) for v in (op_schema.args_schema[i][k] for i in scalars))
            slot = firsts.setdefault(metas, len(firsts))
            if slot == len(reps):
                reps.append(k)
            slots.append(slot)
    except TypeError:  # unhashable: symbolic sizes
        return None
    if len(reps) == count:
        return None
    args = list(op_schema.args_schema)
    for i in positions:
        args[i] = type(args[i])(args[i][k] for k in reps)
    return OpSchema(
        op_schema.op, tuple(args), op_schema.kwargs_schema, schema_info=op_schema.schema_info
    ), slots


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


def unflatten_mesh(mesh: Any, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """``mesh._unflatten(dim, sizes, names)``, the dimension given by its index.

    torch 2.11 (``torch/distributed/device_mesh.py``, ``DeviceMesh._unflatten``) inverts its name check: a
    dimension the mesh has is refused ("dim dp_shard specified in `_unflatten` is not in ('pp', 'dp_replicate',
    'dp_shard', 'cp', 'tp')"), which stopped every expert-parallel job at its parallelize step; 2.12 to 2.15 check
    the name the right way round and take an index alike (they turn a name into its index first)."""
    return mesh._unflatten(list(mesh.mesh_dim_names).index(dim), sizes, names)
