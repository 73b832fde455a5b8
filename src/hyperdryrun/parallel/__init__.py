"""Torch-native parallelisms applied to a model from outside, in torchtitan's order: TP, AC, FSDP.

One module per responsibility: ``tp``, ``ac``, ``fsdp``, ``optimizer``, ``pipeline``, ``context``, ``expert``;
:mod:`~hyperdryrun.parallel.train_spec` says how each model family is parallelized. Each function takes the layout,
:class:`~hyperdryrun.parallel_dims.ParallelDims` (a torch-free module below the job config and this package), and
the options it uses (:class:`~hyperdryrun.parallel.options.ParallelizeOptions`, keyword arguments), never the job
config: :mod:`hyperdryrun.recipe` makes them from it. The names below are re-exported for
``from hyperdryrun.parallel import ...``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperdryrun.lazy import lazy_exports

if TYPE_CHECKING:
    from hyperdryrun.parallel.ac import apply_ac
    from hyperdryrun.parallel.fsdp import DTYPES, FSDPOptions, apply_fsdp, fsdp_enabled, fsdp_mesh
    from hyperdryrun.parallel.llama import parallelize_llama
    from hyperdryrun.parallel.optimizer import build_optimizer
    from hyperdryrun.parallel.options import ParallelizeOptions
    from hyperdryrun.parallel.tp import apply_tp, block_tp_plan
    from hyperdryrun.parallel_dims import MESH_DIMS, ParallelDims, RankCoordinates

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "hyperdryrun.parallel.ac": ("apply_ac",),
        "hyperdryrun.parallel_dims": (
            "MESH_DIMS",
            "ParallelDims",
            "RankCoordinates",
        ),
        "hyperdryrun.parallel.fsdp": (
            "DTYPES",
            "FSDPOptions",
            "apply_fsdp",
            "fsdp_enabled",
            "fsdp_mesh",
        ),
        "hyperdryrun.parallel.llama": ("parallelize_llama",),
        "hyperdryrun.parallel.optimizer": ("build_optimizer",),
        "hyperdryrun.parallel.options": ("ParallelizeOptions",),
        "hyperdryrun.parallel.tp": (
            "apply_tp",
            "block_tp_plan",
        ),
    },
)

__all__ = [
    "DTYPES",
    "MESH_DIMS",
    "FSDPOptions",
    "ParallelDims",
    "ParallelizeOptions",
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
