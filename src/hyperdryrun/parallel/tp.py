"""Tensor parallel: Megatron-style TP with sequence and loss parallel, as torchtitan's plans.

The root plan (embedding, final norm, head) is shared by the built-in decoders; each model family registers its
decoder-block plan (:mod:`hyperdryrun.parallel.train_spec`): :func:`block_tp_plan` for the Llama family,
:func:`hyperdryrun.parallel.expert.moe_block_tp_plan` for the MoE family.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

BlockPlan = Callable[[nn.Module, Any], dict]
"""A decoder block's TP plan: ``(block, sequence layout) -> {submodule FQN: ParallelStyle}``."""


def apply_tp(
    model: nn.Module,
    tp_mesh: Any,
    block_plan: BlockPlan | None = None,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
) -> None:
    """TP of the embedding, the head and every decoder block (``block_plan``, default :func:`block_tp_plan`),
    with sequence parallel and loss parallel as the job says."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp, lp = sequence_parallel, loss_parallel
    seq = Shard(1) if sp else Replicate()
    # The final norm's output is gathered to replicated hidden states (torchtitan 0.3.0's pre_lm_head_norm_config),
    # so that a chunked loss can split them; the head takes them replicated.
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=Replicate(),
            output_layouts=Shard(-1) if lp else Replicate(),
            use_local_output=not lp,
        ),
    }
    if sp:
        root_plan["norm"] = SequenceParallel()
    # A pipeline stage lacks the embedding (all but the first) or norm and head (all but the last).
    root_plan = {name: style for name, style in root_plan.items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, root_plan)
    if sp and model.norm is not None:
        gather = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
        parallelize_module(model, tp_mesh, {"norm": gather})
    plan = block_plan or block_tp_plan
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan(block, seq))


def block_tp_plan(block: nn.Module, seq: Any) -> dict:
    """The TP plan of a Llama decoder block: grouped-query attention's projections and the dense FFN (when the
    block has one) split Megatron style, norms sequence parallel when ``seq`` is ``Shard(1)``."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    names = (
        ("attention.wqkv",)
        if hasattr(block.attention, "wqkv")
        else ("attention.wq", "attention.wk", "attention.wv")
    )
    projections = {name: ColwiseParallel() for name in names}
    return decoder_block_tp_plan(block, seq, projections)


def decoder_block_tp_plan(block: nn.Module, seq: Any, attention_projections: dict) -> dict:
    """The plan every built-in decoder block shares around its attention's input projections
    (``attention_projections``): attention input replicated, output projection row-wise back to ``seq``, the dense
    FFN (if the block has one) column-then-row-wise, norms sequence parallel."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict = {
        "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        **attention_projections,
    }
    if getattr(block, "feed_forward", None) is not None:
        plan.update(
            {
                "feed_forward": PrepareModuleInput(
                    input_layouts=(seq,), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=seq),
                "feed_forward.w3": ColwiseParallel(),
            }
        )
    if seq == Shard(1):
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan
