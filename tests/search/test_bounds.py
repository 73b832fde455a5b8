"""The state bound: hand-derived sizes, and never above the simulated peak."""

from __future__ import annotations

import pytest

from hyperdryrun.recipe import run_job
from hyperdryrun.search.bounds import state_bound, worst_state_bound
from hyperdryrun.search.classes import rank_classes
from tests.conftest import job

# llama-tiny: dim 64, 2 layers, 4 heads of 16, 2 KV heads, FFN 128, vocab 256. Per layer: wq and wo 64x64, wk and
# wv 32x64, w1 w2 w3 128x64, two norms of 64 = 8192 + 4096 + 24576 + 128 = 36992; plus the final norm (64), the
# embedding and the head (256x64 each).
TINY_PARAMS = 2 * 36992 + 64 + 2 * 256 * 64


def test_one_rank_holds_every_parameter_with_its_gradient_and_two_adamw_states():
    b = state_bound(job(), 0)
    assert b.param_elements == TINY_PARAMS == 106816
    assert b.bytes == TINY_PARAMS * 4 * (1 + 1 + 2)  # fp32 parameter, gradient, exp_avg, exp_avg_sq


def test_sgd_with_momentum_keeps_one_state_and_bf16_halves_the_bytes():
    b = state_bound(job(training__optimizer="SGD", training__dtype="bf16", training__param_dtype=None), 0)
    assert b.bytes == TINY_PARAMS * 2 * (1 + 1 + 1)
    assert state_bound(job(training__optimizer="SGD", training__momentum=0.0), 0).bytes == TINY_PARAMS * 4 * 2


def test_uneven_shards_count_each_rank_s_own_rows():
    # 3 FSDP ranks: torch.chunk gives 64 rows as 22, 22, 20 (32 as 11, 11, 10; 128 as 43, 43, 42; 256 as 86, 86, 84).
    per_rank = [state_bound(job(world__world_size=3), r).param_elements for r in range(3)]
    assert sum(per_rank) == TINY_PARAMS
    assert per_rank[0] == per_rank[1] > per_rank[2]


SAMPLE = [
    dict(world__world_size=2),
    dict(world__world_size=3, training__ac="full"),
    dict(world__world_size=4, parallel__tp=2, training__optimizer="SGD"),
    dict(world__world_size=4, parallel__pp=2, training__num_micro_batches=2, model__n_layers=4),
    dict(model__name="moe-tiny", world__world_size=4, parallel__ep=2, training__dtype="bf16"),
    dict(world__world_size=2, parallel__dp_replicate=2, training__ac="selective"),
]


@pytest.mark.parametrize("over", SAMPLE)
def test_the_bound_never_exceeds_the_simulated_peak(over):
    cfg = job(**over)
    for c in rank_classes(cfg):
        rank_cfg = job(**over, world__rank=c.representative)
        bound = state_bound(rank_cfg, c.representative)
        peak = run_job(rank_cfg, capture_stacks=False).peak
        assert 0 < bound.bytes <= peak, (c.representative, bound.bytes, peak)


def test_the_worst_bound_is_the_largest_over_the_ranks_given():
    cfg = job(world__world_size=3)
    assert worst_state_bound(cfg, [0, 1, 2]).rank == 0
    assert worst_state_bound(cfg, [2]).bytes < worst_state_bound(cfg, [0, 2]).bytes
