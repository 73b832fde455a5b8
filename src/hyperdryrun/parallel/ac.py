"""Activation checkpointing of decoder blocks as torchtitan applies it: full, every k-th layer, or op-level selective
(torchtitan 0.3.0's ``SelectiveAC``: save compute-heavy and communication outputs, recompute every second matmul)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

aten = torch.ops.aten

MATMUL_OPS = (aten.mm.default, aten.linear.default)
"""The ops torchtitan's selective AC counts as matmuls (every second one is recomputed)."""


def torchtitan_save_ops() -> set:
    """torchtitan 0.3.0's ``_get_default_save_ops``: the partitioner's compute-intensive ops, SDPA variants, max,
    FlexAttention, linear, topk, and the reduce-scatter / all-to-all collectives (ops this torch lacks skipped)."""
    from torch._functorch.partitioners import get_default_op_list

    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    ops |= {
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_attention_math.default,
        aten._scaled_dot_product_fused_attention_overrideable.default,
        aten.max.default,
        torch._higher_order_ops.flex_attention,
        aten.linear.default,
        aten.topk.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_to_all_single.default,
    }
    compiled = getattr(torch._higher_order_ops, "inductor_compiled_code", None)
    return ops | ({compiled} if compiled is not None else set())


SAVE_ALL_MATMULS_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}
"""``op-save-all-matmuls``: every matmul and attention output saved (this recipe's op policy before torchtitan's)."""


FORCE_RECOMPUTE_FQNS = ("moe.router.gate",)
"""torchtitan's ``force_recompute_mm_shapes_by_fqns`` default: matmuls of these linears' weight shapes are always
recomputed and not counted."""


def every_second_matmul_policy(save_ops: set, recompute_shapes: frozenset = frozenset()) -> Any:
    """A fresh torchtitan 0.3.0 op policy for one checkpointed forward: outputs of ``save_ops`` are saved except
    every second matmul (counted separately in forward and in recompute) and matmuls whose weight (in, out) shape
    is in ``recompute_shapes``; everything else is recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in MATMUL_OPS:
            shape = tuple(args[1].shape)
            if func == aten.linear.default:
                shape = shape[::-1]
            if shape in recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            counts[mode] += 1
        if func in save_ops:
            if func in MATMUL_OPS and counts[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _save_all_matmuls_policy(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in SAVE_ALL_MATMULS_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context(policy_fn: Any) -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(policy_fn())


def forced_recompute_shapes(block: nn.Module) -> frozenset:
    """The (in, out) weight shapes of the block's linears named in :data:`FORCE_RECOMPUTE_FQNS`."""
    return frozenset(
        tuple(m.weight.shape[::-1])
        for name, m in block.named_modules()
        if isinstance(m, nn.Linear) and any(f in name for f in FORCE_RECOMPUTE_FQNS)
    )


def checkpointed_layers(n_layers: int, every: int) -> list[int]:
    """Layer AC's positions, torchtitan's: its counter starts at 1, so layers k-1, 2k-1, ... are checkpointed."""
    return [i for i in range(n_layers) if (i + 1) % every == 0]


def chosen_layers(n_layers: int, mode: str, option: str) -> set[int]:
    """Indices of the decoder layers that ``mode``/``option`` checkpoint (all but for a layer interval k)."""
    if mode == "none":
        return set()
    if mode == "selective" and option.isdigit():
        # Layer indices count within this model (a pipeline stage counts its own layers, as torchtitan's).
        return set(checkpointed_layers(n_layers, int(option)))
    return set(range(n_layers))


def checkpoint_block(block: nn.Module, mode: str, option: str) -> nn.Module:
    """One decoder block wrapped as torchtitan does (``early_stop`` off: a recompute runs the whole block): whole
    for ``full`` or a layer interval, else with the op policy ``option`` names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrap = partial(checkpoint_wrapper, preserve_rng_state=False, early_stop=False)
    if mode == "full" or option.isdigit():
        return wrap(block)
    if option == "op":
        make = partial(every_second_matmul_policy, torchtitan_save_ops(), forced_recompute_shapes(block))
        return wrap(block, context_fn=partial(_selective_context, make))
    return wrap(block, context_fn=partial(_selective_context, lambda: _save_all_matmuls_policy))


def apply_ac(model: nn.Module, mode: str, option: str) -> None:
    """Activation checkpointing of the decoder blocks: ``full``, or ``selective`` with ``option`` ``op`` (torchtitan
    0.3.0's policy), ``op-save-all-matmuls``, or a layer interval k."""
    layers = list(model.layers.items())
    chosen = chosen_layers(len(layers), mode, option)
    for i, (name, block) in enumerate(layers):
        if i in chosen:
            model.layers.register_module(name, checkpoint_block(block, mode, option))
