"""torch's pipeline stages by release (compat/torch_pipelining.py). Runs on every supported release
(.ci/torch-releases), where a skip fails the subset: each test states what the installed release does."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining.stage import _PipelineStageBase

from hyperdryrun.compat.torch_pipelining import SentFakeOutputsReleased


def test_a_fake_output_is_released_after_its_send_as_the_plain_tensor_it_stands_for():
    """torch 2.15 releases a sent output only when its type is exactly ``torch.Tensor``; the dry run's outputs are
    FakeTensors, so the mixin asks torch's own check about a plain tensor in their place."""
    if not hasattr(_PipelineStageBase, "_output_slot_is_releasable"):
        # torch 2.11 to 2.14 keep every output until its backward: no check, nothing released after a send
        assert not hasattr(_PipelineStageBase, "release_fwd_send_outputs")
        return

    class Stage:  # the attributes torch's check reads, and torch's check itself
        is_last = False
        submod = nn.Linear(2, 2)
        dw_builder = None
        _output_slot_is_releasable = _PipelineStageBase._output_slot_is_releasable

    class DryRunStage(SentFakeOutputsReleased, Stage):
        pass

    plain = torch.ones(4)
    assert Stage()._output_slot_is_releasable(plain) == (True, "")
    with FakeTensorMode():
        fake = torch.ones(4)
        assert Stage()._output_slot_is_releasable(fake) == (False, "output type FakeTensor")  # torch alone
        assert DryRunStage()._output_slot_is_releasable(fake) == (True, "")
        last = DryRunStage()
        last.is_last = True  # the other conditions stay torch's
        assert last._output_slot_is_releasable(fake) == (False, "last-stage output")
    # not a tensor: torch's own refusal, unchanged
    assert DryRunStage()._output_slot_is_releasable((plain,)) == (False, "output type tuple")
