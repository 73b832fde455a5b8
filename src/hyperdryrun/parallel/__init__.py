"""Torch-native parallelisms applied to a model from outside, in torchtitan's order: TP, AC, FSDP."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from hyperdryrun.config import JobConfig

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of a job and the device mesh they make (torchtitan's ParallelDims)."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int

    @classmethod
    def from_config(cls, cfg: JobConfig) -> ParallelDims:
        p = cfg.parallel
        return cls(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_DIMS)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def as_dict(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in MESH_DIMS}


def fsdp_enabled(cfg: JobConfig) -> bool:
    """FSDP2 is applied when data is sharded/replicated, with context parallel (whose ranks share the parameters
    and reduce their gradients, torchtitan's ``fsdp_enabled``), or to get its mixed-precision policy."""
    t, p = cfg.training, cfg.parallel
    mixed = (t.param_dtype not in (None, t.dtype)) or (t.reduce_dtype not in (None, t.dtype))
    return p.dp_shard * p.dp_replicate * p.cp > 1 or mixed


def fsdp_mesh(mesh, cfg: JobConfig):
    """The mesh FSDP2 shards over: dp_shard, joined by cp into torchtitan's flattened "dp_shard_cp" when cp > 1,
    with dp_replicate in front for HSDP."""
    p = cfg.parallel
    if p.cp == 1:
        return mesh["dp_replicate", "dp_shard"] if p.dp_replicate > 1 else mesh["dp_shard"]
    # DeviceMesh._flatten: private in torch 2.13, as torchtitan uses it.
    flat = mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
    if p.dp_replicate == 1:
        return flat
    with warnings.catch_warnings():
        # torch 2.13 warns that slicing a flattened dim from the root mesh "will be deprecated in PT 2.11"; it is
        # how torchtitan builds the HSDP mesh, and 2.13 offers no other way to pair dp_replicate with dp_shard_cp.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
        return mesh["dp_replicate", "dp_shard_cp"]


def apply_tp(model: nn.Module, tp_mesh, cfg: JobConfig) -> None:
    """Megatron-style TP with sequence parallel and loss parallel, as torchtitan's llama3 plan."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp, lp = cfg.parallel.sequence_parallel, cfg.parallel.loss_parallel
    seq = Shard(1) if sp else Replicate()
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1) if lp else Replicate(), use_local_output=not lp
        ),
    }
    if sp:
        root_plan["norm"] = SequenceParallel()
    # A pipeline stage lacks the embedding (all but the first) or norm and head (all but the last).
    root_plan = {name: style for name, style in root_plan.items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, root_plan)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_tp_plan(block, seq))


def block_tp_plan(block: nn.Module, seq) -> dict:
    """The TP plan of one decoder block: attention and the dense FFN (when the block has one) are split Megatron
    style, norms are sequence parallel when ``seq`` is ``Shard(1)``. An MoE layer's plan is added by
    :func:`hyperdryrun.parallel.expert.apply_moe_tp`."""
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
    }
    if hasattr(block.attention, "wkv_b"):
        # MLA (torchtitan's deepseek_v3 plan): the low-rank down projections and their norms stay replicated, the
        # per-head up projections are split by heads.
        from hyperdryrun.parallel.expert import NoParallel

        for name in ("wq_a", "q_norm", "wkv_a", "kv_norm"):
            plan[f"attention.{name}"] = NoParallel()
        plan["attention.wq_b"] = ColwiseParallel()
        plan["attention.wkv_b"] = ColwiseParallel()
    else:
        plan.update(
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
            }
        )
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


def apply_fsdp(model: nn.Module, dp_mesh, cfg: JobConfig) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    t = cfg.training
    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES[t.param_dtype] if t.param_dtype else None,
        reduce_dtype=DTYPES[t.reduce_dtype] if t.reduce_dtype else None,
    )
    n = len(model.layers)
    for i, block in enumerate(model.layers.values()):
        # torchtitan's default: the last block stays unsharded, backward needs it at once.
        fully_shard(
            block,
            mesh=dp_mesh,
            mp_policy=mp,
            reshard_after_forward=cfg.parallel.reshard_after_forward and i < n - 1,
        )
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward)


def parallelize_llama(model: nn.Module, mesh, cfg: JobConfig) -> nn.Module:
    """Apply TP, then AC, then FSDP2/HSDP, all torch-native, from outside the model."""
    p = cfg.parallel
    if p.tp > 1:
        apply_tp(model, mesh["tp"], cfg)
    apply_ac(model, cfg.training.ac, cfg.training.ac_selective)
    if fsdp_enabled(cfg):
        apply_fsdp(model, fsdp_mesh(mesh, cfg), cfg)
    return model


def build_optimizer(params, cfg: JobConfig) -> torch.optim.Optimizer:
    t = cfg.training
    impl = {
        "foreach": {"foreach": True},
        "fused": {"fused": True},
        "for-loop": {"foreach": False},
    }[t.optimizer_impl]
    if t.optimizer == "SGD":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay, **impl)
    cls = torch.optim.AdamW if t.optimizer == "AdamW" else torch.optim.Adam
    return cls(params, lr=t.lr, weight_decay=t.weight_decay, **impl)
