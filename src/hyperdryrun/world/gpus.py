"""GPU presets: the accelerators a dry run can target, with what torch 2.13 does differently on each.

Each row is hardware data (memory, compute capability) plus what follows from it in the pinned torch: the cuBLAS
workspace torch allocates per stream and NCCL's default channel buffer. The SDPA backend follows from the compute
capability *and* the torch build's cuDNN, so a :class:`hyperdryrun.world.cuda_target.CudaTarget` (GPU + build)
says it: ``hyperdryrun.world.sdpa.sdpa_priority(CudaTarget(gpu_preset("a100-80gb")))`` is flash first, cuDNN first
on sm90 and sm100 with the pinned wheel's cuDNN 9.20.

Memory: NVIDIA and AMD write "GB", but HBM is built in stacks of 2**30-multiples (A100 80GB: five 16 GiB stacks) and
the vendors' figures are those binary sizes, so ``capacity_bytes`` is the figure in GiB. It is an upper bound on what
torch can allocate: the driver keeps some (``nvidia-smi`` shows 81559 MiB on an H100 80GB, 81920 MiB = 80 GiB on an
A100 80GB, 40960 MiB = 40 GiB on an A100 40GB: modal-labs/modal-client#2797), ``cudaDeviceProp.totalGlobalMem``
(= ``torch.cuda.get_device_properties().total_memory``) is lower still (A100-SXM4-40GB: 42,298,834,944 B =
40339 MiB, deviceQuery in bottlerocket-os/bottlerocket#3873), and the CUDA context takes a few hundred MiB more.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30
MiB = 2**20

NCCL_DEFAULT_BUFFSIZE = 1 << 22
"""``NCCL_BUFFSIZE`` unset: 4 MiB per channel, peer and direction for the Simple protocol (NVIDIA/nccl src/init.cc
``#define DEFAULT_BUFFSIZE (1 << 22) /* 4MiB */``, ``computeBuffSizes``; ROCm/rccl src/init.cc has the same default).
Some NCCL versions take ``DEFAULT_BUFFSIZE_ARM`` (1 MiB) on an ARM host such as Grace: the host CPU is not modelled."""

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


@dataclass(frozen=True)
class GpuPreset:
    """One accelerator: its memory, its architecture and the per-stream workspaces torch 2.13 gives it."""

    name: str
    product: str
    marketed_memory: str
    """The vendor's figure, as the vendor writes it."""
    capacity_bytes: int
    """The marketed figure in GiB (see the module docstring): an upper bound on what torch can allocate."""
    arch: str
    """``sm<major><minor>`` for NVIDIA, the ``gcnArchName`` for AMD."""
    compute_capability: tuple[int, int] | None
    """CUDA compute capability; None for a ROCm GPU, to which sdp_utils.cpp's sm rules do not apply."""
    blas_workspace_bytes: int
    """cuBLAS (hipBLAS on ROCm) workspace per (handle, stream) that runs a matmul, from the caching allocator."""
    blaslt_workspace_bytes: int
    """A separate cuBLASLt/hipBLASLt workspace per (handle, stream): 0 where it reuses the cuBLAS one (CUDA)."""
    nccl_buffer_bytes: int = NCCL_DEFAULT_BUFFSIZE
    not_modelled: str = ""
    """Why a dry run cannot target this GPU yet (empty when it can)."""


def _nvidia(name: str, product: str, marketed: str, gib: int, cc: tuple[int, int]) -> GpuPreset:
    return GpuPreset(
        name=name,
        product=product,
        marketed_memory=marketed,
        capacity_bytes=gib * GiB,
        arch=f"sm{cc[0]}{cc[1]}",
        compute_capability=cc,
        blas_workspace_bytes=cublas_workspace_bytes(cc),
        blaslt_workspace_bytes=0,
    )


GPU_PRESETS: dict[str, GpuPreset] = {
    p.name: p
    for p in [
        # NVIDIA A100 datasheet: 40GB HBM2 / 80GB HBM2e; compute capability 8.0 (CUDA C Programming Guide).
        _nvidia("a100-40gb", "NVIDIA A100 40GB (SXM4 or PCIe)", "40 GB HBM2", 40, (8, 0)),
        _nvidia("a100-80gb", "NVIDIA A100 80GB (SXM4 or PCIe)", "80 GB HBM2e", 80, (8, 0)),
        # NVIDIA H100 datasheet: H100 SXM 80GB HBM3 (five 16 GiB stacks); compute capability 9.0.
        _nvidia("h100-80gb", "NVIDIA H100 80GB HBM3 (SXM5)", "80 GB HBM3", 80, (9, 0)),
        # Six 16 GiB HBM3 stacks: the Hopper GPU of a GH200 96GB (an ARM Grace host) and the H20 (nvidia-smi shows
        # 97871 MiB on an H20: deepseek-ai/DeepEP#17); compute capability 9.0.
        _nvidia("h100-96gb", "NVIDIA H100 96GB HBM3 (GH200 96GB; H20)", "96 GB HBM3", 96, (9, 0)),
        # NVIDIA H200 datasheet: 141GB HBM3e; the same GH100 die as H100, compute capability 9.0.
        _nvidia("h200", "NVIDIA H200 141GB HBM3e (SXM)", "141 GB HBM3e", 141, (9, 0)),
        # NVIDIA DGX/HGX B200 datasheets: 1,440 GB for 8 GPUs, 180 GB each (192 GB physical, as first announced:
        # huggingface/huggingface.js#1539); nvidia-smi shows 183359 MiB (NVIDIA/TensorRT-LLM#10278), totalGlobalMem
        # 178.35 GiB (pytorch/ao#4002); compute capability 10.0.
        _nvidia("b200", "NVIDIA B200 180GB HBM3e (HGX/DGX B200)", "180 GB HBM3e", 180, (10, 0)),
        # AMD Instinct MI300X datasheet: 192 GB HBM3 (eight 24 GiB stacks); rocminfo shows a 201,310,208 KB global
        # pool on a gfx942 MI300 (ROCm/aiter#3807), 16 MiB under 192 GiB.
        GpuPreset(
            name="mi300x",
            product="AMD Instinct MI300X",
            marketed_memory="192 GB HBM3",
            capacity_bytes=192 * GiB,
            arch="gfx942",
            compute_capability=None,
            blas_workspace_bytes=HIPBLAS_WORKSPACE_GFX94,
            blaslt_workspace_bytes=HIPBLASLT_WORKSPACE,
            not_modelled=(
                "the ROCm build of torch 2.13 chooses SDPA differently (no cuDNN; AOTriton flash attention first, "
                "then memory-efficient without GQA, sdp_utils.cpp USE_ROCM branches) and its fused kernels' "
                "outputs and saved tensors have not been audited against a ROCm reference"
            ),
        ),
    ]
}
"""The GPU presets by name."""

DEFAULT_GPU = "h100-80gb"
"""The GPU a CUDA target is when none is named: an sm90 H100, as the kernel audit's reference was recorded for."""


def gpu_preset(name: str) -> GpuPreset:
    """The preset called ``name``; a ValueError naming the known ones otherwise."""
    try:
        return GPU_PRESETS[name]
    except KeyError:
        raise ValueError(f"gpu={name!r}: choose one of {', '.join(GPU_PRESETS)}") from None


__all__ = ["DEFAULT_GPU", "GPU_PRESETS", "GpuPreset", "cublas_workspace_bytes", "gpu_preset"]
