"""torchtitan's MoE layers (``torchtitan/models/common/moe.py``, ``token_dispatcher.py``; tested: torchtitan 0.3.0,
torch 2.13.0) executed for real on one rank with torch's fake process group (``measure``).

- Routing record: the per-expert token counts of every routed-experts module's call (``num_local_tokens_per_expert_E``,
  the argument ``MoE.forward`` passes to ``RoutedExperts.forward``), so that the dry run of the same step can be
  given the measured run's routing (the ``moe.token_counts`` value rules).
- Forced routing: a measured run given a routing (``--routing``, ``--skew``...) makes every router pick the experts
  that give its layer those counts, through the router's own override point (``TokenChoiceTopKRouter``'s
  ``_debug_force_load_balance`` branch, which takes ``_debug_force_load_balance_routing(scores)``'s experts and
  scores, then normalises and scales them as it would its own choice).
- Expert parallelism: ``AllToAllTokenDispatcher._token_count_exchange`` all-to-alls the per-expert counts over the EP
  group, and torch's fake process group completes an all-to-all without writing its output (torch 2.13
  ``FakeProcessGroup::alltoall_base``), so the received counts, and from them the split sizes of the token all-to-all
  and the grouped GEMMs' offsets, were uninitialised memory. :func:`defined_count_exchange` receives what the dry
  run assumes (``hyperdryrun.integrations.torchtitan``: every EP rank routes its tokens as this one does).

No torch or torchtitan import at module import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hyperdryrun.patches import Patch

RoutingRecord = dict[str, list[list[int]]]
"""Module FQN -> the per-expert token counts of each of its calls in the step (forward and recompute)."""


def routed_experts_class() -> type | None:
    """torchtitan's ``RoutedExperts`` (None where this torchtitan has no such module)."""
    try:
        from torchtitan.models.common.moe import RoutedExperts
    except ImportError:
        return None
    return RoutedExperts


@contextlib.contextmanager
def recorded_routing(modules: dict[str, Any], into: RoutingRecord) -> Iterator[RoutingRecord]:
    """Record into ``into`` the per-expert token counts of each call of the routed-experts ``modules`` (FQN ->
    module) in the body, by forward pre-hooks removed on exit. The counts are the fourth argument of
    ``RoutedExperts.forward`` (``num_local_tokens_per_expert_E``), a real tensor in a measured run."""

    def hook(name: str) -> Any:
        def record(module: Any, args: tuple, kwargs: dict) -> None:
            counts = kwargs.get("num_local_tokens_per_expert_E", args[3] if len(args) > 3 else None)
            if counts is not None:
                into.setdefault(name, []).append([int(c) for c in counts.tolist()])

        return record

    handles = [m.register_forward_pre_hook(hook(name), with_kwargs=True) for name, m in modules.items()]
    try:
        yield into
    finally:
        for h in handles:
            h.remove()


def forced_ids(counts: list[int], tokens: int, top_k: int) -> list[list[int]]:
    """``top_k`` distinct experts for each of ``tokens`` tokens such that expert e is picked ``counts[e]`` times
    (each count at most ``tokens``, adding up to ``tokens * top_k``): the experts in order, each repeated its count,
    fill the (top_k, tokens) slots row by row; an expert's run is at most ``tokens`` long, so no token gets it twice.
    """
    flat = [e for e, n in enumerate(counts) for _ in range(n)]
    assert len(flat) == tokens * top_k and max(counts) <= tokens, (counts, tokens, top_k)
    return [[flat[c * tokens + t] for c in range(top_k)] for t in range(tokens)]


@contextlib.contextmanager
def forced_routing(routers: dict[str, Any], token_counts: Any) -> Iterator[None]:
    """Make each router of ``routers`` (routed-experts module FQN -> its ``TokenChoiceTopKRouter``) pick, for the
    ``tokens`` of a call, the experts of :func:`forced_ids` for ``token_counts(fqn, tokens, experts, top_k)``;
    restored on exit (also after an exception)."""
    import torch

    def routing(name: str, router: Any) -> Any:
        def force(scores_BLE: Any) -> tuple[Any, Any]:
            bs, slen, experts = scores_BLE.shape
            counts = token_counts(name, bs * slen, experts, router.top_k)
            ids = forced_ids(counts, bs * slen, router.top_k)
            ids_BLK = torch.tensor(ids, dtype=torch.int64, device=scores_BLE.device).view(
                bs, slen, router.top_k
            )
            return ids_BLK, scores_BLE.gather(dim=-1, index=ids_BLK)

        return force

    saved = {name: r._debug_force_load_balance for name, r in routers.items()}
    try:
        for name, router in routers.items():
            router._debug_force_load_balance = True
            router._debug_force_load_balance_routing = routing(name, router)
        yield
    finally:
        for name, router in routers.items():
            router._debug_force_load_balance = saved[name]
            router.__dict__.pop("_debug_force_load_balance_routing", None)


def defined_count_exchange() -> list[Patch]:
    """The EP count exchange of a measured run on the fake process group: this rank receives from every EP rank
    the counts that it routes to its own local experts (every EP rank routes alike, as the dry run assumes),
    in a tensor of the shape and dtype the all-to-all returns."""
    try:
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    except ImportError:
        return []
    import torch

    def token_count_exchange(self: Any, num_local_tokens_per_expert_E: Any, pg: Any, ep_size: int) -> Any:
        me = self.ep_mesh.get_local_rank()
        mine = num_local_tokens_per_expert_E.view(ep_size, -1)[me]
        return mine.unsqueeze(0).expand(ep_size, -1).clone(memory_format=torch.contiguous_format)

    return [
        Patch(
            AllToAllTokenDispatcher,
            "_token_count_exchange",
            token_count_exchange,
            "torch 2.13's fake process group completes torchtitan 0.3.0's EP count all-to-all without writing its "
            "output, so a measured rank's split sizes were uninitialised memory; it receives what every EP rank "
            "routing alike sends it",
        )
    ]
