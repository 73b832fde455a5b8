"""Where each parameter and buffer was created: the user's line that made it, for the blocks of the set-up.

Parameters, buffers and optimizer states exist before the traced step, so no op of the step made them; their blocks
take the stack of the model code that registered the parameter or buffer (``self.wq = nn.Linear(...)``), captured
while the model is built on meta through torch's global registration hooks. Optimizer states and gradients take
their parameter's. Parallelisms keep the registration: FSDP2 and TP re-register a sharded parameter on the same
module under the same name, so the site is looked up by (module, name) on the parallelized model.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from hyperdryrun.trace.optimizer_state import state_tensors
from hyperdryrun.trace.stacks import Frame, StackTable
from hyperdryrun.trace.tensors import local_tensor

_SITES: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, tuple[Frame, ...]]] = weakref.WeakKeyDictionary()
"""Module -> {parameter or buffer name: user frames of its registration}; an entry dies with its module."""


@contextlib.contextmanager
def recording_sites() -> Iterator[None]:
    """Record the creation site of every parameter and buffer registered inside (the model's build)."""
    table = StackTable()

    def hook(module: torch.nn.Module, name: str, value: Any) -> None:
        if value is not None:
            _SITES.setdefault(module, {})[name] = table.frames(table.capture(sys._getframe(1)))

    handles = [
        register_module_parameter_registration_hook(hook),
        register_module_buffer_registration_hook(hook),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def resident_sites(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[int, tuple[Frame, ...]]:
    """Storage id of each rank-local parameter, gradient, buffer and optimizer state of ``model`` -> the frames of
    the line that created its parameter or buffer (none recorded: no entry)."""
    out: dict[int, tuple[Frame, ...]] = {}
    by_param: dict[int, tuple[Frame, ...]] = {}
    for mod in model.modules():
        sites = _SITES.get(mod)
        if not sites:
            continue
        for name, p in mod._parameters.items():
            frames = sites.get(name)
            if p is None or not frames:
                continue
            by_param.setdefault(id(p), frames)
            out.setdefault(id(local_tensor(p).untyped_storage()), frames)
            if p.grad is not None:
                out.setdefault(id(local_tensor(p.grad).untyped_storage()), frames)
        for name, b in mod._buffers.items():
            frames = sites.get(name)
            if b is not None and frames:
                out.setdefault(id(b.untyped_storage()), frames)
    if optimizer is not None:
        for p, v in state_tensors(optimizer, model):
            frames = by_param.get(id(p))
            if frames:
                out.setdefault(id(local_tensor(v).untyped_storage()), frames)
    return out
