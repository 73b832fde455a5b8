"""Context parallel: ring attention over the sequence, as torch 2.13 implements it and torchtitan's llama3 uses it.

Each micro batch runs under ``torch.distributed.tensor.experimental.context_parallel`` over the "cp" mesh: the
tokens, the labels and the RoPE buffer are sharded along the sequence in torch's default head-tail load-balanced
layout (rank r keeps chunks r and 2*cp-1-r of 2*cp), and ``F.scaled_dot_product_attention`` is dispatched through
DTensor to torch's ``_templated_ring_attention``, whose K/V exchanges are collectives on the fake process group.
FSDP2 shards over dp_shard and cp together ("dp_shard_cp", see :func:`hyperdryrun.parallel.fsdp.fsdp_mesh`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hyperdryrun.compat import torch_context_parallel
from hyperdryrun.patches import Patch, PatchSet

ROTATE_METHODS = ("allgather", "alltoall")


def _cp_module():
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


def sdpa_name_patch() -> Patch | None:
    """A stand-in named ``scaled_dot_product_attention`` for the target-kernel SDPA, so that context parallel's
    function patching wraps it (:func:`hyperdryrun.compat.torch_context_parallel.sdpa_name_patch`)."""
    return torch_context_parallel.sdpa_name_patch()


@contextlib.contextmanager
def cp_globals(rotate_method: str) -> Iterator[None]:
    """Set ring attention's rotate method and restore every CP global of torch 2.13 on exit, also on error.

    ``context_parallel`` leaves ``_dispatch_mode`` set and an entry in ``_replaced_functions``; its exit resets
    DTensor's custom op handlers to their import-time value and keeps the sharding-propagation cache entries made
    under the CP sharding rules, which are cleared here so a later run cannot reuse them.
    """
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"rotate_method={rotate_method!r}: choose one of {', '.join(ROTATE_METHODS)}")
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import (
        _clear_fast_path_sharding_prop_cache,
        _clear_python_sharding_prop_cache,
    )

    cp = _cp_module()
    dispatcher = DTensor._op_dispatcher
    saved = (
        dataclasses.replace(cp._cp_options),
        cp._dispatch_mode,
        dict(cp._replaced_functions),
        dispatcher._custom_op_handlers,
    )
    try:
        cp.set_rotate_method(rotate_method)
        yield
    finally:
        options, cp._dispatch_mode, replaced, dispatcher._custom_op_handlers = saved
        for f in dataclasses.fields(options):
            setattr(cp._cp_options, f.name, getattr(options, f.name))
        cp._replaced_functions.clear()
        cp._replaced_functions.update(replaced)
        _clear_python_sharding_prop_cache()
        _clear_fast_path_sharding_prop_cache()


class ContextParallelStep:
    """The training step with context parallel: each micro batch's forward and backward run under torch's
    ``context_parallel`` over the "cp" mesh, as torchtitan's llama3 ``train_context`` does.

    ``parallelize`` records the mesh and applies ``parallelize_fn``; ``step`` is a :data:`hyperdryrun.engine.StepFn`.
    """

    def __init__(
        self,
        parallelize_fn: Callable[[nn.Module, Any], nn.Module | None],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        num_micro_batches: int,
        rotate_method: str = "allgather",
        loss_context: Callable[[], Any] = contextlib.nullcontext,
        buffer_name: str = "rope_cache",
    ) -> None:
        self.parallelize_fn, self.loss_fn = parallelize_fn, loss_fn
        self.num_micro_batches, self.rotate_method = num_micro_batches, rotate_method
        self.loss_context, self.buffer_name = loss_context, buffer_name
        self.cp_mesh: Any = None

    def parallelize(self, model: nn.Module, mesh: Any) -> nn.Module:
        self.cp_mesh = mesh["cp"]
        return self.parallelize_fn(model, mesh) or model

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator[Any]) -> None:
        from torch.distributed.tensor.experimental import context_parallel

        if self.cp_mesh is None:
            raise RuntimeError("ContextParallelStep.parallelize must run before step")
        # The model's one RoPE table, or every layer's (torchtitan 0.3.0's per-attention ``rope.cache``).
        ropes = [b for n, b in model.named_buffers() if n == self.buffer_name or n.endswith(".rope.cache")]
        name_patch = sdpa_name_patch()
        with cp_globals(self.rotate_method), PatchSet([name_patch] if name_patch else []):
            for tokens, labels in batches:
                # torchtitan (llama3 train.py): inputs and labels are not restored, the RoPE buffer is.
                cp_ctx = context_parallel(
                    self.cp_mesh,
                    buffers=[tokens, labels, *ropes],
                    buffer_seq_dims=[1, 1, *[0] * len(ropes)],
                    no_restore_buffers={tokens, labels},
                )
                with cp_ctx, self.loss_context():
                    loss = self.loss_fn(model(tokens), labels) / self.num_micro_batches
                    loss.backward()
                del loss, tokens, labels
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
