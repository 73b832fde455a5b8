"""A backward pass without the autograd engine, for fake "cuda" tensors on a machine without a GPU.

torch 2.13's engine cannot run a backward on fake "cuda" tensors without a GPU (``GraphTask::stash_current_streams``
calls ``hasPrimaryContext(0)``, which raises when no device exists), so the reference runs the backward by calling
every autograd node directly in the engine's order; on the simulation device the real engine runs, and the tests
check that both give the same ops and bytes.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense


def walk_backward(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward of ``output`` without the autograd engine: every node is called directly, ready nodes in the
    engine's order (highest sequence number first, AccumulateGrad before all), gradients for one input summed
    out of place (the engine's InputBuffer does so for tensor subclasses such as FakeTensor), each gradient
    reduced and cast to its consumer's input metadata as the engine's ``validate_outputs`` does, and leaf gradients
    stored as the engine's AccumulateGrad does (the incoming tensor is stolen if it has the leaf's strides, else copied into
    that layout; an existing grad is added in place).
    """
    root = output.grad_fn
    if root is None:
        return
    deps: Counter = Counter()
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            deps[nxt] += 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    buffers: dict[Any, list[torch.Tensor | None]] = {}

    def add(node: Any, idx: int, g: torch.Tensor | None) -> None:
        buf = buffers.setdefault(node, [None] * max(1, len(node._input_metadata)))
        if g is None:
            return
        buf[idx] = g if buf[idx] is None else buf[idx] + g

    add(root, output.output_nr, grad)
    counter = 0
    ready = [(-root._sequence_nr(), counter, root)]
    with torch.no_grad():
        while ready:
            _, _, node = heapq.heappop(ready)
            inputs = buffers.pop(node, [None])
            if type(node).__name__ == "AccumulateGrad":
                var, g = node.variable, inputs[0]
                if g is not None:
                    if var.grad is None:
                        var.grad = g if _obeys_layout_contract(g, var) else _clone_obey_contract(g, var)
                    else:
                        var.grad.add_(g)
                continue
            # C++ nodes are callable; a custom autograd.Function's node runs through .apply
            outs = node(*inputs) if callable(node) else node.apply(*inputs)
            if not isinstance(outs, tuple):
                outs = (outs,)
            del inputs
            for (nxt, idx), g in zip(node.next_functions, outs):
                if nxt is None:
                    continue
                if g is not None:
                    # the engine's validate_outputs: reduce a broadcast gradient, cast to the input's dtype
                    meta = nxt._input_metadata[idx]
                    if tuple(g.shape) != tuple(meta.shape):
                        g = g.sum_to_size(meta.shape)
                    if g.dtype != meta.dtype:
                        g = g.to(meta.dtype)
                add(nxt, idx, g)
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    counter += 1
                    heapq.heappush(ready, (-nxt._sequence_nr(), counter, nxt))


def _obeys_layout_contract(grad: torch.Tensor, var: torch.Tensor) -> bool:
    """torch/csrc/autograd/utils/grad_layout_contract.h: a stolen grad must have the variable's strides."""
    if not is_non_overlapping_and_dense(var):
        return grad.is_contiguous()
    for size, gs, vs in zip(grad.shape, grad.stride(), var.stride()):
        if (size != 1 and gs != vs) or (size == 1 and gs == 0):
            return False
    return True


def _clone_obey_contract(grad: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    if is_non_overlapping_and_dense(var):
        return grad.new_empty_strided(var.shape, var.stride()).copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


__all__ = ["walk_backward"]
