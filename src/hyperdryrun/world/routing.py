"""The MoE routing of a dry run, one option for every front door (``run`` of the built-in and Hugging Face MoE
models, ``script``, ``torchtitan``, ``fit``): what tokens per expert each routed layer's ``moe.token_counts`` value
point gets (:mod:`hyperdryrun.world.value_rules`). No torch.

- ``balanced`` (the default): ``tokens x top_k`` spread evenly over the experts;
- ``hotspot`` (``--skew S``, ``--hot-expert E``): in every routed layer expert E gets ``round(S x balanced)``
  tokens (at most one per token), the other experts share the rest evenly;
- ``explicit`` (``--routing-counts``): one count list for every routed layer, adding up to ``tokens x top_k``;
- ``profile`` (``--routing-from FILE``): per-layer loads from a file (:func:`load_routing_file`), each scaled to the
  step's ``tokens x top_k``; layers the file does not name route balanced;
- ``bound`` (``--routing bound``, ``--capacity-factor C``): the most the job's router can send one expert-parallel
  rank (:func:`~hyperdryrun.world.value_rules.bound_counts`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hyperdryrun.bounds import MAX_HEADS, MAX_TOKENS
from hyperdryrun.world.value_rules import ROUTING_OP, ValueRule, layer_of

Routing = Literal["balanced", "hotspot", "explicit", "profile", "bound"]
IMPLIED = (
    ("routing_from", "profile"),
    ("counts", "explicit"),
    ("capacity_factor", "bound"),
    ("skew", "hotspot"),
)
"""A field given without ``routing`` chooses it (``--skew 2`` alone is ``--routing hotspot --skew 2``)."""
USES = {"hot_expert": ("hotspot", "bound"), "skew": ("hotspot",), "counts": ("explicit",),
        "capacity_factor": ("bound",), "routing_from": ("profile",)}  # fmt: skip
"""The routings each field is for."""
SKEW_TABLE = (1.0, 1.5, 2.0, 4.0)
"""The skews of ``--skew-table``."""


class RoutingFileError(ValueError):
    """A ``--routing-from`` file that is not one of the documented forms (one line naming the path)."""


class RoutingSpec(BaseModel):
    """The routing option (see the module docstring); the ``values`` section of a job config holds these fields."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)

    routing: Routing = "balanced"
    """Tokens per expert of every routed layer: even, one hot expert, given counts, a file's loads, the bound."""
    hot_expert: int = Field(0, ge=0, le=MAX_HEADS)
    """hotspot: the busiest expert; bound: the first of the experts that take the most."""
    skew: float = Field(2.0, ge=1, le=MAX_TOKENS)
    """hotspot: the hot expert's load as a multiple of the balanced load."""
    counts: list[int] | None = None
    """explicit: tokens per expert of one rank's micro batch (sum = micro_batch_size * seq_len * top_k)."""
    capacity_factor: float | None = Field(None, ge=1, le=MAX_TOKENS)
    """bound: the router's capacity factor (an expert takes at most C x the balanced load); None: dropless."""
    routing_from: str | None = None
    """profile: the file of per-layer loads (:func:`load_routing_file`)."""

    @model_validator(mode="before")
    @classmethod
    def _implied_routing(cls, data: Any) -> Any:
        if isinstance(data, dict) and "routing" not in data:
            for field, routing in IMPLIED:
                if data.get(field) is not None:
                    return {**data, "routing": routing}
        return data

    @model_validator(mode="after")
    def _routing_fields(self) -> RoutingSpec:
        if self.routing == "explicit" and not self.counts:
            raise ValueError("values.routing='explicit' needs values.counts (tokens per expert)")
        if self.counts is not None and any(c < 0 for c in self.counts):
            raise ValueError(f"values.counts={self.counts} must all be >= 0")
        if self.routing == "profile":
            if not self.routing_from:
                raise ValueError(
                    "values.routing='profile' needs values.routing_from (a file of per-expert loads)"
                )
            load_routing_file(self.routing_from)
        return self

    def ignored(self) -> dict[str, str]:
        """The fields given (or not at their default) that this routing does not use, each with why."""
        out = {}
        for name, routings in USES.items():
            given = (
                name in self.model_fields_set or getattr(self, name) != type(self).model_fields[name].default
            )
            if given and self.routing not in routings:
                out[name] = (
                    f"has no effect with values.routing={self.routing!r} (it is for values.routing: "
                    f"{' or '.join(routings)} / --routing {routings[0]})"
                )
        return out

    def routing_rules(self) -> list[ValueRule]:
        """The ``moe.token_counts`` rules of this routing, tried in order (the last matches every routed layer)."""
        if self.routing == "profile":
            assert self.routing_from is not None
            return [
                *profile_rules(load_routing_file(self.routing_from)),
                ValueRule(op=ROUTING_OP, handler="balanced"),
            ]
        return [
            ValueRule(
                op=ROUTING_OP, handler=self.routing, hot_expert=self.hot_expert, skew=self.skew,
                counts=self.counts, capacity_factor=self.capacity_factor,
            )
        ]  # fmt: skip

    def routing_rule(self) -> ValueRule:
        """The rule of every routed layer that no file entry names (the scenario the report states)."""
        return self.routing_rules()[-1]

    def describe(self) -> str:
        """One line: the routing a dry run (and a fit's verdicts) assume."""
        if self.routing == "hotspot":
            return (
                f"skew {self.skew:g}: in every routed layer expert {self.hot_expert} gets {self.skew:g}x the balanced "
                "load, the others share the rest"
            )
        if self.routing == "explicit":
            return f"explicit: tokens per expert {self.counts} in every routed layer"
        if self.routing == "profile":
            assert self.routing_from is not None
            named = sorted(load_routing_file(self.routing_from), key=str)
            return (
                f"from {self.routing_from}: {', '.join(_key_name(k) for k in named)} as the file's loads (scaled to "
                "the step's tokens x top_k), balanced elsewhere"
            )
        if self.routing == "bound":
            if self.capacity_factor is None:
                return (
                    f"bound, dropless: every token to the same top_k experts from expert {self.hot_expert} (the most "
                    "an expert-parallel rank can receive)"
                )
            return (
                f"bound, capacity factor {self.capacity_factor:g}: experts from {self.hot_expert} on take "
                f"{self.capacity_factor:g}x the balanced load each (the most a token-dropping router lets through)"
            )
        return "balanced: every expert gets tokens x top_k / experts (a router at step 1; see docs/MOE.md)"


def skew_spec(skew: float, hot_expert: int = 0) -> RoutingSpec:
    """The routing of ``--skew-table``'s point ``skew``."""
    return RoutingSpec(routing="hotspot", skew=skew, hot_expert=hot_expert)


def _key_name(key: int | str) -> str:
    return f"layer {key}" if isinstance(key, int) else repr(key)


def profile_rules(loads: dict[int | str, list[float]]) -> list[ValueRule]:
    """One ``profile`` rule per file entry: by decoder layer number, or by module pattern where the key names no
    layer."""
    out = []
    for key, load in sorted(loads.items(), key=lambda kv: str(kv[0])):
        where = {"layer": key} if isinstance(key, int) else {"module": key}
        out.append(ValueRule(op=ROUTING_OP, handler="profile", profile=list(load), **where))
    return out


def _numbers(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in value)
        and sum(value) > 0
    )


def load_routing_file(path: str) -> dict[int | str, list[float]]:
    """The per-layer expert loads of a ``--routing-from`` file, by decoder layer number (or module pattern):

    - a ``--measure`` report of a torchtitan MoE job (``metadata.torchtitan.routing``: each routed-experts module's
      per-expert token counts of the measured step);
    - a JSON object of per-expert loads by module name or layer number: ``{"layers.1.moe.tokens_per_expert_E": [..],
      "3": [..]}`` (torchtitan's ``tokens_per_expert_E`` buffers as ``named_buffers()`` gives them, HF's router
      counts by ``model.layers.N...``): a key with ``layers.<N>`` in it is decoder layer N, a number is the layer;
    - a JSON list with one entry per decoder layer, ``null`` for a layer without routed experts;
    - a JSON list of numbers: the same loads for every routed layer.

    Loads are in any unit (token counts of a step, of many steps summed, fractions): each is scaled to the step's
    ``tokens x top_k``. Raises :class:`RoutingFileError` naming the path."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise RoutingFileError(
            f"values.routing_from: not a readable JSON file ({type(err).__name__}: {err}) (got {path!r})"
        ) from None
    form = (
        "a --measure report, an object of per-expert loads by module name or layer number, a list with one entry "
        "per decoder layer (null where none), or one list of loads for every layer; see docs/MOE.md"
    )
    if isinstance(data, dict) and isinstance(data.get("metadata"), dict):  # a report
        record = (data["metadata"].get("torchtitan") or {}).get("routing")
        if not isinstance(record, dict) or not record:
            raise RoutingFileError(
                "values.routing_from: the report holds no measured MoE routing (metadata.torchtitan.routing of a "
                f"--measure report of a MoE job) (got {path!r})"
            )
        data = {name: _one_call(name, calls, path) for name, calls in record.items()}
    out: dict[int | str, list[float]] = {}
    if _numbers(data):
        return {"*": list(data)}
    if isinstance(data, list) and data:
        for i, load in enumerate(data):
            if load is None or load == []:
                continue
            if not _numbers(load):
                raise RoutingFileError(
                    f"values.routing_from: entry {i} (layer {i}) is not a list of loads >= 0, not all 0 "
                    f"(got {str(load)[:60]}) in {path!r}"
                )
            out[i] = list(load)
    elif isinstance(data, dict) and data:
        for name, load in data.items():
            key: int | str = (
                int(name) if name.isdigit() else (layer_of(name) if layer_of(name) is not None else name)
            )
            if not _numbers(load):
                raise RoutingFileError(
                    f"values.routing_from: {name!r} is not a list of loads >= 0, not all 0 (got {str(load)[:60]}) "
                    f"in {path!r}"
                )
            if key in out:
                raise RoutingFileError(
                    f"values.routing_from: layer {key} is given twice (at {name!r}) in {path!r}"
                )
            out[key] = list(load)
    if not out:
        raise RoutingFileError(f"values.routing_from: expected {form} (got {str(data)[:60]!r} in {path!r})")
    return out


def _one_call(name: str, calls: Any, path: str) -> Any:
    """A measured module's count list: its calls (forward, a recompute) must have routed alike."""
    if not isinstance(calls, list) or not calls or not all(isinstance(c, list) for c in calls):
        return calls  # the form check names it
    distinct = {tuple(c) for c in calls}
    if len(distinct) != 1:
        raise RoutingFileError(
            f"values.routing_from: module {name!r} routed {len(distinct)} different ways in the measured step (one "
            f"per micro batch); give one count list per module (got {path!r})"
        )
    return calls[0]


__all__ = [
    "SKEW_TABLE",
    "RoutingFileError",
    "RoutingSpec",
    "load_routing_file",
    "profile_rules",
    "skew_spec",
]
