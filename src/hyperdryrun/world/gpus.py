"""GPU presets: the accelerators a dry run can target, with what torch 2.13 does differently on each.

Each row is hardware data (memory, compute capability) plus what follows from it in the pinned torch: the cuBLAS
workspace torch allocates per stream and NCCL's default channel buffer. The SDPA backend follows from the compute
capability *and* the torch build's cuDNN, so a :class:`hyperdryrun.world.cuda_target.CudaTarget` (GPU + build)
says it: ``hyperdryrun.world.sdpa.sdpa_priority(CudaTarget(gpu_preset("a100-80gb")))`` is flash first, cuDNN first
on sm90 and sm100 with the pinned wheel's cuDNN 9.20.

Memory: ``capacity_bytes`` is what torch reports as ``torch.cuda.get_device_properties().total_memory`` on the
card (``cudaDeviceProp.totalGlobalMem``, the "total capacity" of torch's out-of-memory message): the memory a
process can have, its CUDA context included. It is less than the vendor's figure (``marketed_memory``, kept as a
label only) and than nvidia-smi's total, by what the driver reserves: on the H200 measured for this project
(torch 2.11 cu130, driver 580) 143,155.94 MiB against nvidia-smi's 143,771 MiB. The reserve depends on the driver
a little (H100 80GB: 79.10-79.11 GiB in torch's out-of-memory messages in 2025 threads, 79.18-79.21 GiB from deviceQuery
on drivers 12.4-13.0: about 0.1%), far less than the verdict's margin (:mod:`hyperdryrun.allocator.verdict`). Each
preset's ``capacity_source`` says where its figure comes from, and which are estimates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hyperdryrun.compat.torch_cublas import (
    HIPBLAS_WORKSPACE_GFX94,
    HIPBLASLT_WORKSPACE,
    cublas_workspace_bytes,
)

GiB = 2**30
MiB = 2**20
GB = 10**9

NCCL_DEFAULT_BUFFSIZE = 1 << 22
"""``NCCL_BUFFSIZE`` unset: 4 MiB per channel, peer and direction for the Simple protocol (NVIDIA/nccl src/init.cc
``#define DEFAULT_BUFFSIZE (1 << 22) /* 4MiB */``, ``computeBuffSizes``; ROCm/rccl src/init.cc has the same default).
Some NCCL versions take ``DEFAULT_BUFFSIZE_ARM`` (1 MiB) on an ARM host such as Grace: the host CPU is not modelled."""


@dataclass(frozen=True)
class Rates:
    """What a step's time is estimated from (:mod:`hyperdryrun.search.roofline`): one GPU's peak dense bf16 FLOP/s
    and HBM bandwidth, the per-GPU bandwidth (one direction) within a node and between nodes, and GPUs per node."""

    peak_flops: float
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    gpus_per_node: int = 8
    source: str = ""

    def with_overrides(self, **changes: Any) -> Rates:
        """These rates with the given fields replaced (None leaves a field as it is)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


_NDR = (
    50 * GB
)  # 400 Gb/s InfiniBand NDR / ConnectX-7, one NIC per GPU (DGX H100, HGX H200/B200, MI300X platforms)
_HDR = 25 * GB  # 200 Gb/s InfiniBand HDR, one NIC per GPU (DGX A100)


@dataclass(frozen=True)
class GpuPreset:
    """One accelerator: its memory, its architecture and the per-stream workspaces torch 2.13 gives it."""

    name: str
    product: str
    marketed_memory: str
    """The vendor's figure, as the vendor writes it: a label, not a capacity."""
    capacity_bytes: int
    """What torch reports as ``total_memory`` on this card (see the module docstring)."""
    capacity_source: str
    """Where ``capacity_bytes`` comes from; it starts with "estimate" where no source prints it."""
    arch: str
    """``sm<major><minor>`` for NVIDIA, the ``gcnArchName`` for AMD."""
    compute_capability: tuple[int, int] | None
    """CUDA compute capability; None for a ROCm GPU, to which sdp_utils.cpp's sm rules do not apply."""
    blas_workspace_bytes: int
    """cuBLAS (hipBLAS on ROCm) workspace per (handle, stream) that runs a matmul, from the caching allocator."""
    blaslt_workspace_bytes: int
    """A separate cuBLASLt/hipBLASLt workspace per (handle, stream): 0 where it reuses the cuBLAS one (CUDA)."""
    rates: Rates
    """Peak rates for the layout search's step-time estimate, with their datasheet sources."""
    nccl_buffer_bytes: int = NCCL_DEFAULT_BUFFSIZE
    not_modelled: str = ""
    """Why a dry run cannot target this GPU yet (empty when it can)."""


def _nvidia(
    name: str, product: str, marketed: str, total: int, source: str, cc: tuple[int, int], rates: Rates
) -> GpuPreset:
    return GpuPreset(
        name=name,
        product=product,
        marketed_memory=marketed,
        capacity_bytes=total,
        capacity_source=source,
        arch=f"sm{cc[0]}{cc[1]}",
        compute_capability=cc,
        blas_workspace_bytes=cublas_workspace_bytes(cc),
        blaslt_workspace_bytes=0,
        rates=rates,
    )


GPU_PRESETS: dict[str, GpuPreset] = {
    p.name: p
    for p in [
        # NVIDIA A100 datasheet: 40GB HBM2 / 80GB HBM2e; compute capability 8.0 (CUDA C Programming Guide).
        _nvidia(
            "a100-40gb",
            "NVIDIA A100 40GB (SXM4 or PCIe)",
            "40 GB HBM2",
            42_298_834_944,
            "deviceQuery totalGlobalMem on an A100-SXM4-40GB, 42,298,834,944 B = 39.39 GiB "
            "(https://github.com/bottlerocket-os/bottlerocket/issues/3873); torch's OOM messages print the same "
            "39.39 GiB",
            (8, 0),
            Rates(
                312e12,
                1555 * GB,
                300 * GB,
                _HDR,
                8,
                "NVIDIA A100 datasheet: BF16 312 TFLOPS dense (624 with sparsity), HBM2 1,555 GB/s, NVLink 600 GB/s "
                "(both directions); DGX A100: 8 x 200 Gb/s HDR",
            ),  # fmt: skip
        ),
        _nvidia(
            "a100-80gb",
            "NVIDIA A100 80GB (SXM4 or PCIe)",
            "80 GB HBM2e",
            81_050 * MiB,
            "estimate: 79.15 GiB as torch 2.x OOM messages print it in public logs (no thread found to cite; "
            "older drivers print 79.25 GiB, https://github.com/levihsu/OOTDiffusion/issues/235), taken as the "
            "nearest MiB, 81,050 MiB",
            (8, 0),
            Rates(
                312e12,
                2039 * GB,
                300 * GB,
                _HDR,
                8,
                "NVIDIA A100 datasheet: BF16 312 TFLOPS dense, HBM2e 2,039 GB/s (SXM), NVLink 600 GB/s; DGX A100: "
                "8 x 200 Gb/s",
            ),  # fmt: skip
        ),
        # NVIDIA H100 datasheet: H100 SXM 80GB HBM3; compute capability 9.0.
        _nvidia(
            "h100-80gb",
            "NVIDIA H100 80GB HBM3 (SXM5)",
            "80 GB HBM3",
            81_009 * MiB,
            "torch's OOM message on an H100 80GB HBM3, 'GPU 0 has a total capacity of 79.11 GiB' "
            "(https://github.com/vllm-project/vllm/issues/27508; vLLM logs 79.10 GiB in "
            "https://github.com/huggingface/trl/issues/2688), as the nearest MiB, 81,009 MiB (two decimals of "
            "GiB fix it to +-5 MiB)",
            (9, 0),
            Rates(
                989.5e12,
                3350 * GB,
                450 * GB,
                _NDR,
                8,
                "NVIDIA H100 datasheet (SXM): BF16 1,979 TFLOPS with sparsity = 989.5 dense, HBM3 3.35 TB/s, NVLink "
                "900 GB/s (both directions); DGX H100: 8 x 400 Gb/s ConnectX-7",
            ),  # fmt: skip
        ),
        # Six 16 GiB HBM3 stacks: the Hopper GPU of a GH200 96GB (an ARM Grace host) and the H20; cc 9.0.
        _nvidia(
            "h100-96gb",
            "NVIDIA H100 96GB HBM3 (GH200 96GB; H20)",
            "96 GB HBM3",
            97_321 * MiB,
            "estimate: no source prints torch's total_memory for these cards; nvidia-smi's 97,871 MiB on an H20 "
            "(https://github.com/deepseek-ai/DeepEP/issues/17) less the 550 MiB the driver keeps from an H100 80GB "
            "(nvidia-smi 81,559 MiB, https://github.com/modal-labs/modal-client/pull/2797, against torch's "
            "81,009 MiB)",
            (9, 0),
            Rates(
                989.5e12,
                4000 * GB,
                450 * GB,
                _NDR,
                8,
                "NVIDIA GH200 datasheet: H100 96GB HBM3 4 TB/s, BF16 989.5 TFLOPS dense, NVLink 900 GB/s",
            ),  # fmt: skip
        ),
        # NVIDIA H200 datasheet: 141GB HBM3e; the same GH100 die as H100, compute capability 9.0.
        _nvidia(
            "h200",
            "NVIDIA H200 141GB HBM3e (SXM)",
            "141 GB HBM3e",
            150_109_880_320,
            "measured for this project: torch 2.11.0+cu130 on an H200 (driver 580.159.04) reports total_memory = "
            "150,109,880,320 B = 139.80 GiB (nvidia-smi: 143,771 MiB)",
            (9, 0),
            Rates(
                989.5e12,
                4800 * GB,
                450 * GB,
                _NDR,
                8,
                "NVIDIA H200 datasheet (SXM): BF16 1,979 TFLOPS with sparsity = 989.5 dense, HBM3e 4.8 TB/s, NVLink "
                "900 GB/s",
            ),  # fmt: skip
        ),
        # NVIDIA DGX/HGX B200 datasheets: 1,440 GB for 8 GPUs, 180 GB each (192 GB physical, as first announced:
        # huggingface/huggingface.js#1539); nvidia-smi shows 183359 MiB (NVIDIA/TensorRT-LLM#10278); cc 10.0.
        _nvidia(
            "b200",
            "NVIDIA B200 180GB HBM3e (HGX/DGX B200)",
            "180 GB HBM3e",
            182_630 * MiB,
            "totalGlobalMem 178.35 GiB on a B200 (https://github.com/pytorch/ao/issues/4002), as the nearest "
            "MiB, 182,630 MiB",
            (10, 0),
            Rates(
                2250e12,
                8000 * GB,
                900 * GB,
                _NDR,
                8,
                "NVIDIA HGX B200 datasheet: FP16/BF16 36 PFLOPS with sparsity for 8 GPUs = 2.25 PFLOPS dense per GPU, "
                "HBM3e 8 TB/s per GPU, NVLink 5 1.8 TB/s per GPU (both directions)",
            ),  # fmt: skip
        ),
        GpuPreset(
            name="mi300x",
            product="AMD Instinct MI300X",
            marketed_memory="192 GB HBM3",
            capacity_bytes=201_310_208 * 1024,
            capacity_source="estimate: rocminfo's GPU global pool on a gfx942 MI300, 201,310,208 KB = 191.98 GiB "
            "(https://github.com/ROCm/aiter/issues/3807), taken as what HIP reports as totalGlobalMem",
            arch="gfx942",
            compute_capability=None,
            blas_workspace_bytes=HIPBLAS_WORKSPACE_GFX94,
            blaslt_workspace_bytes=HIPBLASLT_WORKSPACE,
            rates=Rates(
                1307.4e12,
                5300 * GB,
                448 * GB,
                _NDR,
                8,
                "AMD Instinct MI300X datasheet: BF16 1,307.4 TFLOPS dense (2,614.9 with sparsity), HBM3 5.3 TB/s, "
                "Infinity Fabric 896 GB/s peer bandwidth (both directions)",
            ),  # fmt: skip
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


__all__ = ["DEFAULT_GPU", "GB", "GPU_PRESETS", "GpuPreset", "Rates", "cublas_workspace_bytes", "gpu_preset"]
