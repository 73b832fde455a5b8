"""Activation checkpointing of decoder blocks: full, every k-th layer, or op-level selective (torchtitan's AC)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls_policy(ctx, func, *args, **kwargs):
    """Op-level selective AC: keep matmul and attention outputs, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: str, option: str) -> None:
    """Activation checkpointing of transformer blocks: full, every k-th layer, or op-level selective."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if mode == "none":
        return
    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode == "full" or (option != "op" and i % int(option) == 0):
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        elif option == "op":
            wrapped = checkpoint_wrapper(
                block,
                preserve_rng_state=False,
                context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls_policy),
            )
        else:
            continue
        model.layers.register_module(name, wrapped)
