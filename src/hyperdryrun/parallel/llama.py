"""How the dense Llama family is parallelized: TP, then AC, then FSDP2/HSDP, all torch-native, from outside the
model (torchtitan's ``llama3/infra/parallelize.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from hyperdryrun.parallel.ac import apply_ac
from hyperdryrun.parallel.fsdp import apply_fsdp, fsdp_enabled, fsdp_mesh
from hyperdryrun.parallel.tp import apply_tp, block_tp_plan

if TYPE_CHECKING:
    from hyperdryrun.parallel.options import ParallelizeOptions
    from hyperdryrun.parallel_dims import ParallelDims


def parallelize_llama(
    model: nn.Module, mesh: Any, dims: ParallelDims, options: ParallelizeOptions
) -> nn.Module:
    """Apply TP, then AC, then FSDP2/HSDP, all torch-native, from outside the model."""
    if dims.tp > 1:
        apply_tp(
            model,
            mesh["tp"],
            block_tp_plan,
            sequence_parallel=dims.sequence_parallel,
            loss_parallel=options.loss_parallel,
        )
    apply_ac(model, options.ac, options.ac_selective)
    if fsdp_enabled(dims, options.fsdp):
        apply_fsdp(model, fsdp_mesh(mesh, dims), options.fsdp, pp_enabled=dims.pp > 1)
    return model
