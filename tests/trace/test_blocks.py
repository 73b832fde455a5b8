"""The operator trace: blocks reconstruct the tracker's peak exactly, and their fields follow the format."""

from __future__ import annotations

import pytest

from hyperdryrun.report import blocks_csv, build_report
from hyperdryrun.trace.blocks import ADDRESS_BASE, PERSISTENT_END, Category, Phase, live_bytes_by_task
from tests.conftest import dry_run

CONFIGS = {
    "fsdp2": dict(world__world_size=2),
    "fsdp3-uneven-rank2": dict(world__world_size=3, world__rank=2),
    "no-reshard": dict(world__world_size=2, parallel__reshard_after_forward=False),
    "hsdp": dict(world__world_size=4, parallel__dp_replicate=2),
    "tp-sp": dict(world__world_size=2, parallel__tp=2),
    "fsdp-tp": dict(world__world_size=4, parallel__tp=2),
    "ac-full-2mb": dict(world__world_size=2, training__ac="full", training__num_micro_batches=2),
    "ac-op-bf16": dict(world__world_size=2, training__ac="selective", training__dtype="bf16"),
    "sgd-world1": dict(training__optimizer="SGD"),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def trace(request):
    return dry_run(**CONFIGS[request.param])


def test_blocks_reconstruct_the_peak_exactly(trace):
    live = live_bytes_by_task(trace.blocks, trace.num_tasks)
    assert max(live) == trace.peak
    assert live[trace.peak_task] == trace.peak


def test_blocks_reconstruct_each_phase_peak_and_the_bytes_after_the_step(trace):
    live = live_bytes_by_task(trace.blocks, trace.num_tasks)
    allocating = {b.start for b in trace.blocks}
    for phase, peak in trace.phase_peak.items():
        at = [
            n
            for t, (n, p) in enumerate(zip(live, trace.task_phase, strict=True))
            if p is phase and t in allocating
        ]
        assert max(at) == peak
    assert sum(b.size for b in trace.blocks if b.persistent) == trace.current


def test_block_fields_follow_the_trace_format(trace):
    addrs = [b.addr for b in trace.blocks]
    assert addrs[0] == ADDRESS_BASE
    assert all(a % 512 == 0 for a in addrs) and addrs == sorted(addrs) and len(set(addrs)) == len(addrs)
    for b in trace.blocks:
        assert b.size % 512 == 0 and b.size >= b.requested > 0  # CUDA target: 512 B rounding
        assert 0 <= b.start < b.end
        assert b.end == PERSISTENT_END or b.end <= trace.num_tasks
        assert b.start <= b.start_plot < b.start + 1
        assert b.persistent or b.end <= b.end_plot < b.end + 1
        assert all(b.start <= u < b.end for u in b.users) and b.users == sorted(set(b.users))
        assert b.category is not None
        if b.phase is Phase.INITIALIZATION:
            assert b.start == 0 and b.op == "initialization"
            assert b.category in (Category.PARAMETER, Category.BUFFER, Category.OPTSTATE, Category.GRADIENT)


def test_the_step_ends_where_it_started_at_steady_state(trace):
    # After one full step (zero_grad to None) exactly the parameters, buffers and optimizer states remain.
    assert trace.current == trace.initial
    persistent = {b.category for b in trace.blocks if b.persistent}
    assert persistent <= {Category.PARAMETER, Category.BUFFER, Category.OPTSTATE}


def test_csv_has_the_viewer_columns_and_one_row_per_block(trace):
    text = blocks_csv(trace)
    lines = text.splitlines()
    assert lines[0] == (
        "start_time_stamp,end_time_stamp,start_plot_time_stamp,end_plot_time_stamp,device_addr,stream_id,"
        "pool_type,size,actual_used_memory,actual_peak_memory,file_name,line_num,type,producer_task,task_name,"
        "node_name,graph_name,user_tasks,last_user_task,python_stack,is_persistent,is_small"
    )
    assert len(lines) == len(trace.blocks) + 1


def test_report_peak_live_set_is_the_blocks_alive_at_the_peak_largest_first():
    trace = dry_run(world__world_size=2)
    report = build_report(trace, live_set_limit=5)
    live = report["peak_live_set"]
    alive = [b for b in trace.blocks if b.start <= trace.peak_task < b.end]
    assert live["total_bytes"] == trace.peak == sum(b.size for b in alive)
    assert live["num_blocks"] == len(alive) and live["shown"] == 5
    sizes = [b["size"] for b in live["blocks"]]
    assert sizes == sorted((b.size for b in alive), reverse=True)[:5]
    assert live["rest_bytes"] == trace.peak - sum(sizes)
    assert sum(report["summary"]["breakdown_at_peak"].values()) == trace.peak
