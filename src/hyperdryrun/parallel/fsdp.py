"""FSDP2 / HSDP: which mesh parameters are sharded over, the mixed-precision policy, and the wrapping order."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from hyperdryrun.parallel_dims import ParallelDims

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The job config's dtype names as torch dtypes."""


@dataclass(frozen=True)
class FSDPOptions:
    """What FSDP2 is applied with: the job's training dtypes (``training.dtype``, ``param_dtype``,
    ``reduce_dtype``) and ``parallel.reshard_after_forward`` / ``parallel.fsdp_wrap``."""

    dtype: str = "fp32"
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True
    wrap: str = "torchtitan"

    @property
    def mixed(self) -> bool:
        """Parameters or gradient reductions in a dtype other than the stored one."""
        return self.param_dtype not in (None, self.dtype) or self.reduce_dtype not in (None, self.dtype)


def fsdp_enabled(dims: ParallelDims, fsdp: FSDPOptions) -> bool:
    """FSDP2 is applied when data is sharded/replicated, with context parallel (whose ranks share the parameters
    and reduce their gradients, torchtitan's ``fsdp_enabled``), or to get its mixed-precision policy."""
    return dims.dp_shard * dims.dp_replicate * dims.cp > 1 or fsdp.mixed


def fsdp_mesh(mesh: Any, dims: ParallelDims) -> Any:
    """The mesh FSDP2 shards over: dp_shard, joined by cp into torchtitan's flattened "dp_shard_cp" when cp > 1,
    with dp_replicate in front for HSDP."""
    if dims.cp == 1:
        return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    # DeviceMesh._flatten: private in torch 2.13, as torchtitan uses it.
    flat = mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
    if dims.dp_replicate == 1:
        return flat
    with warnings.catch_warnings():
        # torch 2.13 warns that slicing a flattened dim from the root mesh "will be deprecated in PT 2.11"; it is
        # how torchtitan builds the HSDP mesh, and 2.13 offers no other way to pair dp_replicate with dp_shard_cp.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
        return mesh["dp_replicate", "dp_shard_cp"]


def mixed_precision(fsdp: FSDPOptions) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` from the job's param_dtype and reduce_dtype; forward inputs are not cast
    (torchtitan's ``cast_forward_inputs=False``: the embedding's output is already in param_dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=DTYPES[fsdp.param_dtype] if fsdp.param_dtype else None,
        reduce_dtype=DTYPES[fsdp.reduce_dtype] if fsdp.reduce_dtype else None,
        cast_forward_inputs=False,
    )


def apply_fsdp(model: nn.Module, dp_mesh: Any, fsdp: FSDPOptions, *, pp_enabled: bool) -> None:
    """FSDP2 units and their reshard-after-forward choices as ``parallel.fsdp_wrap`` names them, then the root
    (``pp_enabled``: the model is a pipeline stage)."""
    from torch.distributed.fsdp import fully_shard

    mp = mixed_precision(fsdp)
    reshard = fsdp.reshard_after_forward
    if fsdp.wrap == "torchtitan-2024":
        n = len(model.layers)
        for i, block in enumerate(model.layers.values()):
            # The last block stays unsharded: backward needs it at once.
            fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard and i < n - 1)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        return
    # torchtitan 0.3.0's apply_fsdp_to_decoder with its "default" policy: the embedding and every block are resharded
    # after forward except under pipelining; the final norm and the head form one unit that is never resharded.
    blocks_reshard = reshard and not pp_enabled
    config = {"mesh": dp_mesh, "mp_policy": mp}
    shard_embedding_and_head(model, config, blocks_reshard)
    for block in model.layers.values():
        fully_shard(block, **config, reshard_after_forward=blocks_reshard)
    fully_shard(model, **config)


def shard_embedding_and_head(
    model: nn.Module, config: dict[str, Any], blocks_reshard: bool
) -> list[nn.Module]:
    """torchtitan 0.3.0's FSDP2 units around the blocks (``apply_fsdp_to_decoder``): the embedding (resharded after
    forward as the blocks are), the final norm and head as one unit never resharded; with tied embeddings all three
    are one unit, never resharded. Modules this pipeline stage lacks are left out. ``config``: fully_shard's mesh and
    mixed-precision policy. Returns the stage's head modules (norm and output), for prefetching."""
    from torch.distributed.fsdp import fully_shard

    head = [m for m in (model.norm, model.output) if m is not None]
    if model.args.tie_embeddings:
        units = [m for m in (model.tok_embeddings, *head) if m is not None]
        fully_shard(units, **config, reshard_after_forward=False)
        return head
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **config, reshard_after_forward=blocks_reshard)
    if len(head) == 2:
        fully_shard(head, **config, reshard_after_forward=False)
    return head
