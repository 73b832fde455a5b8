"""Context parallel: ring attention over the sequence, as torch 2.13 implements it and torchtitan's llama3 uses it.

Each micro batch runs under ``torch.distributed.tensor.experimental.context_parallel`` over the "cp" mesh: the
tokens, the labels and the RoPE buffer are sharded along the sequence in torch's default head-tail load-balanced
layout (rank r keeps chunks r and 2*cp-1-r of 2*cp), and ``F.scaled_dot_product_attention`` is dispatched through
DTensor to torch's ``_templated_ring_attention``, whose K/V exchanges are collectives on the fake process group.
FSDP2 shards over dp_shard and cp together ("dp_shard_cp", see :func:`hyperdryrun.parallel.fsdp.fsdp_mesh`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hyperdryrun.compat import torch_context_parallel
from hyperdryrun.patches import Patch, PatchSet

ROTATE_METHODS = ("allgather", "alltoall")


def sdpa_name_patch() -> Patch | None:
    """A stand-in named ``scaled_dot_product_attention`` for the target-kernel SDPA, so that context parallel's
    function patching wraps it (:func:`hyperdryrun.compat.torch_context_parallel.sdpa_name_patch`)."""
    return torch_context_parallel.sdpa_name_patch()


@contextlib.contextmanager
def cp_globals(rotate_method: str) -> Iterator[None]:
    """Set ring attention's rotate method and restore every CP global of torch on exit, also on error
    (:func:`hyperdryrun.compat.torch_context_parallel.cp_globals`)."""
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"rotate_method={rotate_method!r}: choose one of {', '.join(ROTATE_METHODS)}")
    with torch_context_parallel.cp_globals(rotate_method):
        yield


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
