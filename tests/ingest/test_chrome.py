"""Chrome trace ingestion, on a real CPU step profiled by make_fixtures.chrome_trace(); expectations come from the
raw trace (the profiler's own "Total Allocated" counter and event intervals) and from the model's shapes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from hyperdryrun.ingest.chrome import device_name, parse_frame, trace_from_chrome
from hyperdryrun.ingest.files import IngestError, user_file
from hyperdryrun.report import build_report
from hyperdryrun.report.reader import load_any
from hyperdryrun.report.writer import to_json
from hyperdryrun.trace.blocks import Phase
from tests.ingest.fixtures.make_fixtures import BATCH, DIM, HIDDEN, OUT

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_step.trace.json.gz"
FP32 = 4


@pytest.fixture(scope="module")
def raw() -> dict:
    return json.loads(gzip.decompress(FIXTURE.read_bytes()))


@pytest.fixture(scope="module")
def trace():
    return load_any(FIXTURE)


def memory_events(raw: dict) -> list[dict]:
    return sorted((e for e in raw["traceEvents"] if e.get("name") == "[memory]"), key=lambda e: e["ts"])


def test_peak_equals_the_profilers_total_allocated_counter(raw, trace):
    mem = memory_events(raw)
    assert trace.peak == max(e["args"]["Total Allocated"] for e in mem)
    assert trace.metadata["reported_peak_bytes"] == trace.peak
    assert trace.current == mem[-1]["args"]["Total Allocated"]


def test_one_block_per_allocation_event_with_its_bytes(raw, trace):
    allocs = [e["args"]["Bytes"] for e in memory_events(raw) if e["args"]["Bytes"] > 0]
    assert len(trace.blocks) == len(allocs)
    assert sorted(b.size for b in trace.blocks) == sorted(allocs)


def test_forward_linear_outputs_have_the_layer_shapes_and_module_paths(trace):
    fw = {(b.module, b.size) for b in trace.blocks if b.phase is Phase.FORWARD and b.op == "aten::addmm"}
    assert fw == {
        ("TinyNet_0.Block_0.Linear_0", BATCH * HIDDEN * FP32),
        ("TinyNet_0.Block_0.Linear_1", BATCH * DIM * FP32),
        ("TinyNet_0.Block_1.Linear_2", BATCH * HIDDEN * FP32),
        ("TinyNet_0.Block_1.Linear_3", BATCH * DIM * FP32),
        ("TinyNet_0.Linear_4", BATCH * OUT * FP32),
    }


def test_only_the_checkpointed_block_is_recomputed(trace):
    rec = [b for b in trace.blocks if b.phase is Phase.RECOMPUTE]
    assert ("Block_1.Linear_2", "aten::addmm", BATCH * HIDDEN * FP32) in {
        (b.module, b.op, b.size) for b in rec
    }
    assert not any("Block_0" in b.module for b in rec)


def test_optimizer_blocks_are_the_allocations_inside_optimizer_step(raw, trace):
    (span,) = [e for e in raw["traceEvents"] if e.get("name", "").startswith("Optimizer.step#")]
    inside = [
        e
        for e in memory_events(raw)
        if e["args"]["Bytes"] > 0 and span["ts"] <= e["ts"] <= span["ts"] + span["dur"]
    ]
    opt = [b for b in trace.blocks if b.phase is Phase.OPTIMIZER]
    assert len(opt) == len(inside) > 0
    assert sum(b.size for b in opt) == sum(e["args"]["Bytes"] for e in inside)


def test_phases_come_in_step_order(trace):
    order = {Phase.FORWARD: 0, Phase.BACKWARD: 1, Phase.RECOMPUTE: 1, Phase.OPTIMIZER: 2}
    ranks = [order[p] for p in trace.task_phase]
    assert ranks == sorted(ranks)
    assert {Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE, Phase.OPTIMIZER} <= set(trace.task_phase)


def test_stacks_keep_user_frames_only(trace):
    frames = [f for b in trace.blocks for f in trace.stacks.frames(b.stack_id)]
    assert frames and all(user_file(f[0]) for f in frames)
    assert {f[0] for f in frames} == {"make_fixtures.py"}


def test_plain_and_gzipped_json_read_the_same_and_reports_are_deterministic(tmp_path, raw):
    plain = tmp_path / "trace.json"
    plain.write_text(json.dumps(raw))
    a = build_report(load_any(plain))
    b = build_report(load_any(FIXTURE))
    a["metadata"].pop("source")
    b["metadata"].pop("source")
    assert to_json(a) == to_json(b)
    assert to_json(build_report(load_any(FIXTURE))) == to_json(build_report(load_any(FIXTURE)))


def test_device_names_are_normalised():
    assert device_name(0, -1) == "cpu"
    assert device_name(1, 2) == "cuda:2"
    assert device_name(20, 0) == "npu:0"
    assert device_name("privateuseone", 1) == "npu:1"
    assert parse_frame("model.py(12): forward") == ("model.py", 12, "forward")
    assert parse_frame("nn.Module: Linear_0") is None


def test_accelerator_events_are_chosen_over_cpu_and_privateuse1_reads_as_npu(raw):
    data = json.loads(json.dumps(raw))
    mem = memory_events(data)
    half = {id(e) for e in mem[: len(mem) // 2]}
    for e in mem:
        if id(e) in half:
            e["args"]["Device Type"], e["args"]["Device Id"] = 20, 0
    tr = trace_from_chrome(data, "t.json")
    assert tr.metadata["target_device"] == "npu:0"
    # the first event's counter equals its bytes (nothing before the window): no resident block
    assert len(tr.blocks) == sum(1 for e in mem[: len(mem) // 2] if e["args"]["Bytes"] > 0)
    cpu = trace_from_chrome(data, "t.json", device="cpu")
    assert cpu.metadata["target_device"] == "cpu"
    assert trace_from_chrome(data, "t.json", device="npu").metadata["target_device"] == "npu:0"
    with pytest.raises(IngestError, match="no memory events on device 'cuda'"):
        trace_from_chrome(data, "t.json", device="cuda")
    for e in mem[:2]:
        e["args"]["Device Id"] = 1
    with pytest.raises(IngestError, match="device 'npu' is ambiguous"):
        trace_from_chrome(data, "t.json", device="npu")


def test_bytes_held_before_the_trace_become_one_resident_block(raw):
    data = json.loads(json.dumps(raw))
    for e in memory_events(data):
        e["args"]["Total Allocated"] += 1 << 20  # as on CUDA, where the counter includes the weights
    tr = trace_from_chrome(data, "t.json")
    (res,) = [b for b in tr.blocks if b.op == "resident before trace"]
    assert res.size == 1 << 20 and res.phase is Phase.INITIALIZATION and res.persistent
    assert tr.peak == max(e["args"]["Total Allocated"] for e in memory_events(data))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"traceEvents": []}, "no \\[memory\\] events"),
        ({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2}]}, "no \\[memory\\] events"),
        ({"traceEvents": [{"ph": "i", "name": "[memory]", "ts": 1, "args": {}}]}, "lacks ts, args.Bytes"),
    ],
)
def test_traces_without_usable_memory_events_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(content))
    with pytest.raises(IngestError, match=message) as err:
        load_any(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_truncated_gzip_is_an_error(tmp_path):
    path = tmp_path / "t.json.gz"
    path.write_bytes(FIXTURE.read_bytes()[:2000])
    with pytest.raises(IngestError, match="corrupt gzip"):
        load_any(path)


def _x(cat: str, name: str, ts: float, dur: float, tid: int) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def _mem(ts: float, addr: int, nbytes: int, total: int, tid: int, device_type: int = 1) -> dict:
    args = {"Addr": addr, "Bytes": nbytes, "Total Allocated": total, "Total Reserved": 0}
    args |= {"Device Type": device_type, "Device Id": 0 if device_type else -1}
    return {
        "ph": "i",
        "cat": "cpu_instant_event",
        "s": "t",
        "name": "[memory]",
        "pid": 1,
        "tid": tid,
        "ts": ts,
        "args": args,
    }


def gpu_like_trace() -> dict:
    """A hand-written CUDA-style trace: forward on the main thread, backward on the autograd device thread,
    10000 B already allocated when profiling began (512 B of it freed in the window), one CPU event to ignore."""
    main, engine = 1, 2
    events = [
        _x("python_function", "train.py(10): step", 0, 1000, main),
        _x("python_function", "nn.Module: Net_0", 10, 100, main),
        _x("python_function", "nn.Module: Linear_0", 20, 50, main),
        _x("cpu_op", "aten::linear", 25, 40, main),
        _x("cpu_op", "aten::addmm", 30, 20, main),
        _x("cpu_op", "aten::empty", 31, 2, main),
        _mem(32, 0xA, 1024, 11024, main),
        _mem(50, 0xF, 64, 64, main, device_type=0),
        _x("python_function", "torch/autograd/__init__.py(200): backward", 200, 300, main),
        _x("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", 210, 50, engine),
        _x("cpu_op", "AddmmBackward0", 211, 47, engine),
        _x("cpu_op", "aten::mm", 215, 10, engine),
        _mem(220, 0xB, 2048, 13072, engine),
        _mem(230, 0xA, -1024, 12048, engine),
        _mem(240, 0xD, -512, 11536, engine),
        _x("user_annotation", "Optimizer.step#SGD.step", 600, 100, main),
        _x("cpu_op", "aten::_foreach_add", 610, 20, main),
        _mem(615, 0xC, 4096, 15632, main),
        _mem(800, 0xB, -2048, 13584, main),
    ]
    return {"schemaVersion": 1, "traceEvents": events}


def test_a_gpu_style_trace_gives_the_hand_worked_blocks_and_peak():
    tr = trace_from_chrome(gpu_like_trace(), "gpu.json")
    assert tr.metadata["target_device"] == "cuda:0"
    rows = [(b.size, b.op, b.phase, b.module, b.persistent) for b in tr.blocks]
    assert rows == [
        (10000 - 512, "resident before trace", Phase.INITIALIZATION, "", True),
        (
            512,
            "initialization",
            Phase.INITIALIZATION,
            "",
            False,
        ),  # freed in the window, never allocated there
        (1024, "aten::addmm", Phase.FORWARD, "Net_0.Linear_0", False),  # through aten::empty: the op is addmm
        (2048, "aten::mm", Phase.BACKWARD, "", False),  # the autograd thread's own enclosing ops
        (4096, "aten::_foreach_add", Phase.OPTIMIZER, "", True),
    ]
    assert tr.stacks.frames(tr.blocks[2].stack_id) == (("train.py", 10, "step"),)
    assert (tr.initial, tr.peak, tr.current) == (10000, 15632, 13584)
    assert tr.phase_peak == {Phase.FORWARD: 11024, Phase.BACKWARD: 13072, Phase.OPTIMIZER: 15632}
    cpu = trace_from_chrome(gpu_like_trace(), "gpu.json", device="cpu")
    assert [b.size for b in cpu.blocks] == [64]
