"""compat/torchtitan_families.py: the torchvision stand-in, the multimodal batch fields, Triton launches on fake
tensors, and the family checks, each undone on exit."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch

from hyperdryrun.compat.torchtitan_families import (
    TORCHVISION_MODULES,
    dist_muon_groups,
    fla_layers,
    torchvision_stand_in,
    triton_launch_patches,
)
from hyperdryrun.patches import PatchSet


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed")
def test_the_torchvision_stand_in_imports_as_the_data_loader_does_and_is_gone_on_exit():
    before = {name: sys.modules.get(name) for name in TORCHVISION_MODULES}
    with torchvision_stand_in() as standing_in:
        assert standing_in
        import torchvision.io
        import torchvision.transforms.v2.functional as tvf

        assert tvf is sys.modules["torchvision.transforms.v2.functional"]
        with pytest.raises(ImportError, match="torchvision is not installed"):
            torchvision.io.decode_image  # noqa: B018  (used only when data is loaded)
    assert {name: sys.modules.get(name) for name in TORCHVISION_MODULES} == before
    assert importlib.util.find_spec("torchvision") is None


def test_the_torchvision_stand_in_is_gone_after_an_error():
    before = {name: sys.modules.get(name) for name in TORCHVISION_MODULES}
    with pytest.raises(RuntimeError), torchvision_stand_in():
        raise RuntimeError("config failed")
    assert {name: sys.modules.get(name) for name in TORCHVISION_MODULES} == before


def test_a_triton_launch_on_fake_tensors_does_nothing_and_the_launcher_is_triton_s_again():
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from torch._subclasses.fake_tensor import FakeTensorMode
    from triton.runtime.jit import KernelInterface

    @triton.jit
    def fill(x_ptr, n: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, n), 1.0)

    own = KernelInterface.__dict__["__getitem__"]
    with FakeTensorMode():
        x = torch.empty(8)
    with PatchSet(triton_launch_patches()):
        assert fill[(1,)](x, n=8) is None
    assert KernelInterface.__dict__["__getitem__"] is own


class GatedDeltaNet:
    """Stands in for qwen3_5's GatedDeltaNet (its config class's qualified name)."""

    class Config:
        pass


def test_deltanet_layers_are_found_by_their_config_type():
    layer = SimpleNamespace
    model = SimpleNamespace(
        layers=[
            layer(delta_net=GatedDeltaNet.Config()),
            layer(delta_net=None),
            layer(delta_net=GatedDeltaNet.Config()),
        ]
    )
    assert fla_layers(model) == [0, 2]
    assert fla_layers(model, 2) == [0]


def test_dist_muon_groups_are_the_patterns_of_its_parameter_groups():
    group = SimpleNamespace
    config = SimpleNamespace(
        optimizer=SimpleNamespace(
            param_groups=[
                group(pattern="a$", optimizer_name="DistMuon"),
                group(pattern=".*", optimizer_name="AdamW"),
            ]
        )
    )
    assert dist_muon_groups(config) == ["a$"]
    assert dist_muon_groups(SimpleNamespace(optimizer=SimpleNamespace(param_groups=None))) == []
