"""GPU presets: memory as the vendors state it, and the per-stream workspaces torch 2.13 allocates on each."""

from __future__ import annotations

import pytest

from hyperdryrun.world.gpus import GPU_PRESETS, gpu_preset

# Vendor datasheets: A100 40GB / 80GB, H100 80GB, H100 96GB (GH200, H20), H200 141GB, B200 180GB (HGX/DGX B200),
# MI300X 192GB; each read as GiB.
MARKETED_GIB = {
    "a100-40gb": 40,
    "a100-80gb": 80,
    "h100-80gb": 80,
    "h100-96gb": 96,
    "h200": 141,
    "b200": 180,
    "mi300x": 192,
}


@pytest.mark.parametrize("name", sorted(MARKETED_GIB))
def test_capacity_is_the_vendor_figure_in_gib(name):
    assert gpu_preset(name).capacity_bytes == MARKETED_GIB[name] * 1024 * 1024 * 1024


# Totals other tools report (module docstring of hyperdryrun.world.gpus names where): none exceeds the capacity,
# and the A100s' nvidia-smi totals are exactly the GiB figure.
REPORTED_MIB = {
    "a100-40gb": [40960, 42298834944 / 2**20],  # nvidia-smi; cudaDeviceProp.totalGlobalMem (deviceQuery)
    "a100-80gb": [81920],
    "h100-80gb": [81559],
    "h100-96gb": [97871],  # nvidia-smi on an H20
    "b200": [183359],
}


@pytest.mark.parametrize("name", sorted(REPORTED_MIB))
def test_what_the_device_reports_is_at_most_the_capacity(name):
    for mib in REPORTED_MIB[name]:
        assert mib * 2**20 <= gpu_preset(name).capacity_bytes
    if name.startswith("a100"):
        assert REPORTED_MIB[name][0] * 2**20 == gpu_preset(name).capacity_bytes


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


def test_every_preset_has_nccls_default_4_mib_buffer_and_states_its_architecture():
    assert set(GPU_PRESETS) == set(MARKETED_GIB)
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
