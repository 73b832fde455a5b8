"""The routing option of every front door (hyperdryrun.world.routing): each routing's tokens per expert against
counts worked by hand from its definition, the file forms of --routing-from, and what a field given alone means.

Notation: T tokens of a micro batch, top_k experts per token, E experts; the balanced load is T * top_k / E."""

from __future__ import annotations

import json

import pytest

from hyperdryrun.world.routing import RoutingFileError, RoutingSpec, load_routing_file, skew_spec
from hyperdryrun.world.value_rules import (
    ROUTING_OP,
    ValueRule,
    ValueRuleError,
    ValueRules,
    bound_counts,
    scaled_profile,
    token_counts,
)


def counts_of(spec: RoutingSpec, module: str, tokens: int, experts: int, top_k: int) -> list[int]:
    return ValueRules(spec.routing_rules()).token_counts(module, tokens, experts, top_k)


# ------------------------------------------------------------------------------------------------ skew
def test_skew_2_gives_the_busiest_expert_twice_the_balanced_load_and_the_rest_share_what_remains():
    # T=64, top 2, E=8: 128 rows, balanced 16; expert 0 gets 32, the other 7 share 96 = 7 * 13 + 5
    assert counts_of(RoutingSpec(skew=2.0), "layers.1.moe.experts", 64, 8, 2) == [
        32,
        14,
        14,
        14,
        14,
        14,
        13,
        13,
    ]


def test_a_skew_past_every_token_is_capped_at_one_per_token():
    # skew 8 would be 128 rows for expert 3, but each of the 64 tokens picks it at most once: 64, the rest 64 / 7
    counts = counts_of(RoutingSpec(skew=8.0, hot_expert=3), "layers.0.moe.experts", 64, 8, 2)
    assert counts == [10, 9, 9, 64, 9, 9, 9, 9]


def test_skew_1_is_the_balanced_load():
    assert counts_of(skew_spec(1.0), "x", 64, 8, 2) == [16] * 8


# ------------------------------------------------------------------------------------------------ bound
def test_the_dropless_bound_sends_every_token_to_the_same_top_k_experts():
    # any EP rank can receive at most T * min(top_k, experts per rank) rows from each source: experts 0 and 1
    # taking all 64 tokens reach it for 4 experts per rank (128 rows), 2 per rank (128) and 1 per rank (64)
    assert bound_counts(64, 8, 2) == [64, 64, 0, 0, 0, 0, 0, 0]
    assert counts_of(RoutingSpec(routing="bound", hot_expert=7), "x", 64, 8, 2) == [64, 0, 0, 0, 0, 0, 0, 64]


def test_a_capacity_factor_bounds_each_expert_at_c_times_the_balanced_load():
    # C = 1.25: at most 20 of balanced 16; 128 rows = 6 x 20 + 8; EP 2 rank 0 (experts 0-3) receives 80 = 1.25 x 64
    spec = RoutingSpec(capacity_factor=1.25)
    assert spec.routing == "bound"
    assert counts_of(spec, "x", 64, 8, 2) == [20, 20, 20, 20, 20, 20, 8, 0]


def test_a_capacity_under_the_balanced_share_is_raised_to_it():
    # T=10, top 1, E=4: balanced 2.5, C=1 allows 2, but 4 x 2 < 10 tokens: each takes ceil(2.5) = 3
    assert bound_counts(10, 4, 1, 1.0) == [3, 3, 3, 1]


# ------------------------------------------------------------------------------------------------ profile
@pytest.mark.parametrize(
    ("profile", "tokens", "top_k", "expected"),
    [
        ([4, 4, 0, 0], 4, 2, [4, 4, 0, 0]),  # a step's own counts: as they are
        ([3, 1, 0, 0], 8, 1, [6, 2, 0, 0]),  # in proportion
        ([0.5, 0.25, 0.25], 4, 1, [2, 1, 1]),  # fractions
        (
            [10, 1, 1, 0],
            4,
            2,
            [4, 2, 2, 0],
        ),  # 10/12 x 8 > 4 tokens: capped, experts 1 and 2 share the other 4
        ([1, 0, 0, 0], 4, 2, [4, 2, 1, 1]),  # expert 0 full; the unloaded experts share the rest evenly
        ([1, 1, 1], 2, 1, [1, 1, 0]),  # 2/3 each: largest remainder, ties to the lower expert
    ],
)
def test_a_profile_is_scaled_to_the_steps_tokens_times_top_k(profile, tokens, top_k, expected):
    assert scaled_profile(profile, tokens, top_k) == expected


def test_a_profile_of_the_wrong_length_names_the_layer_size():
    rule = ValueRule(op=ROUTING_OP, handler="profile", profile=[1, 2, 3])
    with pytest.raises(ValueRuleError, match="has 3 entries, but the layer has 4 experts"):
        token_counts(rule, 8, 4, 1)


# ------------------------------------------------------------------------------------------------ files
def write(tmp_path, data) -> str:
    path = tmp_path / "routing.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_torchtitan_tokens_per_expert_buffers_by_name_are_matched_by_layer(tmp_path):
    # named_buffers() of a torchtitan MoE model: summed over many steps, recomputes counted twice; only the
    # proportions matter. Layer 1 of the dry run's own names (built-in, torchtitan, HF) gets layer 1's profile.
    path = write(
        tmp_path,
        {
            "layers.1.moe.tokens_per_expert_E": [3000.0, 1000.0, 0.0, 0.0],
            "model.layers.2.mlp.gate.counts": [1, 1, 1, 1],
        },
    )
    spec = RoutingSpec(routing_from=path)
    assert spec.routing == "profile"
    rules = ValueRules(spec.routing_rules())
    assert rules.token_counts("layers.1.moe.experts", 8, 4, 1) == [6, 2, 0, 0]
    assert rules.token_counts("model.layers.1.mlp.experts", 8, 4, 1) == [6, 2, 0, 0]
    assert rules.token_counts("layers.1.moe.routed_experts", 8, 4, 1) == [6, 2, 0, 0]
    assert rules.token_counts("layers.2.moe.experts", 8, 4, 1) == [2, 2, 2, 2]
    assert rules.token_counts("layers.11.moe.experts", 8, 4, 1) == [2, 2, 2, 2]  # not named: balanced
    assert "layer 1, layer 2 as the file's loads" in spec.describe()


def test_a_list_per_decoder_layer_with_null_for_dense_layers(tmp_path):
    path = write(tmp_path, [None, [1, 3], [2, 2]])
    assert load_routing_file(path) == {1: [1, 3], 2: [2, 2]}
    rules = ValueRules(RoutingSpec(routing_from=path).routing_rules())
    assert rules.token_counts("layers.1.moe.experts", 4, 2, 1) == [1, 3]


def test_one_list_is_every_layers_profile(tmp_path):
    rules = ValueRules(RoutingSpec(routing_from=write(tmp_path, [1, 3])).routing_rules())
    assert rules.token_counts("layers.5.moe.experts", 8, 2, 1) == [2, 6]


def test_a_measure_report_gives_each_module_its_one_count_list(tmp_path):
    record = {"layers.1.moe.routed_experts": [[5, 3], [5, 3]]}  # forward and its recompute
    path = write(
        tmp_path, {"metadata": {"mode": "measured", "torchtitan": {"routing": record}}, "summary": {}}
    )
    assert load_routing_file(path) == {1: [5, 3]}
    bad = write(
        tmp_path, {"metadata": {"torchtitan": {"routing": {"layers.1.moe.routed_experts": [[2, 0], [1, 1]]}}}}
    )
    with pytest.raises(RoutingFileError, match="routed 2 different ways"):
        load_routing_file(bad)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"layers.1.x": [1, -1]}, "'layers.1.x' is not a list of loads >= 0"),
        ({"layers.1.x": [0, 0]}, "not all 0"),
        ({"layers.1.a": [1], "1": [2]}, "layer 1 is given twice"),
        ([[1], "x"], "entry 1 (layer 1) is not a list of loads"),
        ({"metadata": {"mode": "measured"}}, "the report holds no measured MoE routing"),
        ("text", "expected a --measure report"),
        ({}, "expected a --measure report"),
    ],
)
def test_a_file_not_of_the_forms_is_one_line_naming_the_path(tmp_path, data, needle):
    path = write(tmp_path, data)
    with pytest.raises(RoutingFileError) as err:
        load_routing_file(path)
    assert needle in str(err.value) and path in str(err.value) and "\n" not in str(err.value)


def test_an_unreadable_file(tmp_path):
    with pytest.raises(RoutingFileError, match="not a readable JSON file"):
        load_routing_file(str(tmp_path / "missing.json"))


# ------------------------------------------------------------------------------------------------ the option
def test_a_field_alone_chooses_its_routing_and_a_field_of_another_is_ignored():
    assert RoutingSpec().routing == "balanced"
    assert RoutingSpec(skew=3.0).routing == "hotspot"
    assert RoutingSpec(counts=[1, 1]).routing == "explicit"
    assert RoutingSpec(capacity_factor=2.0).routing == "bound"
    assert set(RoutingSpec(routing="bound", skew=2.0).ignored()) == {"skew"}
    assert RoutingSpec(routing="bound", hot_expert=2).ignored() == {}


# ------------------------------------------------------------------------------------------------ forced routing
@pytest.mark.parametrize(
    ("counts", "tokens", "top_k"), [([3, 1, 0, 2], 3, 2), ([4, 4, 4], 4, 3), ([2, 1, 1], 4, 1)]
)
def test_forced_ids_give_each_expert_its_count_and_each_token_distinct_experts(counts, tokens, top_k):
    from hyperdryrun.compat.torchtitan_moe import forced_ids

    ids = forced_ids(counts, tokens, top_k)
    assert len(ids) == tokens and all(len(set(row)) == top_k for row in ids)
    assert [sum(row.count(e) for row in ids) for e in range(len(counts))] == counts


def test_forced_routing_is_undone_on_exit_also_after_an_error():
    from hyperdryrun.compat.torchtitan_moe import forced_routing

    class Router:
        top_k = 1
        _debug_force_load_balance = False

        def _debug_force_load_balance_routing(self, scores):
            return "own"

    router = Router()
    with pytest.raises(RuntimeError), forced_routing({"layers.1.moe.routed_experts": router}, None):
        assert router._debug_force_load_balance is True
        assert "_debug_force_load_balance_routing" in vars(router)  # this router's own override
        raise RuntimeError
    assert (
        router._debug_force_load_balance is False and router._debug_force_load_balance_routing(None) == "own"
    )
