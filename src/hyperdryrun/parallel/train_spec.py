"""How each model family is parallelized (torchtitan's ``TrainSpec``, parallel half): its decoder-block TP plan,
its expert-parallel plan where it has routed experts, and the parallelize function that applies them in order.

The model half (argument class, presets, model class, initialiser, pipeline cut) is the
:class:`~hyperdryrun.models.registry.ModelFamily` each spec holds; the recipe reads both through
:func:`get_train_spec`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from hyperdryrun.models.registry import HF, LLAMA, MOE, ModelFamily
from hyperdryrun.parallel.expert import apply_ep, moe_block_tp_plan, parallelize_moe
from hyperdryrun.parallel.hf import hf_block_tp_plan, parallelize_hf
from hyperdryrun.parallel.llama import parallelize_llama
from hyperdryrun.parallel.tp import BlockPlan, block_tp_plan

if TYPE_CHECKING:
    from hyperdryrun.parallel.options import ParallelizeOptions
    from hyperdryrun.parallel_dims import ParallelDims


@dataclass(frozen=True)
class TrainSpec:
    """A model family and how it is parallelized: ``parallelize(model, mesh, dims, options)`` (torchtitan's
    parallelize functions, given the degrees and the options they use) applies TP with ``tp_plan``
    (one decoder block's plan), EP with ``ep_plan`` (None for a dense family), AC and FSDP, in the family's order."""

    family: ModelFamily
    parallelize: Callable[[nn.Module, Any, ParallelDims, ParallelizeOptions], nn.Module]
    tp_plan: BlockPlan
    ep_plan: Callable[..., None] | None = None

    @property
    def name(self) -> str:
        return self.family.name


_SPECS: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> TrainSpec:
    """Add how a registered model family is parallelized (one spec per family)."""
    if spec.name in _SPECS:
        raise ValueError(f"model family {spec.name!r} already has a train spec")
    _SPECS[spec.name] = spec
    return spec


def get_train_spec(family: str) -> TrainSpec:
    """The train spec of the family named ``family``."""
    try:
        return _SPECS[family]
    except KeyError:
        raise KeyError(
            f"model family {family!r} has no train spec; register one with register_train_spec"
        ) from None


LLAMA_SPEC = register_train_spec(TrainSpec(LLAMA, parallelize=parallelize_llama, tp_plan=block_tp_plan))
MOE_SPEC = register_train_spec(
    TrainSpec(MOE, parallelize=parallelize_moe, tp_plan=moe_block_tp_plan, ep_plan=apply_ep)
)
HF_SPEC = register_train_spec(TrainSpec(HF, parallelize=parallelize_hf, tp_plan=hf_block_tp_plan))
