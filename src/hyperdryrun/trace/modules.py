"""Forward and backward entry and exit of every module, for the tracker's module stack."""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_leaves


class ModuleHooks:
    """Forward and backward entry/exit of every module: the hook protocol of torch 2.13's
    ``torch.distributed._tools.mod_tracker.ModTracker``, without importing ``torch.distributed._tools`` (whose package
    import pulls in the runtime estimator and inductor, about a second of every run's start-up), without the FQN
    and parent bookkeeping the tracker does not use, and with backward exit at the first input gradient.

    ``pre_fw(mod, inputs)`` / ``post_fw(mod, inputs, outputs)`` run as global module forward hooks;
    ``pre_bw(mod, grad_outputs)`` runs when the first gradient of the module's outputs arrives, ``post_bw(mod,
    grad_inputs)`` when the first gradient of its inputs is computed (both multi-grad hooks in ``any`` mode; see
    ``_fw_pre_hook`` for why not ``all``), or at the end of the backward pass for a module with no input requiring
    grad. ``mod`` is ``None`` if the module died meanwhile.
    """

    def __init__(self, pre_fw: Any, post_fw: Any, pre_bw: Any, post_bw: Any) -> None:
        self._pre_fw, self._post_fw, self._pre_bw, self._post_bw = pre_fw, post_fw, pre_bw, post_bw
        self._post_bw_at_end: list[Any] = []
        self._has_callback = False
        self._handles: list[Any] = []

    @staticmethod
    def _compiling() -> bool:
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        return eval_frame is not None and eval_frame._is_in_optimized_module()

    def _engine_callback(self) -> None:
        # As ModTracker: queue the deferred post-backward hooks once per backward pass (no concurrent backwards).
        if self._has_callback:
            return
        queue = torch.autograd.Variable._execution_engine.queue_callback
        for fn in reversed(self._post_bw_at_end):
            queue(fn)
        self._post_bw_at_end.clear()

        def done() -> None:
            self._has_callback = False

        queue(done)
        self._has_callback = True

    def _enter_bw(self, w_mod: weakref.ref) -> Any:
        def fn(*grads: Any) -> None:
            self._engine_callback()
            self._pre_bw(w_mod(), grads)

        return fn

    def _exit_bw(self, w_mod: weakref.ref) -> Any:
        def fn(*grads: Any) -> None:
            self._post_bw(w_mod(), grads)

        return fn

    def _fw_pre_hook(self, mod: torch.nn.Module, inputs: Any) -> None:
        if self._compiling():
            return
        self._pre_fw(mod, inputs)
        if torch._C._current_graph_task_id() != -1:
            return
        tensors = [a for a in tree_leaves(inputs) if isinstance(a, torch.Tensor) and a.requires_grad]
        if tensors:
            # mode="any": the module's backward is taken as done at its first input gradient. torch's own
            # ModTracker waits for all of them (mode="all"), but that hook holds the inputs' autograd nodes in a
            # closure registered on those same nodes: a reference cycle that keeps graphs (and their saved tensors)
            # alive until the garbage collector runs. Under schedules that split the backward (zero-bubble, whose
            # weight-gradient pass frees the graph later) that kept every micro batch's activations into the
            # optimizer step. Modules with several inputs that require grad get their backward peak a little
            # early; memory is what the real run holds.
            register_multi_grad_hook(tensors, self._exit_bw(weakref.ref(mod)), mode="any")
        else:
            self._post_bw_at_end.append(self._exit_bw(weakref.ref(mod)))

    def _fw_post_hook(self, mod: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        if self._compiling():
            return
        self._post_fw(mod, inputs, outputs)
        if torch._C._current_graph_task_id() != -1:
            return
        tensors = [a for a in tree_leaves(outputs) if isinstance(a, torch.Tensor) and a.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, self._enter_bw(weakref.ref(mod)), mode="any")

    def __enter__(self) -> ModuleHooks:
        self._handles = [
            register_module_forward_pre_hook(self._fw_pre_hook),
            register_module_forward_hook(self._fw_post_hook, always_call=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
