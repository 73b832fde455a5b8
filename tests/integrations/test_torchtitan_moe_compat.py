"""compat/torchtitan_moe.py: the measured run's routing record and its EP count exchange on the fake process group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hyperdryrun.compat.torchtitan_moe import defined_count_exchange, recorded_routing


class Experts(nn.Module):
    """Stands in for torchtitan's RoutedExperts: the counts are the fourth argument."""

    def forward(self, x, scores, ids, num_local_tokens_per_expert_E):
        return x


def test_each_call_s_counts_are_recorded_by_name_and_the_hooks_are_removed():
    experts = Experts()
    record: dict[str, list[list[int]]] = {}
    x = torch.zeros(2)
    with recorded_routing({"layers.1.moe.routed_experts": experts}, record):
        experts(x, x, x, torch.tensor([3, 0, 1]))
        experts(x, x, x, num_local_tokens_per_expert_E=torch.tensor([2, 2, 0]))
    experts(x, x, x, torch.tensor([9, 9, 9]))  # after the body: not recorded
    assert record == {"layers.1.moe.routed_experts": [[3, 0, 1], [2, 2, 0]]}
    assert not experts._forward_pre_hooks


def test_the_hooks_are_removed_after_an_error():
    experts = Experts()
    with pytest.raises(RuntimeError), recorded_routing({"m": experts}, {}):
        raise RuntimeError("step failed")
    assert not experts._forward_pre_hooks


def test_an_ep_rank_receives_from_every_rank_the_counts_of_its_own_experts():
    pytest.importorskip("torchtitan")
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    [patch] = defined_count_exchange()
    assert patch.owner is AllToAllTokenDispatcher and patch.name == "_token_count_exchange"
    # EP 2, 8 experts: EP rank 1 holds experts 4..7; every rank routes as it does, so each row is its counts 4..7
    me = SimpleNamespace(ep_mesh=SimpleNamespace(get_local_rank=lambda: 1))
    counts = torch.tensor([5, 1, 0, 2, 7, 3, 4, 6])
    got = patch.new(me, counts, None, 2)
    assert got.tolist() == [[7, 3, 4, 6], [7, 3, 4, 6]] and got.dtype == counts.dtype and got.is_contiguous()
