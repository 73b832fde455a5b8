"""Tensor helpers shared by the tracker, the world, the parallelisms and the measured run: module names, rank-local
tensors, the tensors of an op, storage bytes, and what exists before a step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from hyperdryrun.trace.blocks import Category, round_size
from hyperdryrun.trace.optimizer_state import state_tensors


def clean_fqn(name: str) -> str:
    """A module's FQN as the user wrote it: activation-checkpoint wrappers removed, ``<root>`` for the model."""
    return (
        name.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module", "") or "<root>"
    )


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind a DTensor (or the tensor itself)."""
    inner = getattr(t, "_local_tensor", None)
    return inner if inner is not None else t


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in an op's args/outputs: aten schemas nest at most lists inside tuples/dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            if isinstance(x, torch.Tensor):
                yield x
            elif isinstance(x, (list, tuple, dict)):
                yield from iter_tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from iter_tensors(x)


def unique_storage_bytes(obj: Any, alignment: int) -> int:
    """Bytes of the distinct storages behind the tensors in ``obj`` (DTensors counted by their local shard)."""

    seen, total = set(), 0
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            st = local_tensor(leaf).untyped_storage()
            if id(st) not in seen:
                seen.add(id(st))
                total += round_size(st.nbytes(), alignment)
    return total


def resident_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Iterator[tuple[torch.Tensor, Category, str]]:
    """What exists before a step, as ``(rank-local tensor, category, owning module FQN)``: parameters, leftover
    gradients, buffers and optimizer states, each owned by the module that holds it (so "which module holds the
    peak" counts its weights too). The dry run seeds these as blocks; a measured run as resident storages."""
    owners: dict[int, str] = {}
    for name, mod in model.named_modules(remove_duplicate=True):
        fqn = clean_fqn(name)
        for p in mod.parameters(recurse=False):
            if id(p) in owners:
                continue
            owners[id(p)] = fqn
            yield local_tensor(p), Category.PARAMETER, fqn
            if p.grad is not None:
                yield local_tensor(p.grad), Category.GRADIENT, fqn
        for b in mod.buffers(recurse=False):
            yield b, Category.BUFFER, fqn
    for p, v in state_tensors(optimizer, model):
        yield local_tensor(v), Category.OPTSTATE, owners.get(id(p), "")
