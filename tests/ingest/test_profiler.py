"""A live torch.profiler profile -> allocation events: sizes, ops, modules, phases, frames, categories, errors."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from hyperdryrun.ingest.events import trace_from_events
from hyperdryrun.ingest.profiler import (
    ProfilerIngestError,
    _kernel_scratch,
    events_from_profiler,
    mark,
    mark_micro_batch,
    resident_events,
)
from hyperdryrun.trace.blocks import Category, Phase

F32 = 4


def profiled(fn, memory: bool = True):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=memory, with_stack=True) as prof:
        fn()
    return prof


@pytest.fixture
def lin():
    torch.manual_seed(0)
    return nn.Linear(8, 16)


def test_forward_allocations_have_op_module_phase_and_the_callers_frame(lin):
    x = torch.randn(4, 8)
    keep = {}

    def step():
        y = lin(x)
        keep["z"] = y.relu()
        del y

    events = events_from_profiler(profiled(step), module_names={id(lin): "lin"})
    allocs = [e for e in events if e.nbytes > 0]
    assert [e.nbytes for e in allocs] == [4 * 16 * F32, 4 * 16 * F32]
    assert [e.op for e in allocs] == ["addmm", "relu"]
    assert [e.module for e in allocs] == ["lin", ""]
    assert {e.phase for e in allocs} == {Phase.FORWARD}
    here = os.path.abspath(__file__)
    assert allocs[0].frames[0][0] == here and allocs[0].frames[0][2] == "step"
    frees = [e for e in events if e.nbytes < 0]
    assert [(-e.nbytes, e.key) for e in frees] == [(256, allocs[0].key)]
    trace = trace_from_events(events)
    assert (trace.peak, trace.current) == (512, 256)


def test_backward_and_optimizer_phases_and_marked_categories(lin):
    x = torch.randn(4, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9, foreach=False)

    def step():
        mark_micro_batch(1)
        lin(x).sum().backward()
        mark(lin.weight.grad, Category.GRADIENT)
        opt.step()

    events = events_from_profiler(profiled(step), module_names={id(lin): "lin"})
    allocs = [e for e in events if e.nbytes > 0]
    weight_bytes, bias_bytes = 16 * 8 * F32, 16 * F32
    grad_w = [e for e in allocs if e.phase is Phase.BACKWARD and e.nbytes == weight_bytes]
    assert len(grad_w) == 1 and grad_w[0].category is Category.GRADIENT
    # SGD's first step clones each gradient into its momentum buffer, inside Optimizer.step.
    opt_sizes = sorted(e.nbytes for e in allocs if e.phase is Phase.OPTIMIZER)
    assert opt_sizes == [bias_bytes, weight_bytes]
    assert {e.micro_batch for e in allocs} == {1}


def test_kernel_scratch_is_what_a_kernel_frees_before_it_returns():
    def alloc(aid, size, t, kernel_end):
        ev = SimpleNamespace(typed=(None, SimpleNamespace(alloc_size=size)), start_time_ns=t)
        return ev, SimpleNamespace(kernel_end=kernel_end)

    flat = [
        alloc(1, 64, 10, 20),  # workspace: freed at 15, inside its kernel (ends at 20)
        alloc(2, 32, 12, 20),  # output: freed at 30, after its kernel
        alloc(1, -64, 15, None),
        alloc(3, 16, 25, None),  # allocated outside any kernel (a resize_, a Python-level free)
        alloc(2, -32, 30, None),
        alloc(3, -16, 31, None),
    ]
    assert _kernel_scratch(flat, [1, 2, 1, 3, 2, 3]) == {1}


def test_residents_count_a_shared_storage_once_with_its_strongest_category():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    events = resident_events(
        [(emb.weight, Category.OPTSTATE, "emb"), (head.weight, Category.PARAMETER, "head")]
    )
    assert [(e.nbytes, e.category, e.module) for e in events] == [(10 * 4 * F32, Category.PARAMETER, "emb")]


def test_not_a_profile_is_a_one_line_error():
    with pytest.raises(ProfilerIngestError, match="not a finished torch.profiler.profile"):
        events_from_profiler(object())


def test_a_profile_without_memory_events_is_refused(lin):
    prof = profiled(lambda: lin(torch.randn(2, 8)), memory=False)
    with pytest.raises(ProfilerIngestError, match="profile_memory=True"):
        events_from_profiler(prof)


def test_allocation_ids_key_events_when_the_profiler_assigns_them(lin):
    x = torch.randn(4, 8)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        y = lin(x)
        del y
    alloc, free = events_from_profiler(prof)
    assert isinstance(alloc.key, int) and free.key == alloc.key and free.nbytes == -alloc.nbytes == -256


def test_the_optimizer_phase_follows_the_event_tree_not_only_time_stamps(lin, monkeypatch):
    # The momentum buffers SGD clones in its first step lie under its `step` frame in the profiler's tree; they are
    # the optimizer's even when no time-stamp span says so (as when the Optimizer.step# span and an allocation's
    # time stamp disagree on a loaded machine).
    from hyperdryrun.ingest import profiler as ingest

    x = torch.randn(4, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9, foreach=False)

    def step():
        lin(x).sum().backward()
        opt.step()

    monkeypatch.setattr(ingest, "_inside", lambda spans, t: False)
    events = events_from_profiler(profiled(step), module_names={id(lin): "lin"})
    opt_sizes = sorted(e.nbytes for e in events if e.nbytes > 0 and e.phase is Phase.OPTIMIZER)
    assert opt_sizes == [16 * F32, 16 * 8 * F32]
