"""Everything the simulated world touches is restored on exit, also when the step raises."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPCommContext
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from hyperdryrun import SimulatedWorld, SimulationError, simulate
from hyperdryrun.engine import default_optimizer


def snapshot() -> dict:
    """The globals a simulation may touch, captured by value or identity."""
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    return {
        "pg": dist.is_initialized(),
        "modes": len(_get_current_dispatch_mode_stack()),
        "sdpa": F.scaled_dot_product_attention,
        "dropout": F.dropout,
        "resize_": torch.UntypedStorage.resize_,
        "sharding_prop": ShardingPropagator.__dict__["_propagate_tensor_meta_non_cached"],
        "fsdp_accumulated_grad": FSDPParam.__dict__["to_accumulated_grad_if_needed"],
        "fsdp_streams": FSDPCommContext.__dict__["lazy_init"],
        "record_stream": torch.Tensor.record_stream,
        "record_stream_own": "record_stream" in torch.Tensor.__dict__,
        "cpu_stream": torch.cpu.current_stream(),
        "dtype": torch.get_default_dtype(),
        "device": torch.get_default_device(),
        "grad": torch.is_grad_enabled(),
        "env": dict(os.environ),
        "fw_pre_hooks": len(nn_module._global_forward_pre_hooks),
        "fw_hooks": len(nn_module._global_forward_hooks),
        "bw_hooks": len(nn_module._global_backward_hooks),
        "opt_pre": len(optim_module._global_optimizer_pre_hooks),
        "opt_post": len(optim_module._global_optimizer_post_hooks),
    }


def model_fn() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batch_fn(i: int, device: torch.device) -> torch.Tensor:
    return torch.randn(8, 16, device=device)


def good_loss(model, batch):
    return model(batch).square().mean()


class Boom(Exception):
    pass


def exploding_loss(model, batch):
    # inside the step, with the tracker, the fake mode, hooks and patches all active
    torch.set_default_dtype(torch.float64)
    os.environ["HYPERDRYRUN_TEST_LEAK"] = "1"
    torch.set_grad_enabled(False)
    model(batch)
    raise Boom("inside the step")


def test_a_successful_simulation_leaves_every_global_as_it_was():
    before = snapshot()
    trace = simulate(model_fn, batch_fn, loss_fn=good_loss, world_size=4, rank=1)
    assert trace.peak > 0
    assert snapshot() == before


def test_an_exception_inside_the_step_leaves_every_global_as_it_was():
    before = snapshot()
    with pytest.raises(SimulationError) as info:
        simulate(model_fn, batch_fn, loss_fn=exploding_loss, world_size=2, rank=0)
    assert info.value.stage == "step"
    assert isinstance(info.value.error, Boom)
    assert snapshot() == before
    assert "HYPERDRYRUN_TEST_LEAK" not in os.environ


def test_the_world_context_restores_after_an_exception_in_its_body():
    before = snapshot()
    with pytest.raises(Boom), SimulatedWorld(world_size=8, rank=7) as world:
        assert dist.is_initialized() and dist.get_world_size() == 8 and dist.get_rank() == 7
        with world.fake():
            assert len(_get_current_dispatch_mode_stack()) == 1
            torch.set_default_device("meta")
            raise Boom
    assert snapshot() == before


def test_kernel_patches_are_active_inside_and_undone_outside():
    outside = F.scaled_dot_product_attention
    with SimulatedWorld(world_size=1, target_device="cuda", simulation_device="cpu"):
        assert F.scaled_dot_product_attention is not outside
    assert F.scaled_dot_product_attention is outside


def test_resize_patch_lives_only_while_tracking():
    orig = torch.UntypedStorage.resize_
    with SimulatedWorld(world_size=1) as world, world.fake():
        tracker = world.track()
        tracker.start()
        assert torch.UntypedStorage.resize_ is not orig
        tracker.stop()
        assert torch.UntypedStorage.resize_ is orig
    assert torch.UntypedStorage.resize_ is orig


def test_two_simulations_in_a_row_agree():
    # a leaked process group or mode would make the second one fail or differ
    a = simulate(model_fn, batch_fn, loss_fn=good_loss, world_size=2, optimizer_fn=default_optimizer)
    b = simulate(model_fn, batch_fn, loss_fn=good_loss, world_size=2, optimizer_fn=default_optimizer)
    assert (a.peak, a.num_tasks, len(a.blocks)) == (b.peak, b.num_tasks, len(b.blocks))


def test_an_existing_process_group_is_refused_not_replaced():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="already initialised"), SimulatedWorld(world_size=2):
            pass
        assert dist.is_initialized() and dist.get_world_size() == 2
    finally:
        dist.destroy_process_group()


def test_transformers_packed_sequence_check_is_answered_only_inside_fake():
    masking_utils = pytest.importorskip("transformers.masking_utils")
    outside = masking_utils.find_packed_sequence_indices
    with SimulatedWorld(world_size=1) as world:
        assert masking_utils.find_packed_sequence_indices is outside
        with world.fake():
            patched = masking_utils.find_packed_sequence_indices
            assert patched is not outside
            assert patched(torch.arange(8).view(1, 8)) is None  # one sequence per row on fake positions
        # real positions run transformers' own check: two sequences packed in a row
        assert patched(torch.tensor([[0, 1, 2, 0, 1]])).tolist() == [[0, 0, 0, 1, 1]]
        assert masking_utils.find_packed_sequence_indices is outside
    assert masking_utils.find_packed_sequence_indices is outside
