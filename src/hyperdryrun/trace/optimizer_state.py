"""Optimizer states of any optimizer object: the device tensors it holds that are not the model's own.

``optimizer.state`` of the object passed in is not enough: torchtitan's ``OptimizersContainer`` keeps the states
in its inner optimizers, jobs pass dicts or lists of optimizers or wrappers that hold one, and some optimizers keep
state in attributes. What survives the optimizer step, whoever owns it, is found by walking what the optimizer
object references (attributes, dicts, lists, inner optimizers' ``state``), not through modules, and leaving out the
model's parameters, their gradients and buffers: the steady-state step starts with those states allocated
(:func:`warm_up`), and a tensor the traced step leaves there is state too.

>>> warm_up(optimizer)                        # step 1's lazy state creation, on zero gradients
>>> [v for _, v in state_tensors(optimizer, model)]
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

MAX_DEPTH = 12
"""How deep references are followed from the optimizer object (containers of containers of optimizers...)."""

_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.device, torch.dtype, torch.Size)
_OPAQUE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, nn.Module)
_OPTIMIZER_SKIP = {"state", "param_groups", "defaults"}
"""Optimizer attributes that are not walked generically: ``state`` is read in parameter order (below), parameter
groups and defaults hold the parameters and hyperparameters."""


def _storage_key(t: torch.Tensor) -> int:
    inner = getattr(t, "_local_tensor", None)
    return id((inner if inner is not None else t).untyped_storage())


def _opaque(obj: Any) -> bool:
    """Objects whose references are not optimizer state: modules, functions, classes, and torch.distributed's
    meshes, process groups and FSDP states (a mesh holds a host tensor of ranks)."""
    if isinstance(obj, _OPAQUE):
        return True
    module = type(obj).__module__ or ""
    return module.startswith(("torch.distributed", "torch._C")) and not isinstance(obj, torch.optim.Optimizer)


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    out = []
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        out += [
            v for k, v in d.items() if not (isinstance(obj, torch.optim.Optimizer) and k in _OPTIMIZER_SKIP)
        ]
    for slot in getattr(type(obj), "__slots__", ()):
        if isinstance(slot, str) and hasattr(obj, slot):
            out.append(getattr(obj, slot))
    return out


def torch_optimizers(obj: Any) -> list[torch.optim.Optimizer]:
    """The outermost ``torch.optim.Optimizer`` objects reachable from ``obj`` (``[obj]`` if it is one): the ones
    to step, since an optimizer steps the optimizers it contains."""
    found: list[torch.optim.Optimizer] = []
    seen: set[int] = set()

    def walk(x: Any, depth: int) -> None:
        if id(x) in seen or depth > MAX_DEPTH or isinstance(x, (_LEAVES, torch.Tensor)) or _opaque(x):
            return
        seen.add(id(x))
        if isinstance(x, torch.optim.Optimizer):
            found.append(x)
            return
        for child in _children(x):
            walk(child, depth + 1)

    walk(obj, 0)
    return found


def _all_torch_optimizers(obj: Any) -> list[torch.optim.Optimizer]:
    """Every torch optimizer reachable from ``obj``, inner ones included."""
    out: list[torch.optim.Optimizer] = []
    queue = torch_optimizers(obj)
    seen: set[int] = set()
    while queue:
        opt = queue.pop(0)
        if id(opt) in seen:
            continue
        seen.add(id(opt))
        out.append(opt)
        queue += [o for child in _children(opt) for o in torch_optimizers(child)]
    return out


def _parameters(obj: Any) -> list[torch.Tensor]:
    params, seen = [], set()
    for opt in torch_optimizers(obj):
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
    return params


def warm_up(optimizer: Any) -> None:
    """Step 1's lazy state creation: one optimizer step on zero gradients for every parameter of every torch
    optimizer in ``optimizer`` (the object's own ``step`` and ``zero_grad`` when it has them, else those of each
    optimizer it holds); ``zero_grad(set_to_none=True)`` then drops the gradients."""
    for p in _parameters(optimizer):
        p.grad = torch.zeros_like(p)
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return
    inner = torch_optimizers(optimizer)
    if callable(getattr(optimizer, "step", None)):
        optimizer.step()
    else:
        for opt in inner:
            opt.step()
    for opt in inner:
        opt.zero_grad(set_to_none=True)


def _host_step(key: Any, value: torch.Tensor, group: dict) -> bool:
    """torch 2.13 Adam/AdamW/SGD keep ``state["step"]`` as a host (CPU) scalar unless the group is ``fused`` or
    ``capturable``; on a CUDA target it takes no device memory (on a CPU simulation device it would otherwise be
    indistinguishable from device state)."""
    return key == "step" and value.dim() == 0 and not (group.get("fused") or group.get("capturable"))


def _optimizer_state(opt: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for group in opt.param_groups:
        for p in group["params"]:
            for key, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and not _host_step(key, v, group):
                    yield p, v


def state_tensors(
    optimizer: Any, model: nn.Module | None = None
) -> Iterator[tuple[torch.Tensor | None, torch.Tensor]]:
    """``(parameter or None, state tensor)`` for every device tensor ``optimizer`` holds that is not a parameter,
    a gradient or a buffer: each torch optimizer's ``state`` in parameter order first (the parameter it belongs
    to), then tensors found in attributes, dicts and lists (owner unknown). Each storage once."""
    own: set[int] = set()
    for p in _parameters(optimizer) + (list(model.parameters()) if model is not None else []):
        own.add(_storage_key(p))
        if p.grad is not None:
            own.add(_storage_key(p.grad))
    if model is not None:
        own.update(_storage_key(b) for b in model.buffers())
    seen_storage: set[int] = set()

    def fresh(t: torch.Tensor) -> bool:
        key = _storage_key(t)
        if key in own or key in seen_storage or isinstance(t, nn.Parameter):
            return False
        seen_storage.add(key)
        return True

    optimizers = _all_torch_optimizers(optimizer)
    for opt in optimizers:
        for p, v in _optimizer_state(opt):
            if fresh(v):
                yield p, v
    seen: set[int] = {id(o.state) for o in optimizers}
    stack: list[tuple[Any, int]] = [(optimizer, 0)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, torch.Tensor):
            if fresh(x):
                yield None, x
            continue
        if id(x) in seen or depth > MAX_DEPTH or isinstance(x, _LEAVES) or _opaque(x):
            continue
        seen.add(id(x))
        stack += [(c, depth + 1) for c in reversed(_children(x))]


def describe(optimizer: Any) -> str:
    """``AdamW``; a container with its inner optimizers: ``OptimizersContainer(AdamW)``, ``dict(AdamW, SGD)``."""
    name = type(optimizer).__name__
    inner = [o for o in _all_torch_optimizers(optimizer) if o is not optimizer]
    if not inner:
        return name
    names = list(dict.fromkeys(type(o).__name__ for o in inner))
    return f"{name}({', '.join(names)})"


def no_state_limitation(optimizer: Any, model: nn.Module | None = None) -> list[str]:
    """A limitation line when ``optimizer`` holds no device state after the step (else none)."""
    if next(state_tensors(optimizer, model), None) is not None:
        return []
    return [
        f"the optimizer ({describe(optimizer)}) holds no device tensors after the step: Optstate is 0 B "
        "(right for a stateless optimizer such as SGD without momentum; state kept outside the optimizer object "
        "is not seen)"
    ]
