"""RoleMarker: which tensors it reports as parameters, buffers, gradients and optimizer states, and when, on a real
two-layer model whose tensors are known by construction; its hooks are gone afterwards, also after a failure."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

from hyperdryrun.trace.blocks import Category
from hyperdryrun.trace.roles import RoleMarker


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2, bias=False)
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) * self.scale


class Recorder:
    """A ``mark`` callback: (storage pointer, category) in call order, and the moment it was called in."""

    def __init__(self) -> None:
        self.moment = "forward"
        self.calls: list[tuple[str, int, Category]] = []

    def __call__(self, tensor: torch.Tensor, category: Category) -> None:
        self.calls.append((self.moment, tensor.untyped_storage().data_ptr(), category))

    def marked(self, category: Category, moment: str | None = None) -> set[int]:
        return {p for m, p, c in self.calls if c is category and moment in (None, m)}


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def global_hooks() -> tuple[int, int, int, int]:
    return (
        len(nn_module._global_forward_pre_hooks),
        len(nn_module._global_forward_hooks),
        len(optim_module._global_optimizer_pre_hooks),
        len(optim_module._global_optimizer_post_hooks),
    )


def one_step(net: Net, opt: torch.optim.Optimizer, rec: Recorder, roles: RoleMarker) -> None:
    with roles.hooked():
        rec.moment = "forward"
        loss = net(torch.ones(5, 4)).sum()
        rec.moment = "backward"
        loss.backward()
        rec.moment = "optimizer"
        opt.step()
        rec.moment = "after"


def test_parameters_buffers_gradients_and_states_are_marked_when_they_become_known():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), foreach=True)
    rec = Recorder()
    roles = RoleMarker(rec)
    one_step(net, opt, rec, roles)
    params = [net.a.weight, net.a.bias, net.b.weight]
    assert rec.marked(Category.PARAMETER, "forward") == {ptr(p) for p in params}
    assert rec.marked(Category.BUFFER, "forward") == {ptr(net.scale)}
    assert rec.marked(Category.PARAMETER, "backward") == set()
    # On accumulation, during backward, and again as the optimizer starts.
    assert rec.marked(Category.GRADIENT, "forward") == set()
    assert rec.marked(Category.GRADIENT, "backward") == {ptr(p.grad) for p in params}
    assert rec.marked(Category.GRADIENT, "optimizer") == {ptr(p.grad) for p in params}
    # AdamW keeps exp_avg and exp_avg_sq per parameter; its foreach "step" counter is a host scalar, not device state.
    states = {ptr(opt.state[p][k]) for p in params for k in ("exp_avg", "exp_avg_sq")}
    assert rec.marked(Category.OPTSTATE) == states
    assert all(ptr(opt.state[p]["step"]) not in rec.marked(Category.OPTSTATE) for p in params)


def test_without_gradients_on_accumulation_a_gradient_dropped_before_the_optimizer_is_never_marked():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for on in (True, False):
        rec = Recorder()
        roles = RoleMarker(rec, gradients_on_accumulation=on)
        with roles.hooked():
            net(torch.ones(5, 4)).sum().backward()
            dropped = ptr(net.a.bias.grad)
            net.a.bias.grad = None  # freed before the optimizer runs, as FSDP2 frees its unsharded gradients
            opt.step()
        assert (dropped in rec.marked(Category.GRADIENT)) is on
        # The gradients the optimizer reads are marked either way.
        assert {ptr(net.a.weight.grad), ptr(net.b.weight.grad)} <= rec.marked(Category.GRADIENT)
        opt.zero_grad(set_to_none=True)


def test_step_done_marks_gradients_a_step_kept():
    net = Net()
    rec = Recorder()
    RoleMarker(rec).step_done(net)
    assert rec.calls == []
    net(torch.ones(1, 4)).sum().backward()
    RoleMarker(rec).step_done(net)
    assert rec.marked(Category.GRADIENT) == {ptr(p.grad) for p in net.parameters()}


def test_every_hook_is_removed_on_exit_also_after_a_failure():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    before = global_hooks()
    rec = Recorder()
    roles = RoleMarker(rec)
    with pytest.raises(RuntimeError, match="boom"), roles.hooked():
        assert global_hooks() == tuple(n + 1 for n in before)
        net(torch.ones(5, 4)).sum().backward()
        raise RuntimeError("boom")
    assert global_hooks() == before
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())
    rec.calls.clear()
    net(torch.ones(5, 4)).sum().backward()
    opt.step()
    assert rec.calls == []


def test_a_fused_optimizers_step_counter_is_device_state():
    # torch 2.13 fused AdamW keeps state["step"] on the parameters' device (a 0-dim tensor the kernel updates).
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), fused=True)
    rec = Recorder()
    one_step(net, opt, rec, RoleMarker(rec))
    params = list(net.parameters())
    keys = ("exp_avg", "exp_avg_sq", "step")
    assert rec.marked(Category.OPTSTATE) == {ptr(opt.state[p][k]) for p in params for k in keys}
