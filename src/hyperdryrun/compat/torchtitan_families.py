"""torchtitan 0.3.0's multimodal MoE families ``qwen3_5`` and ``kimi_k2_7`` (tested: torch 2.13.0, fla 0.6.0).

- torchvision: both config registries import torchtitan's multimodal data loader
  (``hf_datasets/multimodal/utils/image.py``, ``video.py``), which imports ``torchvision.io`` and
  ``torchvision.transforms.v2.functional`` at module import and uses them only to decode and resize images. The dry
  run builds no data loader, and PyPI's torchvision wheels for Linux are CUDA builds that do not import on the CPU
  torch (their ``_C.so`` links ``libtorch_cuda.so``: "operator torchvision::nms does not exist"), so where
  torchvision is not installed :func:`torchvision_stand_in` puts empty modules in its place while the config loads.
- Batches: qwen3_5's ``forward`` reads ``special_tokens["image_id"]`` from every batch, which torchtitan's
  ``MultiModalCollator`` adds (:func:`multimodal_batch_fields`).
- fla (flash-linear-attention): qwen3_5's Gated DeltaNet layers call fla's ``chunk_gated_delta_rule``, a
  ``torch.autograd.Function`` that allocates every output and intermediate with torch (``torch.empty``,
  ``new_empty``, ``empty_like``) and fills them with Triton kernels. On fake tensors those allocations are the
  memory; a Triton launch needs a GPU driver (triton 3.x: "0 active drivers"), so :func:`triton_launch_patches`
  makes a launch on fake tensors a no-op. Real tensors still launch, which on a CPU machine fails: a measured
  (real CPU) step of a DeltaNet layer is impossible (:func:`fla_layers`).
- kimi_k2_7: its configs optimize with torchtitan's ``DistMuon`` (``distributed/flex_shard/dist_muon.py``), whose
  compute layouts name the ``dp_shard`` mesh axis that only ``parallelism.spmd_backend='spmd_types'`` builds
  (:func:`dist_muon_groups`), which torch 2.11 to 2.14 cannot shard over more than one rank; on one rank it runs, and
  its check that the parameters are on a CUDA device is answered for the simulation device
  (:func:`dist_muon_device_patches`).

No torch or torchtitan import at module import.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

from hyperdryrun.patches import Patch

TORCHVISION_MODULES = (
    "torchvision",
    "torchvision.io",
    "torchvision.transforms",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
)
"""What torchtitan 0.3.0's multimodal data loader imports of torchvision."""

FLA_KERNEL = "fla.ops.gated_delta_rule.chunk_gated_delta_rule"


class _StandIn(types.ModuleType):
    """An empty torchvision module: any attribute read says that torchvision is not installed."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(
            f"{self.__name__}.{name}: torchvision is not installed (hyperdryrun's stand-in for torchtitan's "
            "multimodal data loader, which the dry run does not build)"
        )


@contextlib.contextmanager
def torchvision_stand_in() -> Iterator[bool]:
    """Empty ``torchvision`` modules in ``sys.modules`` for the body where torchvision is not installed (yields
    whether they are there); ``sys.modules`` is as it was on exit. transformers decides once whether torchvision is
    available (``is_torchvision_available``, cached): asked first, so that it never takes the stand-in for it."""
    if importlib.util.find_spec("torchvision") is not None:
        yield False
        return
    with contextlib.suppress(ImportError):
        from transformers.utils.import_utils import is_torchvision_available

        is_torchvision_available()
    saved = {name: sys.modules.get(name) for name in TORCHVISION_MODULES}
    for name in TORCHVISION_MODULES:
        module = _StandIn(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = module
    for name in TORCHVISION_MODULES[1:]:
        parent, _, child = name.rpartition(".")
        types.ModuleType.__setattr__(sys.modules[parent], child, sys.modules[name])
    try:
        yield True
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def multimodal_batch_fields(config: Any) -> dict[str, Any]:
    """The fields torchtitan's ``MultiModalCollator`` adds to a text-only batch of a multimodal tokenizer config:
    ``special_tokens`` (``<field>_id`` for each of ``MultiModalTokenizer.TOKEN_FIELDS``). The ids of a real
    tokenizer are not known here: negative ids, which no synthetic token equals (no token is a vision
    placeholder, as in a batch without images). Empty for other configs."""
    try:
        from torchtitan.components.tokenizer import MultiModalTokenizer
    except ImportError:
        return {}
    if not isinstance(getattr(config, "tokenizer", None), MultiModalTokenizer.Config):
        return {}
    fields = MultiModalTokenizer.TOKEN_FIELDS
    return {"special_tokens": {f"{name}_id": -1 - i for i, name in enumerate(fields)}}


def triton_launch_patches() -> list[Patch]:
    """A Triton kernel launched on fake tensors (``kernel[grid](...)``) does nothing: its outputs were allocated
    by the caller with torch (fla's kernels), so what it would write is already counted. [] without triton."""
    try:
        from triton.runtime.jit import KernelInterface
    except ImportError:
        return []
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    launch = KernelInterface.__getitem__

    def getitem(self: Any, grid: Any) -> Any:
        run = launch(self, grid)

        def maybe_run(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if any(isinstance(t, FakeTensor) or t.is_meta for t in tensors):
                return None
            return run(*args, **kwargs)

        return maybe_run

    return [
        Patch(
            KernelInterface,
            "__getitem__",
            getitem,
            "triton 3.x launches a kernel through the GPU driver ('0 active drivers' on a CPU machine); fla's "
            "Gated DeltaNet kernels write into tensors fla allocated with torch, which the dry run counts",
        )
    ]


def dist_muon_device_patches(simulation_device: str) -> list[Patch]:
    """torchtitan 0.3.0's ``DistMuon._validate_parameter_storage`` (``distributed/flex_shard/dist_muon.py``) refuses
    parameters whose local tensors are not on one CUDA device, and returns that device for its redistribution
    buffers. The simulated world holds them on ``simulation_device``, which stands for the GPU: the same check with
    that device type taken for CUDA's. [] where torchtitan has no DistMuon."""
    try:
        from torchtitan.distributed.flex_shard.dist_muon import DistMuon
    except ImportError:
        return []
    from torch.distributed.tensor import DTensor

    def validate(self: Any) -> Any:
        devices = set()
        for group in self.param_groups:
            for param in group["params"]:
                if not isinstance(param, DTensor):
                    raise TypeError("DistMuon requires DTensor parameters")
                devices.add(param.to_local().device)
        if len(devices) != 1 or next(iter(devices)).type not in ("cuda", simulation_device):
            raise ValueError("DistMuon requires one CUDA device per process")
        return next(iter(devices))

    return [
        Patch(
            DistMuon,
            "_validate_parameter_storage",
            validate,
            f"DistMuon requires its parameters on one CUDA device; the simulated world's are on "
            f"{simulation_device!r}, standing for the GPU",
        )
    ]


HOPPER_SHARED_MEMORY = 232448
"""Bytes of shared memory a block of an H100, H200 or B200 may use: fla's ``Backend.HOPPER``."""


def fla_block_size_patches() -> list[Patch]:
    """fla sizes one buffer by the GPU's shared memory: ``chunk_bwd_dqkwg`` (``fla/ops/common/chunk_o.py``) tiles K
    by 128 on a Hopper GPU and by 32 where ``check_shared_mem`` finds no GPU, and allocates ``dg`` as
    ``ceil(K / tile)`` fp32 copies of the gate. It answers as an H100, H200 or B200 (the dry run's default
    target is an H100); an A100's tile may differ. [] where no model imported fla (importing it warns and costs
    seconds)."""
    if "fla" not in sys.modules:
        return []
    try:
        from fla.ops.common import chunk_o
        from fla.utils.hardware import Backend
    except ImportError:
        return []

    def check_shared_mem(arch: str = "none", tensor_idx: int = 0) -> bool:
        return HOPPER_SHARED_MEMORY >= Backend.get_shared_memory(arch)

    return [
        Patch(
            chunk_o,
            "check_shared_mem",
            check_shared_mem,
            "fla 0.6.0's check_shared_mem reads the GPU's shared memory through triton's driver and answers False "
            "without a GPU, which sizes chunk_bwd_dqkwg's dg for a 32-wide K tile; answered as an H100/H200/B200",
        )
    ]


def fla_layers(model_config: Any, n_layers: int | None = None) -> list[int]:
    """The layers (of the first ``n_layers``) whose token mixer is qwen3_5's Gated DeltaNet (fla's kernels)."""
    layers = list(getattr(model_config, "layers", []) or [])[:n_layers]
    return [
        i
        for i, layer in enumerate(layers)
        if type(getattr(layer, "delta_net", None)).__qualname__ == "GatedDeltaNet.Config"
    ]


def dist_muon_groups(config: Any) -> list[str]:
    """The patterns of the optimizer's ``DistMuon`` parameter groups (kimi_k2_7's configs), or []."""
    groups = getattr(getattr(config, "optimizer", None), "param_groups", None) or []
    return [g.pattern for g in groups if getattr(g, "optimizer_name", None) == "DistMuon"]
