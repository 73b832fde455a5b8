"""The step-time estimate: FLOPs from the shapes, the pipeline bubble, the rates of every GPU preset."""

from __future__ import annotations

from hyperdryrun.search.roofline import RATES, flops_per_token, rates_for, step_time
from hyperdryrun.world.gpus import GPU_PRESETS
from tests.conftest import job

# llama-tiny (see tests/search/test_bounds.py): 106,816 parameters, 16,384 of them the input embedding.
MATMUL = 106816 - 256 * 64


def test_flops_per_token_are_6n_plus_causal_attention():
    # attention forward per token: layers x heads x (d_qk + d_v) x seq = 2 x 4 x 32 x 64; training is 3x that.
    attention = 2 * 4 * 32 * 64
    assert flops_per_token(job()) == 6 * MATMUL + 3 * attention
    # Full AC recomputes one forward: 2N and the attention forward once more.
    assert flops_per_token(job(training__ac="full")) == 8 * MATMUL + 4 * attention
    assert flops_per_token(job(training__ac="selective")) == flops_per_token(job())


def test_compute_splits_over_the_world_and_the_bubble_follows_1f1b():
    rates = rates_for("h100-80gb")
    one = step_time(job(world__world_size=1), rates)
    tokens = 64  # one sequence of 64
    assert one.compute == flops_per_token(job()) * tokens / rates.peak_flops
    pp = step_time(job(world__world_size=2, parallel__pp=2, training__num_micro_batches=4), rates)
    assert pp.bubble == pp.compute * (2 - 1) / 4


def test_tp_communication_is_counted_and_dp_alone_has_none():
    rates = rates_for("a100-80gb")
    assert step_time(job(world__world_size=2, parallel__tp=2), rates).tp > 0
    assert step_time(job(world__world_size=2), rates).tp == 0


def test_every_gpu_preset_has_rates_with_a_source():
    assert set(RATES) == set(GPU_PRESETS)
    assert all(r.source and r.peak_flops > 0 and r.hbm_bytes_per_s > 0 for r in RATES.values())
    assert RATES["h100-80gb"].peak_flops == 989.5e12  # 1,979 TFLOPS with sparsity, halved
