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
import os
import sys
import traceback
from collections.abc import Iterable, Iterator
from types import FrameType

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
from torch.utils._python_dispatch import TorchDispatchMode

from hyperdryrun.ingest.files import user_file
from hyperdryrun.trace.tracker import active_tracker
from hyperdryrun.world.value_rules import (  # noqa: F401  (re-exported: the rules are part of this module's API)
    ROUTING_HANDLERS,
    ROUTING_OP,
    ValueRule,
    ValueRuleError,
    ValueRules,
    _missing,
    _spread,
    token_counts,
)

_SCALAR = torch.ops.aten._local_scalar_dense.default
_SIZED = {torch.ops.aten.nonzero.default: "nonzero", torch.ops.aten.masked_select.default: "masked_select"}


_active: ValueRules | None = None


def active_rules() -> ValueRules | None:
    """The rules of the running simulation (None outside :func:`use_rules`)."""
    return _active


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

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Dynamo compiles under it (torch 2.11 to 2.14 skip compiling under any other dispatch mode): it only
        answers data-dependent values, which a compiled region's graph ops reach it for when they run."""
        return True

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
