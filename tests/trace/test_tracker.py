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
