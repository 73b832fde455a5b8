"""Value rules as data: what a data-dependent op gets in a dry run (see :mod:`hyperdryrun.world.values`), and MoE
routing counts. No torch: the job config validates rules without importing it; the dispatch mode that applies them
lives in :mod:`~hyperdryrun.world.values`, which re-exports these names.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hyperdryrun.bounds import MAX_HEADS, MAX_TOKENS

ROUTING_OP = "moe.token_counts"
"""The value point of MoE routing: tokens per expert of one rank's micro batch."""
ROUTING_HANDLERS = ("balanced", "hotspot", "explicit")


class ValueRuleError(RuntimeError):
    """A data-dependent value that no rule provides (or a rule that does not fit where it matched)."""


class ValueRule(BaseModel):
    """One rule: where it applies (``module``, ``op`` patterns) and how it gives the value (``handler``)."""

    # strict: a YAML `hot_expert: true` or `value: "40"` is a mistake, not 1 or 40
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    module: str = "*"
    op: str = "*"
    handler: Literal["balanced", "hotspot", "explicit", "branch", "value", "size"]
    hot_expert: int = Field(0, ge=0, le=MAX_HEADS)
    skew: float = Field(2.0, ge=1, le=MAX_TOKENS)
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


def _missing(op: str, module: str, example: str, what: str, raised: str = "", line: str = "") -> str:
    where = module or "<top level>"
    pattern = module or "*"
    by = f" (fake mode raised {raised})" if raised else ""
    at = f" at {line}" if line else ""
    return (
        f"data-dependent op {op}{by} in module {where!r}{at}: fake tensors have no values, so {what} cannot be "
        f"computed; add a value rule, e.g. values.rules: [{{module: '{pattern}', op: '{op}', {example}}}]"
    )
