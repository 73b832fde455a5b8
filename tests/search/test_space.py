"""The candidate space: every layout that fills the world, and why a layout is invalid."""

from __future__ import annotations

import pytest

from hyperdryrun.search.space import SearchSpace, base_job, candidates, layouts
from tests.conftest import job


def test_layouts_fill_the_world_and_split_the_global_batch():
    space = SearchSpace(tp=(1, 2), pp=(1, 2), micro_batch_sizes=(1, 2), ac=("full",))
    found = [(lay, why) for lay, why in layouts(space, 8, 16, is_moe=False)]
    # tp x pp in {1,2}^2: dp_shard 8, 4, 4, 2; micro batch 1 or 2: 8 layouts; 16 sequences always split.
    assert len(found) == 8 and all(why is None for _, why in found)
    dp = {(lay.tp, lay.pp, lay.micro_batch_size): (lay.dp_shard, lay.num_micro_batches) for lay, _ in found}
    assert dp[(1, 1, 1)] == (8, 2) and dp[(2, 2, 2)] == (2, 4) and dp[(1, 2, 2)] == (4, 2)


def test_a_batch_that_does_not_split_and_too_many_micro_batches_are_named():
    space = SearchSpace(tp=(1,), pp=(1,), micro_batch_sizes=(1, 3), ac=("none",), max_micro_batches=4)
    why = {lay.micro_batch_size: w for lay, w in layouts(space, 2, 12, is_moe=False)}
    assert why[1] == "needs 6 micro batches per step, more than max_micro_batches=4"
    assert why[3] is None
    why = {lay.micro_batch_size: w for lay, w in layouts(space, 4, 10, is_moe=False)}
    assert why[3] == "the global batch of 10 sequences does not split into dp 4 x micro batches of 3"


def test_candidates_carry_the_layout_s_first_problem():
    base = base_job(job(world__world_size=8))
    space = SearchSpace(tp=(1, 8), pp=(1,), micro_batch_sizes=(1,), ac=("none",))
    found = {c.layout.tp: c for c in candidates(base, space, 8)}
    assert found[1].cfg is not None and found[1].problem is None
    # llama-tiny has 4 heads: tp 8 cannot split them (ParallelDims.problems).
    assert found[8].cfg is None and found[8].problem == "model.n_heads=4 is not divisible by parallel.tp=8"


def test_expert_parallel_is_searched_for_moe_models_only():
    space = SearchSpace(tp=(1,), pp=(1,), ep=(1, 2), micro_batch_sizes=(1,), ac=("none",))
    assert {lay.ep for lay, _ in layouts(space, 4, 4, is_moe=True)} == {1, 2}
    assert {lay.ep for lay, _ in layouts(space, 4, 4, is_moe=False)} == {1}


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [("tp", (0,), "search.tp=[0]"), ("ac", ("some",), "search.ac: 'some'"), ("pp_schedules", ("X",), "'X'")],
)
def test_a_bad_space_is_refused(field, value, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        SearchSpace(**{field: value})
