"""Optimizer states from any optimizer object: containers (torchtitan's OptimizersContainer shape), dicts and lists
of optimizers, wrappers, state kept outside ``optimizer.state``; bytes worked out from the parameter shapes."""

from __future__ import annotations

import torch
from torch import nn

import hyperdryrun
from hyperdryrun.trace.optimizer_state import describe, state_tensors, warm_up

IN, HID = 64, 128
W = IN * HID * 4  # bytes of one fp32 weight (both are 64 x 128): a multiple of 512, so no rounding
PARAMS = 2 * W


def model_fn() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HID, bias=False), nn.ReLU(), nn.Linear(HID, IN, bias=False))


def layers(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    return list(model[0].parameters()), list(model[2].parameters())


class Container(torch.optim.Optimizer):
    """torchtitan 0.3.0 OptimizersContainer's shape: an Optimizer over all parameters whose own ``state`` stays
    empty; the states live in the inner optimizers it steps."""

    def __init__(self, model: nn.Module) -> None:
        first, second = layers(model)
        self.optimizers = [
            torch.optim.AdamW(first, lr=1e-3, foreach=True),
            torch.optim.AdamW(second, lr=1e-3),
        ]
        self.model_parts = [model]
        torch.optim.Optimizer.__init__(self, first + second, {})

    def step(self, closure=None):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


class Wrapper:
    """Not an Optimizer: holds one (and the model) and forwards step/zero_grad."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)


class AttributeMomentum(torch.optim.Optimizer):
    """Heavy-ball momentum whose buffers live in an attribute, not in ``self.state``."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})
        self.buffers: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        if not self.buffers:
            self.buffers = [torch.zeros_like(p) for p in params]
        for p, buf in zip(params, self.buffers):
            buf.mul_(0.9).add_(p.grad)
            p.sub_(buf, alpha=0.1)


def run(optimizer_fn, step_fn=None):
    """Simulate with an optimizer built from the model (``optimizer_fn(model)``)."""
    held = {}

    def build_model():
        held["model"] = model_fn()
        return held["model"]

    def loss_fn(model, x):
        return model(x).sum()

    trace = hyperdryrun.simulate(
        build_model,
        lambda i, device: torch.randn(16, IN, device=device),
        loss_fn=None if step_fn else loss_fn,
        step_fn=step_fn,
        optimizer_fn=lambda params: optimizer_fn(held["model"]),
        capture_stacks=False,
    )
    report = hyperdryrun.build_report(trace)
    return trace, report["summary"]["breakdown_after_step"]


def step_each(model, optimizers, batches):
    for x in batches:
        model(x).sum().backward()
    for opt in optimizers.values() if isinstance(optimizers, dict) else optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_plain_adamw_has_two_states_per_parameter():
    _, after = run(lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))
    assert (
        after["Optstate"] == 2 * PARAMS
    )  # exp_avg, exp_avg_sq; the host-side step scalar is not device memory


def test_container_states_live_in_its_inner_optimizers():
    trace, after = run(Container)
    assert after["Optstate"] == 2 * PARAMS
    owners = {b.module for b in trace.blocks if str(b.category) == "Optstate"}
    assert owners == {"0", "2"}  # each state is owned by the layer of its parameter
    assert not any("holds no device tensors" in x for x in trace.limitations)


def test_dict_of_optimizers():
    def build(model):
        first, second = layers(model)
        return {
            "adamw": torch.optim.AdamW(first, lr=1e-3),
            "sgd": torch.optim.SGD(second, lr=1e-2, momentum=0.9),
        }

    _, after = run(build, step_each)
    assert after["Optstate"] == 2 * W + W  # AdamW: exp_avg, exp_avg_sq; SGD: momentum_buffer


def test_list_of_optimizers():
    def build(model):
        first, second = layers(model)
        return [torch.optim.AdamW(first, lr=1e-3), torch.optim.Adam(second, lr=1e-3)]

    _, after = run(build, step_each)
    assert after["Optstate"] == 2 * PARAMS


def test_wrapper_that_holds_an_optimizer_and_the_model():
    def step(model, wrapper, batches):
        for x in batches:
            model(x).sum().backward()
        wrapper.step()
        wrapper.zero_grad()

    _, after = run(Wrapper, step)
    assert after["Optstate"] == 2 * PARAMS  # the model it holds (parameters, buffers) is not state


def test_state_kept_in_an_attribute():
    trace, after = run(lambda model: AttributeMomentum(model.parameters()))
    assert after["Optstate"] == PARAMS
    assert {b.module for b in trace.blocks if str(b.category) == "Optstate"} == {""}  # owner unknown


def test_stateless_optimizer_says_so():
    trace, after = run(lambda model: torch.optim.SGD(model.parameters(), lr=1e-2))
    assert after["Optstate"] == 0
    (line,) = [x for x in trace.limitations if "holds no device tensors" in x]
    assert line.startswith("the optimizer (SGD) holds no device tensors after the step")


def test_warm_up_steps_each_inner_optimizer_once_and_drops_gradients():
    model = model_fn()
    container = Container(model)
    warm_up(container)
    assert [int(opt.state[p]["step"]) for opt in container.optimizers for p in opt.state] == [1, 1]
    assert all(p.grad is None for p in model.parameters())
    optimizers = {
        "a": torch.optim.AdamW(layers(model)[0]),
        "b": torch.optim.SGD(layers(model)[1], momentum=0.9),
    }
    warm_up(optimizers)
    assert int(optimizers["a"].state[layers(model)[0][0]]["step"]) == 1
    assert "momentum_buffer" in optimizers["b"].state[layers(model)[1][0]]
    assert all(p.grad is None for p in model.parameters())


def test_state_tensors_leave_out_parameters_gradients_and_buffers():
    model = nn.Sequential(nn.Linear(IN, HID), nn.BatchNorm1d(HID))
    wrapper = Wrapper(model)
    warm_up(wrapper)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    found = [v for _, v in state_tensors(wrapper, model)]
    expected = [v for p in model.parameters() for k, v in wrapper.inner.state[p].items() if k != "step"]
    assert len(found) == len(expected) and all(any(f is e for e in expected) for f in found)
    assert describe(wrapper) == "Wrapper(AdamW)"
    assert describe(Container(model_fn())) == "Container(AdamW)"


class Unused(nn.Module):
    """model_fn's layers and a third (64 x 128, fp32) that forward never reaches: a module the batches skip."""

    def __init__(self) -> None:
        super().__init__()
        self.used = model_fn()
        self.skipped = nn.Linear(IN, HID, bias=False)

    def forward(self, x):
        return self.used(x)


def test_parameters_without_a_gradient_are_named_with_their_states_bytes():
    """AdamW skips a parameter whose grad is None, so a job whose steps never reach it never makes its states; the
    dry run counts them (the steady state of a job that trains every parameter) and says so, naming it."""
    trace = hyperdryrun.simulate(
        Unused,
        lambda i, device: torch.randn(16, IN, device=device),
        loss_fn=lambda model, x: model(x).sum(),
        optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
        capture_stacks=False,
    )
    said = [x for x in trace.limitations if x.startswith("no gradient in this step:")]
    assert len(said) == 1
    # the skipped weight's exp_avg and exp_avg_sq, fp32 like it: 2 x 64 x 128 x 4 B
    assert "1 parameter under skipped (skipped.weight)" in said[0] and f"({2 * W:,} B)" in said[0]
    assert hyperdryrun.build_report(trace)["summary"]["breakdown_after_step"]["Optstate"] == 3 * 2 * W


def test_a_step_that_reaches_every_parameter_says_nothing_of_gradients():
    trace, _ = run(lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert not any(x.startswith("no gradient in this step:") for x in trace.limitations)
