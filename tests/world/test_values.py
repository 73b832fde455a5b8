"""Data-dependent value rules: routing counts by hand, branch/size rules answer the fake mode, and an uncovered
data-dependent op stops the run with an error naming the op, the module and the rule to add."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from hyperdryrun.engine import SimulationError, simulate
from hyperdryrun.world.values import (
    ValueRule,
    ValueRuleError,
    ValueRules,
    active_rules,
    token_counts,
    use_rules,
)


def test_balanced_spreads_tokens_times_top_k_evenly_remainder_to_the_lowest_experts():
    # 10 tokens x top-2 = 20 over 8 experts: 2 each, 4 left over for experts 0-3.
    assert token_counts(ValueRule(handler="balanced"), 10, 8, 2) == [3, 3, 3, 3, 2, 2, 2, 2]


def test_hotspot_gives_the_hot_expert_skew_times_balanced_capped_at_one_per_token():
    # 64 tokens x 2 = 128 over 8: balanced 16; skew 2.5 -> 40 on expert 5, 88 over 7 others -> 13 x 3 + 12 x 4.
    rule = ValueRule(handler="hotspot", hot_expert=5, skew=2.5)
    assert token_counts(rule, 64, 8, 2) == [13, 13, 13, 13, 12, 40, 12, 12]
    # skew 100 would exceed the 64 tokens: a token picks an expert at most once.
    assert token_counts(ValueRule(handler="hotspot", skew=100), 64, 8, 2)[0] == 64


def test_explicit_counts_are_checked_against_tokens_and_experts():
    assert token_counts(ValueRule(handler="explicit", counts=[4, 0, 2, 2]), 4, 4, 2) == [4, 0, 2, 2]
    with pytest.raises(ValueRuleError, match="summing to tokens\\*top_k = 4\\*2 = 8"):
        token_counts(ValueRule(handler="explicit", counts=[4, 0, 2, 1]), 4, 4, 2)


def test_first_matching_rule_wins_by_module_and_op_pattern():
    rules = ValueRules(
        [
            ValueRule(module="layers.3.*", op="moe.token_counts", handler="hotspot", hot_expert=1, skew=2),
            ValueRule(module="*", op="moe.token_counts", handler="balanced"),
        ]
    )
    assert rules.token_counts("layers.3.moe.experts", 4, 4, 1) == [1, 2, 1, 0]
    assert rules.token_counts("layers.30.moe.experts", 4, 4, 1) == [1, 1, 1, 1]
    with pytest.raises(ValueRuleError, match="module 'x'.*values.rules"):
        ValueRules([]).token_counts("x", 4, 4, 1)


class Branchy(nn.Module):
    """Takes a data-dependent branch: a wide projection when the input sum is positive."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.Linear(16, 16, bias=False)
        self.wide = nn.Linear(16, 4096, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.wide(x).sum(-1, keepdim=True) * x
        return self.narrow(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Branchy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)


class Picky(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[torch.nonzero(x > 0)[:, 0]]


class PickyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16, bias=False)
        self.pick = Picky()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pick(self.lin(x))


def run(model_cls, rules: ValueRules | None):
    def step(model, optimizer, batches):
        for x in batches:
            if rules is None:
                model(x).pow(2).sum().backward()
            else:
                with use_rules(rules, root=model):
                    model(x).pow(2).sum().backward()
        optimizer.step()

    return simulate(
        model_cls,
        lambda i, d: torch.randn(64, 16, device=d),
        step_fn=step,
        target_device="cpu",
        capture_stacks=False,
    )


def branch_line() -> str:
    """``tests/world/test_values.py:<n>``: the ``if x.sum() > 0:`` line of Branchy.forward, found in the source."""
    lines, first = inspect.getsourcelines(Branchy.forward)
    n = first + next(i for i, text in enumerate(lines) if "if x.sum() > 0:" in text)
    return f"{os.path.relpath(__file__)}:{n}"


def test_an_uncovered_item_names_the_op_the_module_the_source_line_and_the_rule_to_add():
    with pytest.raises(SimulationError) as info:
        run(Model, ValueRules([]))
    msg = str(info.value)
    assert (
        "data-dependent op aten._local_scalar_dense.default (fake mode raised DataDependentOutputException) in module "
        f"'gate' at {branch_line()}: " in msg
    )
    assert "values.rules: [{module: 'gate', op: 'aten._local_scalar_dense.default', handler: branch" in msg
    assert "\n" not in msg
    assert active_rules() is None and _get_current_dispatch_mode_stack() == []


def test_a_branch_rule_selects_the_branch_and_changes_memory():
    taken = run(
        Model,
        ValueRules([ValueRule(module="gate", op="aten._local_scalar_dense*", handler="branch", value=True)]),
    )
    skipped = run(
        Model,
        ValueRules([ValueRule(module="gate", op="aten._local_scalar_dense*", handler="branch", value=False)]),
    )
    # the wide branch's output is 64 x 4096 fp32; the narrow branch never runs gate.wide.
    wide = 64 * 4096 * 4

    def wide_outputs(trace):
        return [
            b.requested
            for b in trace.blocks
            if b.module == "gate.wide" and b.op == "mm" and b.phase == "forward"
        ]

    assert wide_outputs(taken) == [wide]
    assert wide_outputs(skipped) == []
    assert [b.requested for b in skipped.blocks if b.module == "gate.narrow" and b.op == "mm"][
        0
    ] == 64 * 16 * 4
    assert taken.peak > skipped.peak


def test_an_uncovered_dynamic_shape_op_asks_for_a_size_rule_and_a_size_rule_sets_the_shape():
    with pytest.raises(
        SimulationError,
        match=r"aten.nonzero.default \(fake mode raised DynamicOutputShapeException\) in module 'pick'.*handler: size",
    ):
        run(PickyModel, ValueRules([]))
    trace = run(
        PickyModel, ValueRules([ValueRule(module="pick", op="aten.nonzero*", handler="size", value=40)])
    )
    picked = [b.requested for b in trace.blocks if b.module == "pick" and b.op == "index"]
    assert picked == [40 * 16 * 4]


def test_the_answering_mode_is_pushed_only_when_a_rule_answers_ops():
    with use_rules(ValueRules([ValueRule(op="moe.token_counts", handler="balanced")])):
        assert _get_current_dispatch_mode_stack() == []
    with use_rules(ValueRules([ValueRule(op="aten.nonzero*", handler="size", value=3)])):
        assert len(_get_current_dispatch_mode_stack()) == 1


def test_a_user_model_without_value_rules_stops_with_the_one_line_error():
    # simulate() with no rule at all: the `if tensor:` of a user model is named, not torch's bare exception
    with pytest.raises(SimulationError) as info:
        run(Model, None)
    assert isinstance(info.value.error, ValueRuleError)
    msg = str(info.value)
    assert (
        "aten._local_scalar_dense.default (fake mode raised DataDependentOutputException) in module 'gate' at "
        in msg
    )
    assert f" at {branch_line()}: " in msg and "values.rules: [{module: 'gate'" in msg and "\n" not in msg
    assert active_rules() is None and _get_current_dispatch_mode_stack() == []


def test_a_rule_that_matches_elsewhere_still_names_the_source_line():
    # a rule answering ops pushes the answering mode: the error comes from inside the dispatch, at the same line
    other = ValueRules(
        [ValueRule(module="nowhere", op="aten._local_scalar_dense*", handler="branch", value=True)]
    )
    with pytest.raises(SimulationError) as info:
        run(Model, other)
    assert f"in module 'gate' at {branch_line()}: " in str(info.value)


def test_rules_and_the_mode_are_undone_after_an_exception_in_the_body():
    env = dict(os.environ)
    branch = ValueRules([ValueRule(handler="branch", value=True)])
    with pytest.raises(RuntimeError, match="boom"), use_rules(branch):
        assert active_rules() is not None
        assert len(_get_current_dispatch_mode_stack()) == 1
        raise RuntimeError("boom")
    assert active_rules() is None
    assert _get_current_dispatch_mode_stack() == []
    assert dict(os.environ) == env


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"handler": "explicit"}, "handler 'explicit' needs counts"),
        ({"handler": "branch", "value": 1}, "handler 'branch' needs value: true or false"),
        ({"handler": "size", "value": -1}, "handler 'size' needs value: an output length >= 0"),
        ({"handler": "hotspot", "skew": 0.5}, "greater than or equal to 1"),
        ({"handler": "hotspot", "hot_expert": True}, "valid integer"),
        ({"handler": "size", "value": "40"}, "valid"),
    ],
)
def test_bad_rules_are_rejected_with_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ValueRule(**fields)
