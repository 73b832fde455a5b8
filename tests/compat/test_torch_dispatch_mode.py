"""compat/torch_dispatch_mode.py: the world's fake mode passes an op through one Dynamo wrapper, not three, and that
one is the outermost (every frame of the dispatch below it still runs with Dynamo's frame callback off)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.eval_frame as eval_frame
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from hyperdryrun.compat.torch_dispatch_mode import unwrapped_dispatch
from hyperdryrun.trace.tracker import TrackingFakeTensorMode
from hyperdryrun.world import SimulatedWorld
from hyperdryrun.world.kernels import TargetFakeTensorMode


def test_unwrapped_dispatch_removes_exactly_torchs_dynamo_wrapper():
    wrapped = FakeTensorMode.__dict__["__torch_dispatch__"]
    assert unwrapped_dispatch(FakeTensorMode) is wrapped.__wrapped__
    # what is left is FakeTensorMode's own (its dispatch counter included), not another Dynamo wrapper
    assert unwrapped_dispatch(FakeTensorMode).__code__ is not wrapped.__code__
    for cls in (TrackingFakeTensorMode, TargetFakeTensorMode):
        own = cls.__dict__["__torch_dispatch__"]
        assert own.__code__ is wrapped.__code__  # torch still wraps our classes' own method
        assert unwrapped_dispatch(cls) is own.__wrapped__


def test_a_method_torch_did_not_wrap_is_returned_as_it_is():
    class Plain(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert unwrapped_dispatch(Plain) is Plain.__dict__["__torch_dispatch__"]


def _wrapper_calls_of_one_add(world: SimulatedWorld) -> int:
    """How many Dynamo wrappers a second, cached ``add`` on fake tensors passes (each asks ``_callback_from_stance``
    once), under the world's fake mode."""
    calls = []
    with world.fake():
        x, y = torch.empty(4, 4), torch.empty(4, 4)
        x + y  # the first: a decomposition fills the fake-tensor cache
        inner = eval_frame._callback_from_stance

        def counting(callback):
            calls.append(callback)
            return inner(callback)

        eval_frame._callback_from_stance = counting
        try:
            x + y
        finally:
            eval_frame._callback_from_stance = inner
    return len(calls)


@pytest.mark.parametrize("tracked", [False, True], ids=["untracked", "tracked"])
@pytest.mark.parametrize("target", ["cuda", "cpu"])
def test_one_op_passes_one_dynamo_wrapper_the_outermost(target, tracked):
    with SimulatedWorld(world_size=2, rank=0, target_device=target, simulation_device="cpu") as world:
        assert type(world.fake_mode) is (TargetFakeTensorMode if target == "cuda" else TrackingFakeTensorMode)
        if tracked:
            world.track(capture_stacks=False).start()
        try:
            # three classes deep on a CUDA target, two on CPU: torch's wrapper on each method would be 3 or 2
            assert _wrapper_calls_of_one_add(world) == 1
        finally:
            if world.tracker is not None:
                world.tracker.stop()
    with FakeTensorMode():  # torch's own mode is left as torch makes it
        x = torch.empty(2)
        x + x


def test_ops_on_dtensors_are_handed_back_without_fake_tensor_dispatch_and_the_reports_are_the_same(
    tmp_path, capsys, monkeypatch
):
    """``fake_tensor_dispatch`` answers an op on DTensors with NotImplemented before FakeTensorMode tries its cache
    (it would miss: "non-fake tensor"); the reports equal those of torch's own path, byte for byte."""
    from hyperdryrun.cli import main
    from hyperdryrun.trace import tracker
    from hyperdryrun.world import kernels

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    argv = ["run", "--model", "llama-tiny", "--seq-len", "32", "--world-size", "4", "--tp", "2"]
    argv += ["--ac", "selective", "--num-micro-batches", "2", "--no-stacks", "--quiet"]
    outputs, missed = {}, {}
    for path in ("shortcut", "torch"):
        if path == "torch":
            monkeypatch.setattr(tracker, "_FAKE_DISPATCH", unwrapped_dispatch(FakeTensorMode))
            monkeypatch.setattr(kernels, "_FAKE_DISPATCH", unwrapped_dispatch(FakeTensorMode))
        before = FakeTensorMode.cache_bypasses["non-fake tensor"]
        assert main([*argv, "--output-dir", str(tmp_path / path)]) == 0
        missed[path] = FakeTensorMode.cache_bypasses["non-fake tensor"] - before
        out = tmp_path / path
        outputs[path] = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    capsys.readouterr()
    # the ops on DTensors of the step and set-up (what is left: plain CPU or meta tensors given to the fake mode)
    assert missed["torch"] - missed["shortcut"] > 500
    assert len(outputs["torch"]) == 3 and outputs["shortcut"] == outputs["torch"]
