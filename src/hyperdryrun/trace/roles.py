"""Which tensors play which role in a training step, and when that becomes known: the one set of rules that the
dry run's tracker and the measured run's profiler markers both follow.

Allocations alone do not say that a storage is a parameter or a gradient; hooks at the moments a role becomes
certain report it through ``mark(tensor, category)``. The tracker passes :meth:`MemoryTracker.mark` and calls the
rules from its own module and optimizer hooks; a measured run passes the profiler's marker and
:meth:`RoleMarker.hooked` registers the hooks.

>>> roles = RoleMarker(mark)
>>> with roles.hooked():
...     step_fn(model, optimizer, batches)
>>> roles.step_done(model)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from hyperdryrun.trace.blocks import Category
from hyperdryrun.trace.optimizer_state import state_tensors

Mark = Callable[[torch.Tensor, Category], None]
"""``mark(tensor, category)``: ``tensor``'s storage (its rank-local shard for a DTensor) plays ``category``."""


class RoleMarker:
    """The role rules of one step, each reported through ``mark``:

    - a module's parameters and buffers whenever it runs forward, on entry and on exit (FSDP2 swaps its unsharded
      parameters in in its pre-forward hook and may swap them out in its post-forward hook);
    - a parameter's gradient when autograd accumulates it (with ``gradients_on_accumulation``; FSDP2 frees the
      unsharded gradients it reduce-scatters before the optimizer runs, so only this hook sees them);
    - every gradient when the optimizer step starts, the optimizer's device states when it ends;
    - the gradients still held when the step is over.
    """

    def __init__(self, mark: Mark, *, gradients_on_accumulation: bool = True) -> None:
        self.mark = mark
        self.gradients_on_accumulation = gradients_on_accumulation
        self._hooked: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._handles: list[Any] = []

    def module_runs(self, mod: torch.nn.Module) -> None:
        """At a module's forward entry and exit: its own parameters and buffers (and gradient hooks on them)."""
        for p in mod._parameters.values():
            if p is None:
                continue
            self.mark(p, Category.PARAMETER)
            if self.gradients_on_accumulation and p.requires_grad and p not in self._hooked:
                self._hooked[p] = True
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_accumulated))
        for b in mod._buffers.values():
            if b is not None:
                self.mark(b, Category.BUFFER)

    def _grad_accumulated(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.mark(p.grad, Category.GRADIENT)

    def optimizer_starts(self, opt: torch.optim.Optimizer) -> None:
        """Before ``opt.step()``: the gradients it reads."""
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.mark(p.grad, Category.GRADIENT)

    def optimizer_done(self, opt: torch.optim.Optimizer) -> None:
        """After ``opt.step()``: its device states, wherever the optimizer object keeps them
        (:func:`~hyperdryrun.trace.optimizer_state.state_tensors`)."""
        for _, v in state_tensors(opt):
            self.mark(v, Category.OPTSTATE)

    def step_done(self, model: torch.nn.Module, optimizer: Any = None) -> None:
        """After the step: gradients a step function kept (one that does not zero them), and the optimizer's
        states wherever it keeps them (a container's inner optimizers, wrappers: what survives the step)."""
        for p in model.parameters():
            if p.grad is not None:
                self.mark(p.grad, Category.GRADIENT)
        if optimizer is not None:
            for _, v in state_tensors(optimizer, model):
                self.mark(v, Category.OPTSTATE)

    def remove(self) -> None:
        """Remove the gradient hooks placed on parameters (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooked = WeakIdKeyDictionary()

    @contextlib.contextmanager
    def hooked(self) -> Iterator[RoleMarker]:
        """The rules as global module and optimizer hooks for the body, for a recorder without hooks of its own;
        every hook is removed on exit, also after an exception."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        handles = [
            register_module_forward_pre_hook(lambda mod, *_: self.module_runs(mod)),
            register_module_forward_hook(lambda mod, *_: self.module_runs(mod)),
            register_optimizer_step_pre_hook(lambda opt, *_: self.optimizer_starts(opt)),
            register_optimizer_step_post_hook(lambda opt, *_: self.optimizer_done(opt)),
        ]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self.remove()
