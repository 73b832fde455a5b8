"""torch.compile in a simulated world: no compiled kernel runs on fake data, compiled regions run eagerly and are
named in a limitation line, and every global this touches is restored (also after an exception)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.eval_frame as eval_frame
import torch.nn.attention.flex_attention as flex_module
from torch import nn
from torch._ops import _higher_order_ops
from torch._subclasses.fake_tensor import FakeTensorMode

import hyperdryrun
from hyperdryrun.world import SimulatedWorld

DIM = 64
BACKEND_CALLS: list[str] = []


def recording_backend(gm, example_inputs):
    """A compiler backend that would run the graph: in a dry run it must never be reached."""
    BACKEND_CALLS.append(str(gm))
    return gm.forward


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w1) @ w2


compiled_mlp = torch.compile(mlp, backend=recording_backend)


class Model(nn.Module):
    def __init__(self, compiled: bool) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(DIM, 4 * DIM))
        self.w2 = nn.Parameter(torch.empty(4 * DIM, DIM))
        self.fn = compiled_mlp if compiled else mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.w1, self.w2)


def simulate(model_fn, loss_fn=lambda model, x: model(x).sum()):
    return hyperdryrun.simulate(
        model_fn, lambda i, device: torch.randn(8, DIM, device=device), loss_fn=loss_fn, capture_stacks=False
    )


def test_compiled_region_runs_eagerly_with_the_eager_bytes_and_a_limitation():
    BACKEND_CALLS.clear()
    eager, compiled = simulate(lambda: Model(False)), simulate(lambda: Model(True))
    assert BACKEND_CALLS == []  # the backend (Inductor's place) never saw the fake tensors
    assert [(b.op, b.size, b.start, b.end) for b in compiled.blocks] == [
        (b.op, b.size, b.start, b.end) for b in eager.blocks
    ]
    assert compiled.peak == eager.peak
    (line,) = [x for x in compiled.limitations if x.startswith("torch.compile regions ran eagerly")]
    assert f"{__name__}.mlp" in line
    assert not any(x.startswith("torch.compile regions") for x in eager.limitations)
    compiled_mlp(torch.randn(2, DIM), torch.randn(DIM, 4 * DIM), torch.randn(4 * DIM, DIM))
    assert BACKEND_CALLS  # control: outside a dry run the same call reaches the backend


def test_compiled_module_is_named_by_its_class():
    def model_fn():
        model = Model(False)
        model.compile(backend=recording_backend, fullgraph=True)
        return model

    BACKEND_CALLS.clear()
    trace = simulate(model_fn)
    assert BACKEND_CALLS == []
    assert any("Model module" in x for x in trace.limitations)


def _globals() -> dict:
    return {
        "stance": eval_frame._stance,
        "callback_from_stance": eval_frame._callback_from_stance,
        "flex": {
            name: getattr(flex_module, name)
            for name in (
                "flex_attention_hop",
                "create_mask",
                "_convert_mask_to_block_mask",
                "_create_sparse_block_from_block_mask",
                "_validate_device",
                "_warn_once",
            )
        },
        "hop_rules": {name: dict(hop.python_key_table) for name, hop in _higher_order_ops.items()},
    }


def test_world_gives_hops_the_fake_mode_rule_and_takes_it_back():
    from torch._higher_order_ops.flex_attention import flex_attention

    before = _globals()
    with SimulatedWorld(world_size=2, rank=1) as world:
        mode_class = type(world.fake_mode)
        assert mode_class is not FakeTensorMode
        assert flex_attention.python_key_table[mode_class] is flex_attention.python_key_table[FakeTensorMode]
        assert eval_frame._stance.stance == "force_eager"
    assert _globals() == before


@pytest.mark.parametrize("fails", [False, True])
def test_simulation_restores_the_compiler_and_flex_globals(fails):
    before = _globals()

    def loss_fn(model, x):
        if fails:
            raise RuntimeError("boom")
        return model(x).sum()

    if fails:
        with pytest.raises(hyperdryrun.SimulationError, match="boom"):
            simulate(lambda: Model(True), loss_fn)
    else:
        simulate(lambda: Model(True), loss_fn)
    assert _globals() == before
