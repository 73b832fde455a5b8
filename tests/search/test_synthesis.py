"""The whole step's blocks written down from sample runs (hyperdryrun.search.synthesis): on real jobs they are the
full run's blocks, field by field, so the allocator model replayed on them gives the full run's reserved and
device peaks; by hand on a made-up step; and every check refuses what would make them wrong."""

from __future__ import annotations

import copy

import pytest

import hyperdryrun.search.extrapolate as ex
from hyperdryrun.recipe import run_job
from hyperdryrun.report.build import device_memory_of
from hyperdryrun.search.extrapolate import SampleTable, ShortcutFailed, plan_for, sample_config
from hyperdryrun.search.synthesis import device_peaks, synthesize
from hyperdryrun.trace.blocks import PERSISTENT_END
from tests.conftest import job

JOBS = {
    # 1F1B's first of 4 stages: 4 warm-up forwards, whose backwards are steady ones, and 3 late forwards, whose
    # backwards are cool-down ones (hyperdryrun.search.extrapolate.MicroBatchRegimes)
    "PP 1F1B first of 4 stages": dict(world__world_size=4, parallel__pp=4, model__n_layers=24,
                                      training__num_micro_batches=16),
    # 1F1B's warm-up, steady and cool-down micro batches, TP, full AC (recompute), the last stage (the loss)
    "PP 1F1B last stage, TP, AC full": dict(world__world_size=8, world__rank=5, parallel__pp=2, parallel__tp=2,
                                             model__n_layers=12, training__num_micro_batches=12,
                                             training__ac="full"),
    # MoE with a dense layer first and uneven routing, expert parallel
    "MoE EP hotspot + dense layer": dict(model__name="moe-tiny", world__world_size=2, parallel__ep=2,
                                         model__n_layers=8, model__n_dense_layers=1,
                                         training__num_micro_batches=6, training__ac="full",
                                         values__routing="hotspot", values__skew=3.0),
}  # fmt: skip


def _fields(b):
    """What the allocator reads of a block, and what it is."""
    return (b.id, b.start, b.end, b.requested, b.size, b.stream, b.use_streams, str(b.category), str(b.phase))


@pytest.fixture(scope="module", params=list(JOBS), ids=list(JOBS))
def case(request):
    saving = ex.MIN_SAVING
    ex.MIN_SAVING = 100.0  # tiny jobs: plan as for big ones
    try:
        cfg = job(**JOBS[request.param])
        plan, why = plan_for(cfg)
        assert plan is not None, why
        samples = [(pt, ex.run_sample(sample_config(cfg, plan, pt))) for pt in plan.points]
    finally:
        ex.MIN_SAVING = saving
    return cfg, plan, samples, run_job(cfg, capture_stacks=False)


def test_the_written_blocks_are_the_full_runs_blocks(case):
    cfg, plan, samples, full = case
    syn = synthesize(samples, plan, full.peak)
    assert [_fields(b) for b in syn.blocks] == [_fields(b) for b in sorted(full.blocks, key=lambda b: b.id)]
    dm = device_memory_of(full, cfg.target.capacity_bytes)
    assert device_peaks(syn, full.peak, cfg.target.capacity_bytes) == (dm.peak_reserved, dm.peak_device)


def _tampered(samples, i, edit):
    out = copy.deepcopy(samples)
    edit(out[i][1])
    return out


def test_each_check_refuses_samples_that_do_not_repeat(case):
    cfg, plan, samples, full = case
    last = len(samples) - 1

    def end_moved(t: SampleTable):
        k = next(k for k, r in enumerate(t.blocks) if r[2] != PERSISTENT_END and r[10].startswith("layers."))
        r = list(t.blocks[k])
        r[2] += 1
        t.blocks[k] = tuple(r)

    with pytest.raises(ShortcutFailed, match="not affine"):
        synthesize(_tampered(samples, last, end_moved), plan, full.peak)

    def nccl_changed(t: SampleTable):
        t.device = {**t.device, "nccl": {**t.device["nccl"], "bytes": t.device["nccl"]["bytes"] + 1}}

    with pytest.raises(ShortcutFailed, match="nccl differ"):
        synthesize(_tampered(samples, 0, nccl_changed), plan, full.peak)
    with pytest.raises(ShortcutFailed, match="the written blocks peak at"):
        synthesize(samples, plan, full.peak + 512)

    def no_blocks(t: SampleTable):
        t.blocks = None

    with pytest.raises(ShortcutFailed, match="carry no blocks"):
        synthesize(_tampered(samples, 0, no_blocks), plan, full.peak)


def test_a_made_up_step_is_written_down_as_worked_out_by_hand(monkeypatch):
    monkeypatch.setattr(ex, "MIN_SAVING", 100.0)
    # 12 identical layers, one micro batch: samples of 3, 4 and 5 layers. Parameters: one 1 KiB block per layer
    # before the step (ids 0..n-1); forward of layer i (task i) saves a 512 B activation (id n + i) that its
    # backward (task 2n - 1 - i) frees: it ends at 2n - i. At 12 layers: activations 12..23, the one of layer i
    # from task i to 24 - i, all 12 alive at task 11: peak 12 KiB + 6 KiB.
    cfg = job(world__world_size=2, model__n_layers=12)
    plan, _ = plan_for(cfg)
    assert plan is not None and not plan.varies_m
    device = {"allocator": {"settings": "", "source": "defaults"},
              "cublas_workspace": {"bytes_per_handle": 0, "handles": []},
              "nccl": {"bytes": 0, "formula": "none"}, "cuda_context": {"bytes": 0, "source": "none"}}  # fmt: skip
    samples = []
    for point in plan.points:
        n = plan.run_length(None, point.x)
        params = [(i, 0, PERSISTENT_END, 1024, 1024, 0, [], "Parameter", "initialization", 0, f"layers.{i}",
                   "initialization") for i in range(n)]  # fmt: skip
        acts = [(n + i, i, 2 * n - i, 512, 512, 0, [], "Activation", "forward", 0, f"layers.{i}", "mm")
                for i in range(n)]  # fmt: skip
        samples.append((point, SampleTable([], ["forward"], [0] * 9, params + acts, device)))
    syn = synthesize(samples, plan, 12 * 1024 + 12 * 512)
    got = [(b.id, b.start, b.end, b.size, str(b.category)) for b in syn.blocks]
    want = [(i, 0, PERSISTENT_END, 1024, "Parameter") for i in range(12)]
    want += [(12 + i, i, 24 - i, 512, "Activation") for i in range(12)]
    assert got == want
    # One layer's block missing from one sample: that key is not in every sample.
    short = copy.deepcopy(samples)
    short[1][1].blocks.pop(5)
    with pytest.raises(ShortcutFailed, match="a sample has 1 of 2 blocks"):
        synthesize(short, plan, 12 * 1024 + 12 * 512)


def test_1f1b_forwards_are_keyed_by_where_their_backward_is():
    # Stage with 3 warm-up forwards (w = 3) of 10 micro batches: backwards 0..7 are steady (each after forward
    # k + 3), 8 and 9 cool-down; so forwards 3..7 stretch (their backward steady), 8 and 9 are keyed one by one.
    r = ex.MicroBatchRegimes(3, 4)
    assert [r.place("forward", mb, 10) for mb in range(10)] == [
        (("warm", 0), None), (("warm", 1), None), (("warm", 2), None),
        (("F", "f", 0), None), (("F", "m"), 1), (("F", "m"), 2), (("F", "m"), 3), (("F", "b", 0), None),
        (("late", 2), None), (("late", 1), None),
    ]  # fmt: skip
    assert [r.place("backward", mb, 10) for mb in range(10)] == [
        (("B", "f", 0), None), *[(("B", "m"), k) for k in range(1, 7)], (("B", "b", 0), None),
        (("cool", 2), None), (("cool", 1), None),
    ]  # fmt: skip
    assert r.length(("F", "m"), 10) == 5 and r.length(("B", "m"), 10) == 8
    # Every warm-up forward's backward a middle steady one (k <= m - w - 1) and 3 stretching forwards: m >= 8.
    assert r.min_micro_batches == 8
    assert ex.MicroBatchRegimes(1, 4).min_micro_batches == 4
