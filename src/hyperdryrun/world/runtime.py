"""What a CUDA job holds on the device besides its tensors, and the settings that decide it.

Three costs, each its own line in the report, each configurable (``cuda`` section of the job, or the variable the
real runtime reads):

- **cuBLAS workspaces**, inside the caching allocator: torch 2.13 ``setWorkspaceForHandle``
  (aten/src/ATen/cuda/CublasHandlePool.cpp) allocates one through the caching allocator for every (cuBLAS handle,
  stream) pair that runs a matmul; a handle belongs to a thread, and a training step runs matmuls on two threads,
  the Python thread (forward) and the autograd engine's device thread (backward, recompute). Size:
  ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs, summed as ``parseChosenWorkspaceSize`` sums them), else
  the GPU's default (:func:`hyperdryrun.compat.torch_cublas.cublas_workspace_bytes`). On CUDA the cuBLASLt workspace is
  the same allocation (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, on by default), so it adds nothing.
- **NCCL buffers**, outside the allocator: NCCL allocates per communicator, per channel and per peer connection
  one buffer per protocol (NVIDIA/nccl src/init.cc ``computeBuffSizes``: Simple ``NCCL_BUFFSIZE``, default 4 MiB;
  LL ``DEFAULT_LL_BUFFSIZE`` = 8 lines x 512 threads x 8 steps x 16 B = 512 KiB; LL128 ``DEFAULT_LL128_BUFFSIZE``
  = 120 x 640 x 8 x 8 B = 4,915,200 B). How many channels and connections NCCL sets up depends on the topology,
  the algorithms a job's collectives select and NCCL's version (NVIDIA/nccl#986: memory is linear in the
  channels; ring uses two connections per channel, a receive from the previous rank and a send to the next), so
  this is an estimate with a stated formula: ``channels x 2 x (Simple + LL + LL128)`` per communicator of more
  than one rank, ``nccl_channels`` channels (default 16; an NVLink H100 node sets up 16 to 32:
  NVIDIA/nccl#1685 shows 32 for all-to-all). One communicator per process group the step communicated on
  (ProcessGroupNCCL creates them lazily, at a group's first collective). Measured for comparison: 544 MB per 2-rank
  and 688 MB per 4-rank communicator on A100 NVLink (NVIDIA/nccl#964, CUDA context and NCCL kernels included).
- **CUDA context and loaded kernels**, outside the allocator: the driver's context and the modules of the kernels
  used, loaded lazily (torch sets ``CUDA_MODULE_LOADING=LAZY``, pytorch/pytorch#86509: 287 MB after one kernel,
  667 MB eagerly; ~300-400 MB with lazy loading per pytorch/pytorch#107667 and #109888; 426 MiB after
  ``mem_get_info`` on torch 2.10 cu130, unslothai/unsloth-zoo#1053). ``context_mib`` defaults to the H200
  measurement of this project (torch 2.11 cu130, CUDA 13.0, driver 580; ``docs/gpu/h200_measured.json``) after a
  whole training step: nvidia-smi minus ``max_memory_reserved`` was 880,803,840 B = 840 MiB in each of six jobs (an
  8B and a 70B model; FSDP, HSDP, TP; with and without AC): the context and the modules the step loaded lazily
  (cuBLAS, cuDNN attention, torch's own kernels). After the first tensor alone the same process held 545,259,520 B,
  2 MiB of it the allocator's one segment: 518 MiB of context before any kernel ran, a figure a dry run of a
  training step would undercount by 322 MiB. The sources above do not show a difference between CUDA 12 and 13
  that this could follow, so there is one default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hyperdryrun.allocator.options import ENV_VARS, AllocatorConfigError, AllocatorOptions
from hyperdryrun.bounds import MAX_GIB
from hyperdryrun.compat.torch_cublas import CUBLAS_ENV, cublas_config_bytes
from hyperdryrun.world.cuda_target import CudaTarget
from hyperdryrun.world.gpus import DEFAULT_GPU, GPU_PRESETS, MiB, cublas_workspace_bytes, gpu_preset

NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16
"""NVIDIA/nccl ``DEFAULT_LL_BUFFSIZE``: NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x 16 B."""
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8
"""NVIDIA/nccl ``DEFAULT_LL128_BUFFSIZE``: NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x NCCL_STEPS x 8 B."""
NCCL_CONNECTIONS_PER_CHANNEL = 2
"""Ring: a receive connection from the previous rank and a send connection to the next."""
DEFAULT_NCCL_CHANNELS = 16
DEFAULT_CONTEXT_MIB = 840.0
"""880,803,840 B: the CUDA context and the kernel modules of a training step, measured on an H200 after the step
(see the module docstring)."""
NCCL_BUFFSIZE_ENV = "NCCL_BUFFSIZE"


class CudaRuntime(BaseModel):
    """The GPU a CUDA target is, its caching-allocator settings, and the figures for the runtime's own memory."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    gpu: str | None = None
    """A GPU preset (``hyperdryrun.world.gpus``): capacity, SDPA choice, cuBLAS workspace. None: an h100-80gb for
    the kernels and no capacity (give one with ``device_memory_gib``)."""
    alloc_conf: str | None = None
    """PYTORCH_CUDA_ALLOC_CONF syntax; None: the variable as torch reads it (or torch's defaults)."""
    cublas_workspace_config: str | None = None
    """CUBLAS_WORKSPACE_CONFIG syntax (``:4096:8``); None: the variable, else the GPU's default."""
    nccl_buffsize: int | None = Field(None, gt=0, le=1 << 40)
    """NCCL_BUFFSIZE in bytes (the Simple protocol's buffer); None: the variable, else 4 MiB."""
    nccl_channels: int = Field(DEFAULT_NCCL_CHANNELS, gt=0, le=1024)
    """Channels per NCCL communicator in the buffer estimate."""
    context_mib: float = Field(DEFAULT_CONTEXT_MIB, ge=0, le=MAX_GIB * 1024)
    """CUDA context and loaded kernels, MiB."""

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str | None) -> str | None:
        if v is not None and v not in GPU_PRESETS:
            # only the GPUs the dry run can target are choices (a preset it does not model is refused below)
            usable = [name for name, p in GPU_PRESETS.items() if p.compute_capability is not None]
            raise ValueError(f"gpu={v!r}: choose one of {', '.join(usable)}")
        if v is not None:
            CudaTarget(gpu_preset(v))  # a GPU the dry run cannot target fails here, in one line
        return v

    @field_validator("alloc_conf")
    @classmethod
    def _torch_accepts(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                AllocatorOptions.parse(v, source="alloc_conf")
            except AllocatorConfigError as err:
                raise ValueError(str(err).removeprefix("alloc_conf: ")) from None
        return v

    @field_validator("cublas_workspace_config")
    @classmethod
    def _cublas_syntax(cls, v: str | None) -> str | None:
        if v is not None and cublas_config_bytes(v) is None:
            raise ValueError(f"expected :SIZE_KiB:COUNT pairs such as ':4096:8' (got {v!r})")
        return v

    def target(self) -> CudaTarget:
        """The GPU and build whose kernels the dry run follows."""
        return CudaTarget(gpu_preset(self.gpu or DEFAULT_GPU))

    def settings(self, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Every figure resolved (fields first, then the environment torch and NCCL read, then defaults), with
        where each came from: the ``metadata.cuda`` of a report, less what the step observed."""
        env = os.environ if environ is None else environ
        preset = gpu_preset(self.gpu or DEFAULT_GPU)
        target = self.target()
        if self.alloc_conf is not None:
            alloc, alloc_source = self.alloc_conf, "cuda.alloc_conf (--alloc-conf)"
        else:
            var = next((v for v in ENV_VARS if v in env), None)
            alloc, alloc_source = (env[var], f"${var}") if var else ("", "torch's defaults")
        AllocatorOptions.parse(alloc, source=alloc_source)  # a bad variable fails here, as torch would fail
        ws_default = cublas_workspace_bytes(target.sm)
        if self.cublas_workspace_config is not None:
            ws = cublas_config_bytes(self.cublas_workspace_config) or ws_default
            ws_source = f"cuda.cublas_workspace_config {self.cublas_workspace_config!r}"
        elif CUBLAS_ENV in env and cublas_config_bytes(env[CUBLAS_ENV]) is not None:
            ws, ws_source = cublas_config_bytes(env[CUBLAS_ENV]) or 0, f"${CUBLAS_ENV} {env[CUBLAS_ENV]!r}"
        else:
            ws = ws_default
            ws_source = (
                f"torch 2.13 parseChosenWorkspaceSize default for {preset.arch} (CublasHandlePool.cpp)"
                + (
                    f"; ${CUBLAS_ENV} {env[CUBLAS_ENV]!r} does not parse, as torch warns"
                    if CUBLAS_ENV in env
                    else ""
                )
            )
        if self.nccl_buffsize is not None:
            buffsize, buff_source = self.nccl_buffsize, "cuda.nccl_buffsize"
        elif env.get(NCCL_BUFFSIZE_ENV, "").strip().isdigit() and int(env[NCCL_BUFFSIZE_ENV]) > 0:
            buffsize, buff_source = int(env[NCCL_BUFFSIZE_ENV]), f"${NCCL_BUFFSIZE_ENV}"
        else:
            buffsize, buff_source = preset.nccl_buffer_bytes, "NCCL DEFAULT_BUFFSIZE (src/init.cc)"
        per_channel = NCCL_CONNECTIONS_PER_CHANNEL * (buffsize + NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE)
        return {
            "gpu": {
                "name": preset.name,
                "product": preset.product,
                "named": self.gpu is not None,
                "capacity_bytes": preset.capacity_bytes,
                "compute_capability": list(target.sm),
                "arch": preset.arch,
            },
            "capacity_bytes": preset.capacity_bytes if self.gpu is not None else None,
            "kernels": target.describe(),
            "allocator": {"settings": alloc, "source": alloc_source},
            "cublas_workspace": {"bytes_per_handle": ws, "source": ws_source},
            "nccl": {
                "channels": self.nccl_channels,
                "connections_per_channel": NCCL_CONNECTIONS_PER_CHANNEL,
                "buffsize": buffsize,
                "buffsize_source": buff_source,
                "ll_buffsize": NCCL_LL_BUFFSIZE,
                "ll128_buffsize": NCCL_LL128_BUFFSIZE,
                "bytes_per_communicator": self.nccl_channels * per_channel,
                "formula": "channels x connections_per_channel x (buffsize + ll_buffsize + ll128_buffsize) per "
                "communicator of more than one rank (an estimate: see hyperdryrun.world.runtime)",
            },
            "cuda_context": {
                "bytes": round(self.context_mib * MiB),
                "source": "cuda.context_mib: the CUDA context (default: 518 MiB, measured on an H200 after the first "
                "tensor; the kernels a step loads lazily add ~322 MiB more there, see hyperdryrun.world.runtime)",
            },
        }


def communicators(group_names: list[str], per_communicator: int) -> list[dict[str, Any]]:
    """The NCCL communicators of the process groups named (those of one rank), with their estimated buffers."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    out = []
    for name in group_names:
        try:
            pg = _resolve_process_group(name)
        except Exception:  # a group destroyed during the step: its communicator is gone too
            continue
        size = pg.size()
        out.append(
            {
                "group": name,
                "description": pg.group_desc,
                "size": size,
                "bytes": per_communicator if size > 1 else 0,
            }
        )
    return out


def observed(settings: dict[str, Any], tracker: Any, streams: dict[int, str]) -> dict[str, Any]:
    """``settings`` completed with what the traced step did: its streams, cuBLAS handles and communicators."""
    ws = settings["cublas_workspace"]
    handles = sorted(((t, th, s) for (th, s), t in tracker.first_matmuls.items()))
    comms = communicators(list(tracker.process_groups), settings["nccl"]["bytes_per_communicator"])
    return {
        **settings,
        "streams": [{"id": sid, "name": name} for sid, name in sorted(streams.items())],
        "cublas_workspace": {
            **ws,
            "handles": [{"thread": th, "stream": s, "first_task": t} for t, th, s in handles],
            "bytes": ws["bytes_per_handle"] * len(handles),
        },
        "nccl": {**settings["nccl"], "communicators": comms, "bytes": sum(c["bytes"] for c in comms)},
    }


__all__ = ["CudaRuntime", "communicators", "cublas_config_bytes", "observed"]
