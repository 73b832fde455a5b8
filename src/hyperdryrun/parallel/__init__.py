"""Torch-native parallelisms applied to a model from outside, in torchtitan's order: TP, AC, FSDP.

One module per responsibility: :mod:`~hyperdryrun.parallel.dims` (the layout and its rules), ``tp``, ``ac``,
``fsdp``, ``optimizer``, ``pipeline``, ``context``, ``expert``; :mod:`~hyperdryrun.parallel.train_spec` says how
each model family is parallelized. The names below are re-exported for ``from hyperdryrun.parallel import ...``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperdryrun.lazy import lazy_exports

if TYPE_CHECKING:
    from hyperdryrun.parallel.ac import apply_ac
    from hyperdryrun.parallel.dims import MESH_DIMS, ParallelDims, RankCoordinates
    from hyperdryrun.parallel.fsdp import DTYPES, apply_fsdp, fsdp_enabled, fsdp_mesh
    from hyperdryrun.parallel.llama import parallelize_llama
    from hyperdryrun.parallel.optimizer import build_optimizer
    from hyperdryrun.parallel.tp import apply_tp, block_tp_plan

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "hyperdryrun.parallel.ac": ("apply_ac",),
        "hyperdryrun.parallel.dims": (
            "MESH_DIMS",
            "ParallelDims",
            "RankCoordinates",
        ),
        "hyperdryrun.parallel.fsdp": (
            "DTYPES",
            "apply_fsdp",
            "fsdp_enabled",
            "fsdp_mesh",
        ),
        "hyperdryrun.parallel.llama": ("parallelize_llama",),
        "hyperdryrun.parallel.optimizer": ("build_optimizer",),
        "hyperdryrun.parallel.tp": (
            "apply_tp",
            "block_tp_plan",
        ),
    },
)

__all__ = [
    "DTYPES",
    "MESH_DIMS",
    "ParallelDims",
    "RankCoordinates",
    "apply_ac",
    "apply_fsdp",
    "apply_tp",
    "block_tp_plan",
    "build_optimizer",
    "fsdp_enabled",
    "fsdp_mesh",
    "parallelize_llama",
]
