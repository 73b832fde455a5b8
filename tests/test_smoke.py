from hyperdryrun.config import build_config
from hyperdryrun.recipe import run_job
from hyperdryrun.trace.blocks import live_bytes_by_task


def test_blocks_reconstruct_tracker_peak_exactly():
    cfg = build_config(
        {"model": {"name": "llama-tiny"}, "world": {"world_size": 2}, "training": {"seq_len": 64}}
    )
    tr = run_job(cfg)
    assert max(live_bytes_by_task(tr.blocks, tr.num_tasks)) == tr.peak
