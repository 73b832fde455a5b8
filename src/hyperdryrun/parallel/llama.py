"""How the dense Llama family is parallelized: TP, then AC, then FSDP2/HSDP, all torch-native, from outside the
model (torchtitan's ``llama3/infra/parallelize.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from hyperdryrun.parallel.ac import apply_ac
from hyperdryrun.parallel.fsdp import apply_fsdp, fsdp_enabled, fsdp_mesh
from hyperdryrun.parallel.tp import apply_tp, block_tp_plan

if TYPE_CHECKING:
    from hyperdryrun.config import JobConfig


def parallelize_llama(model: nn.Module, mesh: Any, cfg: JobConfig) -> nn.Module:
    """Apply TP, then AC, then FSDP2/HSDP, all torch-native, from outside the model."""
    p = cfg.parallel
    if p.tp > 1:
        apply_tp(model, mesh["tp"], cfg, block_tp_plan)
    apply_ac(model, cfg.training.ac, cfg.training.ac_selective)
    if fsdp_enabled(cfg):
        apply_fsdp(model, fsdp_mesh(mesh, cfg), cfg)
    return model
