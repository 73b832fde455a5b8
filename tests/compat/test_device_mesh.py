"""DeviceMesh.mesh read inside the dry run's fake mode (compat.torch_dtensor.device_mesh_patches): on every
supported release it is a property computed with tensor ops, which under FakeTensorMode gave a fake tensor without
values. Runs in every release subset (.ci/torch-releases)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from hyperdryrun.world import SimulatedWorld


class Boom(Exception):
    pass


def test_the_mesh_ranks_are_values_inside_the_world_s_fake_mode():
    with SimulatedWorld(world_size=4, rank=1, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp")) as world:
        with world.fake():
            ranks = world.mesh.mesh.tolist()
            tp_ranks = world.mesh["tp"].mesh.tolist()
            made = torch.empty(1)
    assert ranks == [[0, 1], [2, 3]]
    assert tp_ranks == [0, 1]  # rank 1 is (dp 0, tp 1)
    assert type(made).__name__ == "FakeTensor"  # the fake mode itself was on


@pytest.mark.parametrize("raises", [False, True])
def test_the_mesh_property_is_torch_s_own_again_after_the_world(raises):
    own = DeviceMesh.__dict__["mesh"]
    try:
        with SimulatedWorld(world_size=2) as world:
            inside = DeviceMesh.__dict__["mesh"]
            assert world.mesh.mesh.tolist() == [0, 1]
            if raises:
                raise Boom
    except Boom:
        assert raises
    assert DeviceMesh.__dict__["mesh"] is own
    assert inside is not own or not isinstance(own, property)


def test_a_mesh_dimension_unflattens_by_name_on_every_release():
    """``unflatten_mesh`` (torch 2.11's ``DeviceMesh._unflatten`` refuses every dimension name the mesh has): the
    world's 8 ranks as dp_shard 4 x tp 2, dp_shard split into (2, 2): rank 5 is (dp_shard 2, tp 1), so
    dp_shard_mod_ep 1 and ep 0; its ep group holds the ranks with its tp index and dp_shard_mod_ep, ep 0 and 1:
    dp_shard 2 and 3, ranks 5 and 7; its dp_shard_mod_ep group: dp_shard 0 and 2 (ep 0), ranks 1 and 5."""
    from hyperdryrun.compat.torch_dtensor import unflatten_mesh

    with SimulatedWorld(world_size=8, rank=5, mesh_shape=(4, 2), mesh_dim_names=("dp_shard", "tp")) as world:
        full = unflatten_mesh(world.mesh, "dp_shard", (2, 2), ("dp_shard_mod_ep", "ep"))
        assert full.mesh_dim_names == ("dp_shard_mod_ep", "ep", "tp")
        assert full["ep"].mesh.tolist() == [5, 7]
        assert full["dp_shard_mod_ep"].mesh.tolist() == [1, 5]
        assert full["tp"].mesh.tolist() == [4, 5]
