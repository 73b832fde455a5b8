"""The tracker's global state (the active tracker, the resize_ patch) lives only while it records, and blocks are
finished by one rule, worked here by hand."""

from __future__ import annotations

import pytest
import torch

from hyperdryrun import SimulatedWorld, SimulationError, simulate
from hyperdryrun.trace.blocks import PERSISTENT_END, Block, Category, Phase, finalize_blocks
from hyperdryrun.trace.tracker import active_tracker


def model_fn() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batch_fn(i: int, device: torch.device) -> torch.Tensor:
    return torch.randn(8, 16, device=device)


def test_active_tracker_is_the_started_tracker_only_while_it_records():
    assert active_tracker() is None
    with SimulatedWorld(world_size=1) as world, world.fake():
        tracker = world.track()
        assert active_tracker() is None
        tracker.start()
        assert active_tracker() is tracker
        tracker.stop()
        assert active_tracker() is None
        tracker.stop()  # idempotent
        assert active_tracker() is None


class Boom(Exception):
    pass


def test_a_raising_step_leaves_no_active_tracker_and_storage_resize_as_it_was():
    seen = []

    def exploding_loss(model, batch):
        tracker = active_tracker()
        seen.append(tracker is not None and tracker.active)
        raise Boom("in the loss")

    assert "resize_" not in torch.UntypedStorage.__dict__  # inherited from torch._C.StorageBase
    orig = torch.UntypedStorage.resize_
    with pytest.raises(SimulationError, match="Boom: in the loss"):
        simulate(model_fn, batch_fn, loss_fn=exploding_loss, world_size=2)
    assert seen == [True]  # the step's tracker, recording
    assert active_tracker() is None
    assert "resize_" not in torch.UntypedStorage.__dict__
    assert torch.UntypedStorage.resize_ is orig


def _block(i: int, start: int, end: int, phase: Phase, category: Category | None = None) -> Block:
    return Block(
        id=i, size=512, requested=512, start=start, end=end, op="op", phase=phase, module="", stack_id=0,
        category=category,
    )  # fmt: skip


def test_finalize_blocks_by_hand():
    blocks = [
        _block(0, 0, PERSISTENT_END, Phase.INITIALIZATION),
        _block(1, 1, 2, Phase.FORWARD),
        _block(2, 2, 3, Phase.BACKWARD, Category.GRADIENT),
        _block(3, 2, PERSISTENT_END, Phase.OPTIMIZER),
        _block(4, 1, 2, Phase.RECOMPUTE),
    ]
    assert finalize_blocks(blocks) is blocks
    # Task 1: two allocations (1, 4) -> 1 + 1/3, 1 + 2/3. Task 2: the frees of 1 and 4 before the allocations of
    # 2 and 3 -> 2 + k/5. Task 3: the free of 2 -> 3.5. Task 0: 0.5. Persistent blocks keep their end_plot.
    assert [(b.start_plot, b.end_plot) for b in blocks] == [
        (0.5, float(PERSISTENT_END)),
        (round(1 + 1 / 3, 12), 2.2),
        (2.6, 3.5),
        (2.8, float(PERSISTENT_END)),
        (round(1 + 2 / 3, 12), 2.4),
    ]
    assert [b.category for b in blocks] == [
        Category.OTHER,
        Category.ACTIVATION,
        Category.GRADIENT,
        Category.TEMP,
        Category.ACTIVATION,
    ]


def test_a_waited_collective_output_stays_allocated_while_its_unwaited_tensor_is_held():
    """Real ``wait_tensor`` returns its input, so the reduce-scatter's output and the waited tensor are one memory,
    freed when both are gone (selective AC holds the unwaited output, torchtitan's policy saves reduce-scatters).
    Under fake mode the wait returns a new storage; the block must still end only after the last holder dies.
    By hand: task 0 allocates the 2 x 256 fp32 reduce-scatter's 1 x 256 output (1024 B), task 1 uses it through the
    waited tensor, which then dies; task 2 uses it through the held output, which dies before task 3: end 3."""
    import torch.distributed as dist

    c10d = torch.ops._c10d_functional
    with SimulatedWorld(world_size=2) as world, world.fake():
        tracker = world.track(capture_stacks=False)
        x = torch.empty(2, 256, device=world.device)
        tracker.start()
        held = c10d.reduce_scatter_tensor(x, "sum", 2, dist.group.WORLD.group_name)
        waited = c10d.wait_tensor(held)
        y = waited + 1
        del waited
        z = held * 2
        del held
        w = y * 2
        tracker.stop()
    assert tracker.task_op == ["reduce_scatter_tensor", "add", "mul", "mul"]
    scattered = tracker.blocks[0]
    assert (scattered.size, scattered.start, scattered.end, scattered.users) == (1024, 0, 3, [1, 2])
    assert [b.start for b in tracker.blocks[1:]] == [1, 2, 3]
    del y, z, w
