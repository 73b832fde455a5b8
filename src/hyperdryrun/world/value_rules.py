"""Value rules as data: what a data-dependent op gets in a dry run (see :mod:`hyperdryrun.world.values`), and MoE
routing counts. No torch: the job config validates rules without importing it; the dispatch mode that applies them
lives in :mod:`~hyperdryrun.world.values`, which re-exports these names.
"""

from __future__ import annotations

import fnmatch
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hyperdryrun.bounds import MAX_HEADS, MAX_TOKENS

ROUTING_OP = "moe.token_counts"
"""The value point of MoE routing: tokens per expert of one rank's micro batch."""
ROUTING_HANDLERS = ("balanced", "hotspot", "explicit", "profile", "bound")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_of(module: str) -> int | None:
    """The decoder layer number in a module FQN (``layers.3.moe.experts``, ``model.layers.3.mlp.experts``)."""
    found = _LAYER.search(module)
    return None if found is None else int(found.group(1))


class ValueRuleError(RuntimeError):
    """A data-dependent value that no rule provides (or a rule that does not fit where it matched)."""


class ValueRule(BaseModel):
    """One rule: where it applies (``module``, ``op`` patterns) and how it gives the value (``handler``)."""

    # strict: a YAML `hot_expert: true` or `value: "40"` is a mistake, not 1 or 40
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    module: str = "*"
    op: str = "*"
    layer: int | None = Field(None, ge=0, le=MAX_HEADS)
    """Where set, the rule also needs the module to be in decoder layer ``layer`` (``layers.<layer>`` in its FQN)."""
    handler: Literal["balanced", "hotspot", "explicit", "profile", "bound", "branch", "value", "size"]
    hot_expert: int = Field(0, ge=0, le=MAX_HEADS)
    skew: float = Field(2.0, ge=1, le=MAX_TOKENS)
    """hotspot: the hot expert's tokens as a multiple of the balanced load (capped at one per token)."""
    counts: list[int] | None = None
    """explicit: tokens per expert of one rank's micro batch (sum = tokens x top_k)."""
    profile: list[float] | None = None
    """profile: a load per expert in any unit (a logged count, a fraction), scaled to the micro batch's tokens x
    top_k (:func:`scaled_profile`)."""
    capacity_factor: float | None = Field(None, ge=1, le=MAX_TOKENS)
    """bound: an expert takes at most ``capacity_factor`` x the balanced load (None: dropless, up to every token)."""
    value: bool | int | float | None = None
    """branch: the bool; value: the number; size: the output length."""

    @model_validator(mode="after")
    def _fields_of_handler(self) -> ValueRule:
        if self.handler == "explicit" and (not self.counts or any(c < 0 for c in self.counts)):
            raise ValueError(
                f"handler 'explicit' needs counts: a list of tokens per expert >= 0, got {self.counts}"
            )
        if self.handler == "profile" and (
            not self.profile or any(p < 0 for p in self.profile) or not sum(self.profile) > 0
        ):
            raise ValueError(
                f"handler 'profile' needs profile: a load per expert >= 0, not all 0, got {self.profile}"
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
        if self.layer is not None and layer_of(module) != self.layer:
            return False
        return fnmatch.fnmatchcase(module, self.module) and fnmatch.fnmatchcase(op, self.op)

    def describe(self) -> dict[str, Any]:
        """The rule as the report states it (only the fields its handler uses)."""
        keep = (
            {"module", "op", "handler"}
            | ({"layer"} if self.layer is not None else set())
            | {
                "hotspot": {"hot_expert", "skew"},
                "explicit": {"counts"},
                "profile": {"profile"},
                "bound": {"hot_expert", "capacity_factor"},
                "branch": {"value"},
                "value": {"value"},
                "size": {"value"},
            }.get(self.handler, set())
        )
        return self.model_dump(include=keep)


def token_counts(rule: ValueRule, num_tokens: int, num_experts: int, top_k: int) -> list[int]:
    """Tokens per expert for ``num_tokens`` tokens each routed to ``top_k`` distinct experts.

    balanced: ``num_tokens * top_k`` spread evenly (the remainder to the lowest experts); hotspot: the hot expert
    gets ``round(skew * balanced)`` (at most ``num_tokens``), the others share the rest evenly; explicit: as given;
    profile: the profile scaled to the total (:func:`scaled_profile`); bound: the most any expert parallel rank can
    receive (:func:`bound_counts`).
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
    if rule.handler == "profile":
        profile = list(rule.profile or [])
        if len(profile) != num_experts:
            raise ValueRuleError(
                f"routing profile {_short(profile)} has {len(profile)} entries, but the layer has {num_experts} "
                "experts (one per expert)"
            )
        return scaled_profile(profile, num_tokens, top_k)
    if rule.handler == "bound":
        if rule.hot_expert >= num_experts:
            raise ValueRuleError(
                f"routing rule hot_expert={rule.hot_expert} must be < num_experts={num_experts}"
            )
        return bound_counts(num_tokens, num_experts, top_k, rule.capacity_factor, rule.hot_expert)
    raise ValueRuleError(
        f"rule handler {rule.handler!r} does not give routing counts (use {', '.join(ROUTING_HANDLERS)})"
    )


def scaled_profile(profile: list[float], num_tokens: int, top_k: int) -> list[int]:
    """``profile`` (a load per expert, any unit) as integer tokens per expert adding up to ``num_tokens * top_k``,
    none above ``num_tokens`` (a token picks ``top_k`` distinct experts).

    Proportional: expert e gets ``lam * profile[e]``, ``lam`` set so that the total is right; an expert that would
    get more than ``num_tokens`` gets ``num_tokens`` and the others share the rest, again in proportion; experts with
    no load share what the loaded ones cannot take. Integers by largest remainder (ties: the lower expert). A
    profile that already adds up to the total with none above ``num_tokens`` (a measured step's counts) is
    returned as it is."""
    num_experts = len(profile)
    total = num_tokens * top_k
    if num_experts * num_tokens < total:
        raise ValueRuleError(f"top_k={top_k} is more than the {num_experts} experts of the routing profile")
    exact = [0.0] * num_experts
    capped: set[int] = set()
    while True:
        free = [e for e in range(num_experts) if e not in capped and profile[e] > 0]
        left = total - num_tokens * len(capped)
        weight = sum(profile[e] for e in free)
        over = [e for e in free if left * profile[e] > num_tokens * weight]
        if not over:
            break
        capped.update(over)
    for e in capped:
        exact[e] = float(num_tokens)
    if free:
        for e in free:
            exact[e] = left * profile[e] / weight
    else:  # every loaded expert is full: the experts with no load share the rest
        rest = [e for e in range(num_experts) if e not in capped]
        spread = _spread(left, rest, num_experts)
        for e in rest:
            exact[e] = float(spread[e])
    counts = [math.floor(x) for x in exact]
    short = total - sum(counts)
    for e in sorted(range(num_experts), key=lambda e: (-(exact[e] - counts[e]), e))[:short]:
        counts[e] += 1
    return counts


def bound_counts(
    num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None = None, first: int = 0
) -> list[int]:
    """The routing that sends the most tokens to the experts from ``first`` on (and so to the expert-parallel rank
    that holds them): each takes as many as the router lets it, in turn, until the ``num_tokens * top_k`` are
    placed. Dropless (``capacity_factor`` None): an expert takes at most every token, so the ``top_k`` experts from
    ``first`` get all of them (every token picks the same ``top_k``), the most any rank can receive whatever its
    experts per rank. With a capacity factor C: at most ``floor(C * balanced)`` each (and at least the balanced
    share rounded up, so that the tokens fit), which is what a token-dropping router lets through."""
    total = num_tokens * top_k
    if num_experts * num_tokens < total:
        raise ValueRuleError(f"top_k={top_k} is more than num_experts={num_experts}")
    cap = num_tokens
    if capacity_factor is not None:
        cap = min(
            num_tokens, max(math.ceil(total / num_experts), math.floor(capacity_factor * total / num_experts))
        )
    counts = [0] * num_experts
    left = total
    for i in range(num_experts):
        e = (first + i) % num_experts
        counts[e] = min(cap, left)
        left -= counts[e]
    return counts


def _short(values: list[Any]) -> str:
    text = str(values)
    return text if len(text) <= 60 else text[:57] + "...]"


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


def _missing(op: str, module: str, example: str, what: str, raised: str = "", line: str = "") -> str:
    where = module or "<top level>"
    pattern = module or "*"
    by = f" (fake mode raised {raised})" if raised else ""
    at = f" at {line}" if line else ""
    return (
        f"data-dependent op {op}{by} in module {where!r}{at}: fake tensors have no values, so {what} cannot be "
        f"computed; add a value rule, e.g. values.rules: [{{module: '{pattern}', op: '{op}', {example}}}]"
    )
