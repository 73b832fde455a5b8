"""GPU presets: memory as the vendors state it, and the per-stream workspaces torch 2.13 allocates on each."""

from __future__ import annotations

import pytest

from hyperdryrun.world.gpus import GPU_PRESETS, gpu_preset

MiB, GiB = 2**20, 2**30

# What torch reports as total_memory, from the sources each preset cites (worked out here from the printed figures,
# not read from the presets): bytes where a source prints bytes, else the printed GiB to two decimals taken as the
# nearest MiB.
TOTAL_MEMORY = {
    "a100-40gb": 42_298_834_944,  # deviceQuery, bottlerocket-os/bottlerocket#3873
    "a100-80gb": round(79.15 * 1024) * MiB,  # estimate: torch OOM messages, 79.15 GiB
    "h100-80gb": round(79.11 * 1024) * MiB,  # torch OOM message, vllm-project/vllm#27508
    "h100-96gb": (97_871 - (81_559 - round(79.11 * 1024)))
    * MiB,  # estimate: H20 nvidia-smi less H100's reserve
    "h200": 150_109_880_320,  # measured: ../shared/gpu/h200_measured.json device_facts.total_memory_bytes
    "b200": round(178.35 * 1024) * MiB,  # totalGlobalMem, pytorch/ao#4002
    "mi300x": 201_310_208 * 1024,  # estimate: rocminfo global pool in KB, ROCm/aiter#3807
}
ESTIMATES = {"a100-80gb", "h100-96gb", "mi300x"}
MARKETED_GB = {"a100-40gb": 40, "a100-80gb": 80, "h100-80gb": 80, "h100-96gb": 96, "h200": 141, "b200": 180,
               "mi300x": 192}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TOTAL_MEMORY))
def test_capacity_is_what_torch_reports_as_total_memory(name):
    gpu = gpu_preset(name)
    assert gpu.capacity_bytes == TOTAL_MEMORY[name]
    assert gpu.capacity_source.startswith("estimate") == (name in ESTIMATES)
    if name not in ("h200",):
        assert "https://github.com/" in gpu.capacity_source  # each figure cites where it was printed


def test_the_h200_capacity_is_the_measured_139_80_gib():
    assert gpu_preset("h200").capacity_bytes == 150_109_880_320
    assert f"{150_109_880_320 / GiB:.2f}" == "139.80"


@pytest.mark.parametrize("name", sorted(TOTAL_MEMORY))
def test_the_marketed_figure_is_a_label_above_the_capacity(name):
    gpu = gpu_preset(name)
    assert gpu.marketed_memory.startswith(f"{MARKETED_GB[name]} GB")
    # the driver keeps some: what torch sees is under the marketed figure read as GiB, by less than 4%
    assert 0.96 * MARKETED_GB[name] * GiB < gpu.capacity_bytes < MARKETED_GB[name] * GiB


# Totals nvidia-smi reports (module docstring of hyperdryrun.world.gpus names where): the driver's reserve is
# between them and torch's total_memory, a few hundred MiB.
NVIDIA_SMI_MIB = {"a100-40gb": 40960, "a100-80gb": 81920, "h100-80gb": 81559, "h100-96gb": 97871, "h200": 143771,
                  "b200": 183359}  # fmt: skip


@pytest.mark.parametrize("name", sorted(NVIDIA_SMI_MIB))
def test_torch_sees_a_few_hundred_mib_less_than_nvidia_smi(name):
    reserve = NVIDIA_SMI_MIB[name] * MiB - gpu_preset(name).capacity_bytes
    assert 400 * MiB < reserve < 1024 * MiB


# torch 2.13 CublasHandlePool.cpp parseChosenWorkspaceSize: ":4096:2:16:8" = 2 x 4096 KiB + 8 x 16 KiB by default,
# 4096 x 8 KiB = 32 MiB for major 9, 10, 12; ROCm gfx94x: 128 MiB, plus hipBLASLt's own 76 MiB.
BLAS_WORKSPACE = {
    "a100-40gb": (2 * 4096 * 1024 + 8 * 16 * 1024, 0),
    "a100-80gb": (8_519_680, 0),
    "h100-80gb": (32 * 1024 * 1024, 0),
    "h100-96gb": (33_554_432, 0),
    "h200": (33_554_432, 0),
    "b200": (33_554_432, 0),
    "mi300x": (128 * 1024 * 1024, 76 * 1024 * 1024),
}


@pytest.mark.parametrize("name", sorted(BLAS_WORKSPACE))
def test_blas_workspaces_follow_torch_2_13_for_the_architecture(name):
    gpu = gpu_preset(name)
    assert (gpu.blas_workspace_bytes, gpu.blaslt_workspace_bytes) == BLAS_WORKSPACE[name]


@pytest.mark.parametrize(
    "release, thirty_two_mib",
    [
        # read from each release's PyPI build, at::cuda::parseChosenWorkspaceSize() (libtorch_cuda.so disassembled)
        ((2, 11), {9}),  # cmpq $0x9, major
        ((2, 12), {9, 10, 12}),  # major - 9 <= 1 || major == 12 (pytorch/pytorch#175344)
        ((2, 13), {9, 10, 12}),
        ((2, 14), {9, 10, 11, 12}),  # major - 9 < 4
    ],
)
def test_the_cublas_workspace_default_by_release_and_architecture(release, thirty_two_mib):
    from hyperdryrun.compat.torch_cublas import cublas_workspace_bytes

    for major in (7, 8, 9, 10, 11, 12):
        expected = 32 * 1024 * 1024 if major in thirty_two_mib else 2 * 4096 * 1024 + 8 * 16 * 1024
        assert cublas_workspace_bytes((major, 0), release) == expected, major


def test_every_preset_has_nccls_default_4_mib_buffer_and_states_its_architecture():
    assert set(GPU_PRESETS) == set(TOTAL_MEMORY)
    for gpu in GPU_PRESETS.values():
        assert gpu.nccl_buffer_bytes == 4 * 1024 * 1024
        if gpu.compute_capability is None:
            assert gpu.arch == "gfx942" and "ROCm" in gpu.not_modelled
        else:
            assert gpu.arch == "sm{}{}".format(*gpu.compute_capability) and gpu.not_modelled == ""
    assert {n: g.compute_capability for n, g in GPU_PRESETS.items()} == {
        "a100-40gb": (8, 0),
        "a100-80gb": (8, 0),
        "h100-80gb": (9, 0),
        "h100-96gb": (9, 0),
        "h200": (9, 0),
        "b200": (10, 0),
        "mi300x": None,
    }


def test_an_unknown_preset_is_an_error_naming_the_known_ones():
    with pytest.raises(ValueError) as info:
        gpu_preset("h300")
    assert str(info.value) == (
        "gpu='h300': choose one of a100-40gb, a100-80gb, h100-80gb, h100-96gb, h200, b200, mi300x"
    )
