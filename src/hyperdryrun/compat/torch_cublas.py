"""torch's cuBLAS / hipBLAS workspace per (handle, stream) (``aten/src/ATen/cuda/CublasHandlePool.cpp``,
``parseChosenWorkspaceSize``), by release. Torch-free: the GPU presets and the runtime settings import it.

Which compute capabilities get the 32 MiB default differs by release (:data:`CUBLAS_32MIB_MAJORS`); the H200 rows
(sm90) give the same bytes on 2.11 and 2.13 (docs/TORCH_VERSIONS.md).
"""

from __future__ import annotations

import re

from hyperdryrun.compat.versions import installed_version, release

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


CUBLAS_32MIB_MAJORS: tuple[tuple[tuple[int, int], frozenset[int]], ...] = (
    ((2, 14), frozenset({9, 10, 11, 12})),
    ((2, 12), frozenset({9, 10, 12})),
    ((0, 0), frozenset({9})),
)
"""The compute-capability majors that get :data:`CUBLAS_WORKSPACE_HOPPER_BLACKWELL`, from the first release (major,
minor) on that has them. Read from the released builds' ``at::cuda::parseChosenWorkspaceSize()`` (disassembled
``libtorch_cuda.so`` of the PyPI wheels, offset 0x168 of ``cudaDeviceProp`` being ``major``): 2.11.0 compares
``major == 9``; 2.12.1 and 2.13.0 ``major - 9 <= 1 || major == 12`` (#175344, merged 2026-02-19, after 2.11's
branch cut); 2.14.1 and 2.15.0 ``major - 9 < 4`` (9 to 12: Thor's sm110 joins)."""


def cublas_workspace_bytes(
    compute_capability: tuple[int, int], torch_release: tuple[int, int] | None = None
) -> int:
    """The cuBLAS workspace torch allocates per (handle, stream) on a CUDA GPU of ``compute_capability``, by the
    installed torch's release (or ``torch_release``): :data:`CUBLAS_32MIB_MAJORS`."""
    if torch_release is None:
        torch_release = release(installed_version("torch") or "") or (0, 0)
    majors = next(m for first, m in CUBLAS_32MIB_MAJORS if torch_release >= first)
    return CUBLAS_WORKSPACE_HOPPER_BLACKWELL if compute_capability[0] in majors else CUBLAS_WORKSPACE_DEFAULT


CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
_CUBLAS_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def cublas_config_bytes(config: str) -> int | None:
    """``parseChosenWorkspaceSize``: the sum of SIZE KiB x COUNT over ``:SIZE:COUNT`` pairs; None when none parse
    (torch then warns and uses the default)."""
    pairs = _CUBLAS_PAIR.findall(config)
    return sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else None
