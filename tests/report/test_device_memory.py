"""A CUDA target's report: allocated <= reserved <= device, the reserved peak explained by cause, the segment CSV,
the OOM verdict on device bytes, and the knobs that change them (--gpu, --alloc-conf, the runtime's costs)."""

from __future__ import annotations

import csv
import io

import pytest

from hyperdryrun.allocator.device import ALLOCATOR
from hyperdryrun.report import build_report, device_memory_of, segments_csv
from hyperdryrun.report.build import CONTEXT_LINE, NCCL_LINE
from hyperdryrun.report.console import headline
from hyperdryrun.report.schema import GIB, SEGMENT_CSV_COLUMNS, SUMMARY_DEVICE_KEYS
from hyperdryrun.world.runtime import CudaRuntime
from hyperdryrun.world.target import DeviceTarget
from tests.conftest import dry_run

CONFIGS = {
    "single": {},
    "fsdp2": {"world__world_size": 2},
    "hsdp2x2-bf16": {
        "world__world_size": 4,
        "parallel__dp_replicate": 2,
        "training__dtype": "bf16",  # reduce_dtype fp32 != stored bf16: the cast lands on the all-reduce stream
    },
    "fsdp2-tp2-ac-full-2mb": {
        "world__world_size": 4,
        "parallel__tp": 2,
        "training__ac": "full",
        "training__num_micro_batches": 2,
    },
    "pp2": {
        "world__world_size": 2,
        "parallel__pp": 2,
        "training__num_micro_batches": 2,
        "model__n_layers": 2,
    },
    "fsdp2-expandable": {"world__world_size": 2, "cuda": {"alloc_conf": "expandable_segments:True"}},
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request):
    trace = dry_run(**CONFIGS[request.param])
    dm = device_memory_of(trace)
    return request.param, trace, dm, build_report(trace, device=dm)


def _segments(trace, dm) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(segments_csv(trace, dm))))


def test_allocated_reserved_device_are_ordered_and_the_summary_has_every_device_key(case):
    _, trace, dm, report = case
    s = report["summary"]
    assert set(SUMMARY_DEVICE_KEYS) <= set(s)
    assert s["peak_bytes"] == trace.peak
    assert (
        s["peak_device_bytes"] >= s["peak_reserved_bytes"] >= s["peak_allocated_bytes"] >= s["peak_bytes"] > 0
    )
    assert s["peak_reserved_bytes"] >= s["allocated_at_reserved_peak_bytes"]
    assert s["fragmentation_bytes"] == s["peak_reserved_bytes"] - s["allocated_at_reserved_peak_bytes"]


def test_the_reserved_peak_by_cause_adds_up_exactly(case):
    _, trace, dm, report = case
    s = report["summary"]
    assert sum(r["bytes"] for r in s["reserved_breakdown"]) == s["peak_reserved_bytes"]
    # what is not allocated at the reserved peak is exactly the cached and pending rows
    unallocated = sum(r["bytes"] for r in s["reserved_breakdown"] if r["stream"] is not None)
    assert unallocated == s["fragmentation_bytes"]
    # reserved - allocated peak, explained: the causes at the reserved peak, less the tensor bytes by which the
    # reserved peak's live set falls short of the allocated peak
    causes = {r["cause"]: 0 for r in s["reserved_breakdown"]}
    for r in s["reserved_breakdown"]:
        causes[r["cause"]] += r["bytes"]
    short = s["peak_bytes"] - causes["tensors"]
    assert short >= 0
    assert s["peak_reserved_bytes"] - s["peak_bytes"] == sum(causes.values()) - causes["tensors"] - short


def test_the_device_lines_add_up_to_the_device_peak(case):
    _, trace, _, report = case
    s = report["summary"]
    lines = {r["line"]: r["bytes"] for r in s["device_lines"]}
    assert sum(lines.values()) == s["peak_device_bytes"]
    cuda = trace.metadata["cuda"]
    assert lines[NCCL_LINE] == cuda["nccl"]["bytes"]
    # the H200 after a training step: nvidia-smi minus max_memory_reserved, the same in all six jobs
    # (docs/gpu/h200_measured.json, p1: smi_used - max_reserved)
    assert lines[CONTEXT_LINE] == cuda["cuda_context"]["bytes"] == 80_885_055_488 - 80_004_251_648
    assert s["peak_device_bytes"] == s["peak_reserved_bytes"] + lines[NCCL_LINE] + lines[CONTEXT_LINE]


def test_the_segment_csv_tiles_each_segment_and_sums_to_the_reserved_peak(case):
    _, trace, dm, report = case
    rows = _segments(trace, dm)
    assert list(rows[0]) == list(SEGMENT_CSV_COLUMNS)
    segs: dict[int, tuple[int, int]] = {}
    for r in rows:
        segs.setdefault(int(r["segment_address"]), (int(r["segment_size"]), 0))
    for addr in segs:
        blocks = sorted(
            (int(r["block_address"]), int(r["block_size"])) for r in rows if int(r["segment_address"]) == addr
        )
        assert (
            blocks[0][0] == addr
        )  # the first block starts the segment and each next one starts where it ends
        assert all(a + n == b for (a, n), (b, _) in zip(blocks, blocks[1:], strict=False))
        assert sum(n for _, n in blocks) == segs[addr][0]
    assert sum(size for size, _ in segs.values()) == report["summary"]["peak_reserved_bytes"]


def test_a_block_sits_in_a_segment_of_its_own_allocation_stream(case):
    _, trace, dm, _ = case
    by_id = {b.id: b for b in trace.blocks}
    allocated = [r for r in _segments(trace, dm) if r["block_state"] == "allocated" and r["block_id"]]
    assert allocated
    for r in allocated:
        b = by_id[int(r["block_id"])]
        assert int(r["stream_id"]) == b.stream
        assert int(r["block_size"]) >= b.size and int(r["requested_size"]) == b.requested
        assert r["type"] == str(b.category) and r["node_name"] == b.op


def test_fsdp_steps_show_their_side_stream_pools(case):
    name, trace, _, report = case
    pools = {(r["stream_name"], r["pool"]) for r in report["summary"]["segments_by_pool"]}
    streams = {name for name, _ in pools}
    assert "compute" in streams
    if name.startswith(("fsdp", "hsdp")):
        assert {"fsdp all-gather copy-in", "fsdp reduce-scatter"} <= streams
    if name.startswith("hsdp"):
        assert "fsdp all-reduce" in streams


def test_the_oom_verdict_is_on_device_bytes_for_a_job_that_fits_in_allocated_bytes():
    trace = dry_run(world__world_size=2)
    dm = device_memory_of(trace)
    capacity = (dm.peak_allocated + dm.peak_device) // 2  # room for every tensor, not for the device's total
    gib = capacity / GIB
    s = build_report(trace, DeviceTarget(device_memory_gib=gib))["summary"]
    assert s["peak_bytes"] < s["peak_allocated_bytes"] < s["capacity_bytes"] < s["peak_device_bytes"]
    assert s["oom"] is True and s["verdict"].startswith("OOM")
    assert s["headroom_bytes"] == s["capacity_bytes"] - s["peak_device_bytes"] < 0
    running, tips = 0, None  # the line whose running total first passes the capacity
    for row in s["device_lines"]:
        running += row["bytes"]
        if tips is None and running > s["capacity_bytes"]:
            tips = row["line"]
    assert s["verdict_line"] == tips and f"{tips} tips it" in s["verdict"]
    # judged on allocated bytes, as a CPU target is, the same capacity fits
    cpu = build_report(
        dry_run(world__world_size=2, target_device="cpu"), DeviceTarget("cpu", device_memory_gib=gib)
    )["summary"]
    assert cpu["oom"] is False and "peak_device_bytes" not in cpu


def test_without_outside_costs_the_caching_allocator_tips_it():
    trace = dry_run(world__world_size=2, cuda={"context_mib": 0, "nccl_channels": 1})
    trace.metadata["cuda"]["nccl"]["bytes"] = 0  # as if the communicators held nothing
    dm = device_memory_of(trace)
    capacity = dm.peak_allocated + (dm.peak_reserved - dm.peak_allocated) // 2
    s = build_report(trace, DeviceTarget(device_memory_gib=capacity / GIB))["summary"]
    assert s["oom"] is True and s["verdict_line"] == ALLOCATOR


def test_a_capacity_that_fits_reports_device_headroom():
    trace = dry_run(world__world_size=2)
    s = build_report(trace, DeviceTarget(device_memory_gib=80))["summary"]
    assert s["oom"] is False and s["verdict_line"] is None
    assert s["headroom_bytes"] == 80 * GIB - s["peak_device_bytes"]
    assert s["verdict"].startswith("fits: device peak")


def test_the_console_shows_allocated_reserved_and_device_at_a_glance():
    report = build_report(dry_run(world__world_size=2), DeviceTarget(device_memory_gib=0.5))
    s = report["summary"]
    lines = headline(report)
    from hyperdryrun.report.schema import human_bytes

    glance = (
        f"allocated [bold]{human_bytes(s['peak_allocated_bytes'])}[/] · reserved [bold]"
        f"{human_bytes(s['peak_reserved_bytes'])}[/] · device [bold]{human_bytes(s['peak_device_bytes'])}[/]"
    )
    assert lines[2] == glance
    assert lines[3] == (
        f"  reserved peak in {s['peak_reserved_phase']} (task {s['peak_reserved_task']}): "
        f"{human_bytes(s['allocated_at_reserved_peak_bytes'])} allocated + {human_bytes(s['fragmentation_bytes'])} cached"
    )
    assert lines[4].startswith("    cached: ")  # FSDP2's side-stream pools among them
    assert "fsdp all-gather copy-in" in lines[4] and "fsdp reduce-scatter" in lines[4]
    assert lines[-3].startswith("  device adds NCCL buffers ") and lines[-3].endswith(
        "CUDA context 0.82 GiB"
    )  # 840 MiB
    assert lines[-2].startswith("[bold red]OOM[/]: over 0.50 GiB on the device by ")
    cpu = headline(
        build_report(
            dry_run(world__world_size=2, target_device="cpu"), DeviceTarget("cpu", device_memory_gib=0.5)
        )
    )
    assert not any("reserved" in line for line in cpu)


def test_gpu_presets_set_the_capacity_the_sdpa_kernel_and_the_cublas_workspace():
    ops = {}
    for gpu in ("a100-80gb", "h100-80gb", "h200"):
        trace = dry_run(world__world_size=2, cuda={"gpu": gpu})  # FSDP2: bf16 compute
        s = build_report(trace, DeviceTarget(runtime=CudaRuntime(gpu=gpu)))["summary"]
        ops[gpu] = {b.op for b in trace.blocks if "scaled_dot_product" in b.op and "backward" not in b.op}
        # torch's total_memory on each card (hyperdryrun.world.gpus cites where it is printed)
        cap = {"a100-80gb": round(79.15 * 1024) * 2**20, "h100-80gb": round(79.11 * 1024) * 2**20,
               "h200": 150_109_880_320}[gpu]  # fmt: skip
        assert s["capacity_bytes"] == cap and s["oom"] is False and s["fit"] == "fits"
        ws = trace.metadata["cuda"]["cublas_workspace"]["bytes_per_handle"]
        assert ws == (2 * 4096 * 1024 + 8 * 16 * 1024 if gpu.startswith("a100") else 32 * 2**20)
    # bf16 attention, head_dim 16: cuDNN first on sm90 with the wheel's cuDNN 9.20, flash on sm80
    assert ops == {
        "a100-80gb": {"_scaled_dot_product_flash_attention"},
        "h100-80gb": {"_scaled_dot_product_cudnn_attention"},
        "h200": {"_scaled_dot_product_cudnn_attention"},
    }
    # --device-memory-gib still overrides the preset's capacity
    h200_at_40 = DeviceTarget(runtime=CudaRuntime(gpu="h200"), device_memory_gib=40)
    s = build_report(dry_run(cuda={"gpu": "h200"}), h200_at_40)["summary"]
    assert s["capacity_bytes"] == 40 * GIB and s["capacity_gib"] == 40


def test_without_a_gpu_or_capacity_there_is_no_verdict():
    s = build_report(dry_run())["summary"]
    assert "peak_reserved_bytes" in s
    assert not {"capacity_bytes", "oom", "verdict", "headroom_bytes"} & set(s)


def test_alloc_conf_comes_from_the_job_else_from_the_variable(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from_env = dry_run(world__world_size=2)
    alloc = from_env.metadata["cuda"]["allocator"]
    assert alloc == {"settings": "expandable_segments:True", "source": "$PYTORCH_CUDA_ALLOC_CONF"}
    assert all(seg.expandable for seg in device_memory_of(from_env).segments)
    flagged = dry_run(world__world_size=2, cuda={"alloc_conf": "max_split_size_mb:64"})
    assert flagged.metadata["cuda"]["allocator"] == {
        "settings": "max_split_size_mb:64",
        "source": "cuda.alloc_conf (--alloc-conf)",
    }
    assert not any(seg.expandable for seg in device_memory_of(flagged).segments)
    rep = build_report(flagged)["summary"]["allocator"]
    assert rep["settings"] == "max_split_size_mb:64" and rep["source"] == "cuda.alloc_conf (--alloc-conf)"


def test_runtime_cost_settings_come_from_the_job_else_the_variables(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("NCCL_BUFFSIZE", str(1 << 20))
    cuda = dry_run(world__world_size=2).metadata["cuda"]
    assert cuda["cublas_workspace"]["bytes_per_handle"] == 4096 * 1024 * 8
    assert cuda["nccl"]["buffsize"] == 1 << 20 and cuda["nccl"]["buffsize_source"] == "$NCCL_BUFFSIZE"
    assert cuda["nccl"]["bytes_per_communicator"] == 16 * 2 * ((1 << 20) + 524288 + 4915200)
    cuda = dry_run(
        world__world_size=2,
        cuda={
            "cublas_workspace_config": ":16:8",
            "nccl_buffsize": 2 << 20,
            "nccl_channels": 4,
            "context_mib": 300,
        },
    ).metadata["cuda"]
    assert cuda["cublas_workspace"]["bytes_per_handle"] == 16 * 1024 * 8
    assert cuda["nccl"]["bytes_per_communicator"] == 4 * 2 * ((2 << 20) + 524288 + 4915200)
    assert cuda["cuda_context"]["bytes"] == 300 * 2**20


def hand_trace():
    """Two blocks on stream 0: P (4 MiB, from before the step) and T (2 MiB at task 1, freed at 2)."""
    from types import SimpleNamespace

    from hyperdryrun.trace.blocks import PERSISTENT_END, Block, Category, Phase
    from hyperdryrun.trace.stacks import StackTable
    from hyperdryrun.trace.step import StepTrace
    from hyperdryrun.world.runtime import CudaRuntime, observed

    mib = 2**20
    blocks = [
        Block(0, 4 * mib, 4 * mib, 0, "initialization", Phase.INITIALIZATION, "w", 0, end=PERSISTENT_END,
              category=Category.PARAMETER),
        Block(1, 2 * mib, 2 * mib, 1, "mm", Phase.FORWARD, "w", 0, end=2, category=Category.ACTIVATION),
    ]  # fmt: skip
    no_step = SimpleNamespace(first_matmuls={}, process_groups={})
    cuda = observed(CudaRuntime().settings(environ={}), no_step, {0: "compute"})
    return StepTrace(
        blocks=blocks, num_tasks=3, task_phase=[Phase.FORWARD] * 3, task_op=["a", "mm", "b"], peak=6 * mib,
        peak_task=1, current=4 * mib, phase_peak={}, modules={}, stacks=StackTable(), initial=4 * mib,
        metadata={"cuda": cuda},
    )  # fmt: skip


def test_a_hand_made_trace_reserves_one_segment_and_reads_its_peak_where_the_step_allocates_most():
    # P takes the front of a 20 MiB large segment (a 1-10 MiB request) before step 1; T is served by the 16 MiB
    # remainder in step 1 and again in the step (step 2): 20 MiB reserved throughout, read at T (task 1, forward)
    # where the most is allocated: P + T = 6 MiB, 14 MiB cached.
    mib = 2**20
    trace = hand_trace()
    dm = device_memory_of(trace)
    s = build_report(trace, device=dm)["summary"]
    assert (s["peak_reserved_bytes"], s["peak_reserved_phase"], s["peak_reserved_task"]) == (
        20 * mib,
        "forward",
        1,
    )
    assert s["allocated_at_reserved_peak_bytes"] == 6 * mib and s["fragmentation_bytes"] == 14 * mib
    assert s["peak_allocated_bytes"] == 6 * mib  # P and T together, at task 1
    assert s["peak_device_bytes"] == 20 * mib + 840 * mib  # the segment and the CUDA context
    assert [(r["cause"], r["stream"], r["pool"], r["bytes"]) for r in s["reserved_breakdown"]] == [
        ("tensors", None, None, 6 * mib),
        ("blocks handed out unsplit", None, None, 0),
        ("cuBLAS workspaces", None, None, 0),
        ("cached free blocks", 0, "large", 14 * mib),
    ]
    rows = list(csv.reader(io.StringIO(segments_csv(trace, dm))))
    base = dm.segments[0].address
    assert rows[1:] == [
        [str(base), str(20 * mib), "0", "compute", "large", "False", str(base), str(4 * mib), "allocated", "0",
         str(4 * mib), "Parameter", "initialization"],
        [str(base), str(20 * mib), "0", "compute", "large", "False", str(base + 4 * mib), str(2 * mib), "allocated",
         "1", str(2 * mib), "Activation", "mm"],
        [str(base), str(20 * mib), "0", "compute", "large", "False", str(base + 6 * mib), str(14 * mib), "free", "",
         "0", "", ""],
    ]  # fmt: skip


def test_the_capacity_comes_from_the_target_handed_down_not_the_trace_metadata():
    trace = hand_trace()
    trace.metadata["cuda"]["capacity_bytes"] = 1  # an untyped figure in the metadata is not what is judged
    assert not {"capacity_bytes", "fit", "verdict"} & set(build_report(trace)["summary"])
    s = build_report(trace, DeviceTarget(runtime=CudaRuntime(gpu="h200")))["summary"]
    # torch's total_memory on an H200 (hyperdryrun.world.gpus cites where it is printed)
    assert (s["capacity_bytes"], s["fit"]) == (150_109_880_320, "fits")
    assert s["capacity_gib"] == 150_109_880_320 / GIB
