"""Data-dependent values: explicit, configurable rules for what fake tensors cannot compute.

Fake tensors have shapes but no values, so ``.item()``, ``.tolist()``, ``if tensor:``, ops whose output shape
depends on values (``nonzero``) and MoE token counts per expert cannot be computed. Each such value comes from a
:class:`ValueRule` matched by module FQN and op name (``fnmatch`` patterns, first match wins):

- MoE routing (op ``moe.token_counts``, asked for by expert-parallel token dispatch): ``balanced``, ``hotspot``
  (one expert gets ``skew`` times the balanced load) or ``explicit`` per-expert counts;
- ``branch`` (a bool) and ``value`` (a number) for ``aten._local_scalar_dense`` (``.item()``, ``.tolist()``,
  ``bool(t)``);
- ``size`` (the output length) for ``aten.nonzero`` and ``aten.masked_select``.

An op that no rule covers stops the run with :class:`ValueRuleError` naming the op, the module and the rule to add.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import sys
import traceback
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
from torch.utils._python_dispatch import TorchDispatchMode

from hyperdryrun.ingest.files import user_file
from hyperdryrun.trace.tracker import active_tracker

ROUTING_OP = "moe.token_counts"
"""The value point of MoE routing: tokens per expert of one rank's micro batch."""
ROUTING_HANDLERS = ("balanced", "hotspot", "explicit")
_SCALAR = torch.ops.aten._local_scalar_dense.default
_SIZED = {torch.ops.aten.nonzero.default: "nonzero", torch.ops.aten.masked_select.default: "masked_select"}


class ValueRuleError(RuntimeError):
    """A data-dependent value that no rule provides (or a rule that does not fit where it matched)."""


class ValueRule(BaseModel):
    """One rule: where it applies (``module``, ``op`` patterns) and how it gives the value (``handler``)."""

    # strict: a YAML `hot_expert: true` or `value: "40"` is a mistake, not 1 or 40
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    module: str = "*"
    op: str = "*"
    handler: Literal["balanced", "hotspot", "explicit", "branch", "value", "size"]
    hot_expert: int = Field(0, ge=0)
    skew: float = Field(2.0, ge=1)
    """hotspot: the hot expert's tokens as a multiple of the balanced load (capped at one per token)."""
    counts: list[int] | None = None
    """explicit: tokens per expert of one rank's micro batch (sum = tokens x top_k)."""
    value: bool | int | float | None = None
    """branch: the bool; value: the number; size: the output length."""

    @model_validator(mode="after")
    def _fields_of_handler(self) -> ValueRule:
        if self.handler == "explicit" and (not self.counts or any(c < 0 for c in self.counts)):
            raise ValueError(
                f"handler 'explicit' needs counts: a list of tokens per expert >= 0, got {self.counts}"
            )
        if self.handler == "branch" and not isinstance(self.value, bool):
            raise ValueError(f"handler 'branch' needs value: true or false, got {self.value!r}")
        if self.handler == "value" and (self.value is None or isinstance(self.value, bool)):
            raise ValueError(f"handler 'value' needs a numeric value, got {self.value!r}")
        if self.handler == "size" and (
            not isinstance(self.value, int) or isinstance(self.value, bool) or self.value < 0
        ):
            raise ValueError(f"handler 'size' needs value: an output length >= 0, got {self.value!r}")
        return self

    def matches(self, module: str, op: str) -> bool:
        return fnmatch.fnmatchcase(module, self.module) and fnmatch.fnmatchcase(op, self.op)

    def describe(self) -> dict[str, Any]:
        """The rule as the report states it (only the fields its handler uses)."""
        keep = {"module", "op", "handler"} | {
            "hotspot": {"hot_expert", "skew"},
            "explicit": {"counts"},
            "branch": {"value"},
            "value": {"value"},
            "size": {"value"},
        }.get(self.handler, set())
        return self.model_dump(include=keep)


def token_counts(rule: ValueRule, num_tokens: int, num_experts: int, top_k: int) -> list[int]:
    """Tokens per expert for ``num_tokens`` tokens each routed to ``top_k`` distinct experts.

    balanced: ``num_tokens * top_k`` spread evenly (the remainder to the lowest experts); hotspot: the hot expert
    gets ``round(skew * balanced)`` (at most ``num_tokens``), the others share the rest evenly; explicit: as given.
    """
    total = num_tokens * top_k
    if rule.handler == "explicit":
        counts = list(rule.counts or [])
        if len(counts) != num_experts or sum(counts) != total or max(counts) > num_tokens:
            raise ValueRuleError(
                f"routing rule counts={counts} must have {num_experts} entries (one per expert) summing to "
                f"tokens*top_k = {num_tokens}*{top_k} = {total}, each <= {num_tokens}"
            )
        return counts
    if rule.handler == "balanced":
        return _spread(total, list(range(num_experts)), num_experts)
    if rule.handler == "hotspot":
        if rule.hot_expert >= num_experts:
            raise ValueRuleError(
                f"routing rule hot_expert={rule.hot_expert} must be < num_experts={num_experts}"
            )
        hot = min(num_tokens, round(rule.skew * total / num_experts))
        others = [e for e in range(num_experts) if e != rule.hot_expert]
        if total - hot > num_tokens * len(others):
            hot = total - num_tokens * len(others)
        counts = _spread(total - hot, others, num_experts)
        counts[rule.hot_expert] = hot
        return counts
    raise ValueRuleError(
        f"rule handler {rule.handler!r} does not give routing counts (use {', '.join(ROUTING_HANDLERS)})"
    )


def _spread(total: int, experts: list[int], num_experts: int) -> list[int]:
    counts = [0] * num_experts
    if not experts:
        return counts
    base, extra = divmod(total, len(experts))
    for i, e in enumerate(experts):
        counts[e] = base + (1 if i < extra else 0)
    return counts


class ValueRules:
    """An ordered rule list; :meth:`lookup` returns the first rule matching a module and an op."""

    def __init__(self, rules: list[ValueRule]) -> None:
        self.rules = list(rules)

    def lookup(self, module: str, op: str) -> ValueRule | None:
        return next((r for r in self.rules if r.matches(module, op)), None)

    def token_counts(self, module: str, num_tokens: int, num_experts: int, top_k: int) -> list[int]:
        """Per-expert token counts of ``module``'s routing on one rank (the ``moe.token_counts`` value point)."""
        rule = self.lookup(module, ROUTING_OP)
        if rule is None:
            raise ValueRuleError(_missing(ROUTING_OP, module, "handler: balanced", "tokens per expert"))
        return token_counts(rule, num_tokens, num_experts, top_k)


_active: ValueRules | None = None


def active_rules() -> ValueRules | None:
    """The rules of the running simulation (None outside :func:`use_rules`)."""
    return _active


def _missing(op: str, module: str, example: str, what: str, raised: str = "", line: str = "") -> str:
    where = module or "<top level>"
    pattern = module or "*"
    by = f" (fake mode raised {raised})" if raised else ""
    at = f" at {line}" if line else ""
    return (
        f"data-dependent op {op}{by} in module {where!r}{at}: fake tensors have no values, so {what} cannot be "
        f"computed; add a value rule, e.g. values.rules: [{{module: '{pattern}', op: '{op}', {example}}}]"
    )


def _source_line(frames: Iterable[tuple[FrameType, int]]) -> str:
    """``file:line`` of the innermost user-code frame of ``frames`` (outermost first), the file relative to the
    working directory when under it; ``""`` when none is user code."""
    found = ""
    for frame, lineno in frames:
        name = frame.f_code.co_filename
        if user_file(name):
            rel = os.path.relpath(name) if os.path.isabs(name) else name
            found = f"{name if rel.startswith('..') else rel}:{lineno}"
    return found


def _raise_site() -> str:
    """:func:`_source_line` of the Python stack at this call (a dispatch mode runs inside the op's caller)."""
    return _source_line(reversed(list(traceback.walk_stack(sys._getframe(1)))))


def _current_module() -> str:
    tracker = active_tracker()
    return tracker.module() if tracker is not None else ""


def _raising_module(err: BaseException, root: torch.nn.Module | None) -> str:
    """FQN under ``root`` of the innermost module whose ``forward`` is on the traceback of ``err``."""
    if root is None:
        return ""
    from hyperdryrun.trace.tensors import clean_fqn

    names = {id(m): name for name, m in root.named_modules()}
    found = ""
    tb = err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if tb.tb_frame.f_code.co_name == "forward" and id(owner) in names:
            found = clean_fqn(names[id(owner)])
        tb = tb.tb_next
    return found


class ValueRuleMode(TorchDispatchMode):
    """Answers data-dependent ops on fake tensors from the rules; any other data-dependent failure of the fake
    mode below becomes a :class:`ValueRuleError` naming the op, the module and the rule to add."""

    def __init__(self, rules: ValueRules) -> None:
        super().__init__()
        self.rules = rules

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            # The fake mode knows some values (constants such as an optimizer's step count): they win.
            return func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as err:
            module, op = _current_module(), str(func)
            rule = self.rules.lookup(module, op)
            if func is _SCALAR and rule is not None and rule.handler in ("branch", "value"):
                return rule.value
            if func in _SIZED and rule is not None and rule.handler == "size":
                x = args[0]
                shape = (rule.value, x.dim()) if _SIZED[func] == "nonzero" else (rule.value,)
                dtype = torch.long if _SIZED[func] == "nonzero" else x.dtype
                return torch.empty(shape, dtype=dtype, device=x.device)
            raise ValueRuleError(_uncovered(err, module, _raise_site())) from None


def _uncovered(
    err: DataDependentOutputException | DynamicOutputShapeException, module: str, line: str = ""
) -> str:
    """The one-line error for a data-dependent op that no rule answers: the op, the module, the user's source line
    that asked for the value, and the rule to add."""
    func = err.func
    if func is _SCALAR:
        example, what = "handler: branch, value: true", "the value of .item(), .tolist() or bool()"
    elif isinstance(err, DynamicOutputShapeException):
        example, what = "handler: size, value: <output length>", "its output shape"
    else:
        example, what = "handler: value, value: <number>", "its result"
    return _missing(str(func), module, example, what, type(err).__name__, line)


@contextlib.contextmanager
def data_dependent_errors(root: torch.nn.Module | None = None) -> Iterator[None]:
    """Turn the fake mode's data-dependent failures in the body into one-line :class:`ValueRuleError` naming the
    op, the module (the innermost ``forward`` of ``root`` on the traceback), the user's source line and the rule to
    add. What :func:`hyperdryrun.engine.simulate` runs a step under when no rules are given."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as err:
        line = _source_line(traceback.walk_tb(err.__traceback__))
        raise ValueRuleError(_uncovered(err, _raising_module(err, root), line)) from None


@contextlib.contextmanager
def use_rules(rules: ValueRules, root: torch.nn.Module | None = None) -> Iterator[ValueRules]:
    """Make ``rules`` the active rules for the body and turn the fake mode's data-dependent failures into
    :class:`ValueRuleError` (restored on exit, also after an exception). Enter it inside the fake mode.

    The dispatch mode that answers ``.item()`` and ``nonzero`` is pushed only when a rule needs it: any Python
    dispatch mode turns off DTensor's C++ fast path, which triples the time of a step. ``root``: the model whose
    module names the error gives (found in the traceback, since module hooks have run by the time it is caught)."""
    global _active
    saved = _active
    _active = rules
    answers = any(r.handler in ("branch", "value", "size") for r in rules.rules)
    try:
        with data_dependent_errors(root), ValueRuleMode(rules) if answers else contextlib.nullcontext():
            yield rules
    finally:
        _active = saved
