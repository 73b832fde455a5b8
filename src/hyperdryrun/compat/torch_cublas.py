"""torch's cuBLAS / hipBLAS workspace per (handle, stream) (``aten/src/ATen/cuda/CublasHandlePool.cpp``,
``parseChosenWorkspaceSize``), by release. Torch-free: the GPU presets and the runtime settings import it.

The default sizes follow torch 2.13's source; the H200 rows (sm90) give the same bytes on 2.11 and 2.13
(docs/TORCH_VERSIONS.md). Whether 2.11 and 2.12 already have #175344's 32 MiB for majors 10 and 12 is not checked:
a version range belongs here if they do not.
"""

from __future__ import annotations

import re

CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
"""torch 2.13 ``parseChosenWorkspaceSize`` (aten/src/ATen/cuda/CublasHandlePool.cpp) without
``CUBLAS_WORKSPACE_CONFIG``: ``:4096:2:16:8``, two 4 MiB and eight 16 KiB chunks = 8,519,680 bytes."""

CUBLAS_WORKSPACE_HOPPER_BLACKWELL = 4096 * 8 * 1024
"""The same function's 32 MiB default for compute capability major 9, 10 and 12 (Hopper and Blackwell):
pytorch/pytorch#89027 set it for sm90, #175344 (February 2026) extended it to 10 and 12, and its revert #182669 was
closed unmerged; torch 2.13 is later than both (it has #177912's ``torch.backends.cuda.cublas_workspace_size``)."""

HIPBLAS_WORKSPACE_GFX94 = 1024 * 128 * 1024
"""ROCm build, same function: 128 MiB on gfx94x/gfx95x (MI300X is gfx942), else 32 MiB."""

HIPBLASLT_WORKSPACE = 76 * 1024 * 1024
"""ROCm build, ``parseCUDABlasLtWorkspaceSize``: 76 MiB for hipBLASLt, a pool of its own on ROCm. On CUDA the
cuBLASLt workspace reuses the cuBLAS allocation (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, on by default in open-source
builds: torch 2.13 ``torch/backends/cuda/__init__.py``, ``blas_workspace_size``), so it adds nothing there."""


def cublas_workspace_bytes(compute_capability: tuple[int, int]) -> int:
    """The cuBLAS workspace torch 2.13 allocates per (handle, stream) on a CUDA GPU of ``compute_capability``."""
    major = compute_capability[0]
    return CUBLAS_WORKSPACE_HOPPER_BLACKWELL if major in (9, 10, 12) else CUBLAS_WORKSPACE_DEFAULT


CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
_CUBLAS_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def cublas_config_bytes(config: str) -> int | None:
    """``parseChosenWorkspaceSize``: the sum of SIZE KiB x COUNT over ``:SIZE:COUNT`` pairs; None when none parse
    (torch then warns and uses the default)."""
    pairs = _CUBLAS_PAIR.findall(config)
    return sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else None
