"""The CUDA memory snapshot export: PyTorch's own tooling renders it, and its bytes add up to the report's."""

from __future__ import annotations

import base64
import json
import pickle
import pickletools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hyperdryrun import StepTrace
from hyperdryrun.cli import main
from hyperdryrun.report.reader import load_any
from hyperdryrun.trace.blocks import PERSISTENT_END, Block, Category, Phase
from hyperdryrun.trace.stacks import StackTable
from hyperdryrun.viz import Segment, SnapshotError, build_snapshot, load_side
from tests.viz.conftest import csv_blocks

# Opcodes that the web viewer's unpickler (torch/utils/viz/MemoryViz.js, function unpickle) implements.
MEMORY_VIZ_OPCODES = {
    "APPEND", "APPENDS", "BINFLOAT", "BINGET", "BININT", "BININT1", "BININT2", "BINPUT", "BINUNICODE", "DICT",
    "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "FRAME", "LIST", "LONG1", "LONG_BINGET", "LONG_BINPUT", "MARK",
    "MEMOIZE", "NEWFALSE", "NEWTRUE", "NONE", "PROTO", "SETITEM", "SETITEMS", "SHORT_BINUNICODE", "STOP", "TUPLE",
    "TUPLE1", "TUPLE2", "TUPLE3",
}  # fmt: skip


@pytest.fixture(scope="module")
def snapshot_path(rank0_json: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("snap") / "rank_0.pickle"
    assert main(["snapshot", str(rank0_json), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def snap(snapshot_path: Path) -> dict:
    with open(snapshot_path, "rb") as f:
        return pickle.load(f)


def _memory_viz(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", *args], cwd=cwd, capture_output=True, text=True
    )


@pytest.mark.parametrize("plot", ["trace_plot", "segment_plot"])
def test_torch_memory_viz_renders_the_snapshot(plot: str, snapshot_path: Path, tmp_path: Path) -> None:
    out = tmp_path / f"{plot}.html"
    done = _memory_viz(plot, str(snapshot_path), "-o", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    html = out.read_text()
    assert "MemoryViz.js" in html
    # The page carries the snapshot itself, base64-encoded pickle padded with NULs to a multiple of 3 bytes.
    files = json.loads(re.search(r"const local_files = (\[.*\])", html)[1])
    raw = base64.b64decode(files[0]["base64"])
    assert raw.rstrip(b"\x00") == snapshot_path.read_bytes().rstrip(b"\x00")


def test_torch_memory_viz_stats_accounts_every_byte(
    snapshot_path: Path, rank0_json: Path, tmp_path: Path
) -> None:
    """``stats`` asserts that each segment's blocks add up to it; its totals are the bytes alive after the step."""
    done = _memory_viz("stats", str(snapshot_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = csv_blocks(rank0_json.with_suffix(".csv"))
    after = sum(int(r["size"]) for r in rows if r["is_persistent"] == "True")
    from torch.cuda._memory_viz import Bytes

    assert f"total_reserved: {Bytes(after)}" in done.stdout
    assert f"total_allocated: {Bytes(after)}" in done.stdout
    trace = _memory_viz("trace", str(snapshot_path), cwd=tmp_path)
    assert trace.returncode == 0, trace.stderr
    assert "cudaMalloc(" in trace.stdout and "del " in trace.stdout


def test_allocated_bytes_peak_at_the_reported_peak(snap: dict, rank0_json: Path) -> None:
    """Replaying the trace as the allocator counts (alloc adds the 512-rounded size, free_requested takes it
    back) peaks at the report's peak bytes, at its peak task, with its categories; cudaMalloc'd bytes too."""
    report = json.loads(rank0_json.read_text())
    (trace,) = [t for t in snap["device_traces"] if t]
    # What existed before the record (the model's blocks, issue 23): never allocated in the trace, so either in
    # the final segments or freed without an alloc, as MemoryViz.js takes them.
    live: dict[int, tuple[int, str]] = {
        b["address"]: ((b["size"] + 511) // 512 * 512, b["category"])
        for seg in snap["segments"]
        for b in seg["blocks"]
        if b["state"] == "active_allocated"
    }
    for e in reversed(trace):  # undo the record: what is live at its start
        rounded = (e["size"] + 511) // 512 * 512
        if e["action"] == "alloc":
            live.pop(e["addr"])
        elif e["action"] == "free_requested":
            live[e["addr"]] = (rounded, "unknown")
    before = {s["address"]: s["total_size"] for s in snap["segments"]}
    for e in reversed(trace):
        if e["action"] == "segment_alloc":
            before.pop(e["addr"])
        elif e["action"] == "segment_free":
            before[e["addr"]] = e["size"]
    assert {c for _, c in live.values()} <= {"Parameter", "Buffer", "Optstate"}  # the model, not the step
    allocated = best = sum(n for n, _ in live.values())
    reserved = best_reserved = sum(before.values())
    best_task = -1
    at_best: dict[str, int] = {}
    for e in trace:
        rounded = (e["size"] + 511) // 512 * 512
        if e["action"] == "alloc":
            allocated += rounded
            live[e["addr"]] = (rounded, e["category"])
        elif e["action"] == "free_requested":
            allocated -= rounded
            del live[e["addr"]]
        elif e["action"] == "segment_alloc":
            reserved += e["size"]
        elif e["action"] == "segment_free":
            reserved -= e["size"]
        best_reserved = max(best_reserved, reserved)
        if allocated > best:
            best, best_task = allocated, e["time_us"]
            at_best = {}
            for size, cat in live.values():
                at_best[cat] = at_best.get(cat, 0) + size
    s = report["summary"]
    assert best == s["peak_bytes"] and best_task == s["peak_task"]
    assert best_reserved == s["peak_bytes"]  # one segment per block without an allocator model
    assert at_best == {c: n for c, n in s["breakdown_at_peak"].items() if n}
    assert allocated == s["current_bytes"]


def test_blocks_tile_each_segment_and_are_the_blocks_alive_after_the_step(
    snap: dict, rank0_json: Path
) -> None:
    rows = csv_blocks(rank0_json.with_suffix(".csv"))
    persistent = sorted((int(r["device_addr"]), int(r["size"])) for r in rows if r["is_persistent"] == "True")
    active = []
    for seg in snap["segments"]:
        addr = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == addr
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"]
        got = [(b["address"], b["size"]) for b in seg["blocks"] if b["state"] == "active_allocated"]
        assert seg["allocated_size"] == sum(n for _, n in got)
        active += got
    assert sorted(active) == persistent


def test_trace_replays_as_the_web_viewer_does(snap: dict, snapshot_path: Path) -> None:
    """Every free follows its alloc, every block lies in a live segment and meets no other live block, the state
    at the end is ``segments``; the pickle uses only opcodes the web viewer's unpickler reads."""
    ops = {op.name for op, _, _ in pickletools.genops(snapshot_path.read_bytes())}
    assert ops <= MEMORY_VIZ_OPCODES, ops - MEMORY_VIZ_OPCODES
    (trace,) = [t for t in snap["device_traces"] if t]
    # the record begins after the model was built: its segments and blocks are there before the first entry
    allocs = {e["addr"] for e in trace if e["action"] == "alloc"}
    seg_allocs = {e["addr"] for e in trace if e["action"] == "segment_alloc"}
    frees = {
        e["addr"]: e["size"] for e in trace if e["action"] == "free_requested" and e["addr"] not in allocs
    }
    segs: dict[int, int] = {
        s["address"]: s["total_size"] for s in snap["segments"] if s["address"] not in seg_allocs
    }
    blocks: dict[int, int] = {
        b["address"]: b["size"]
        for s in snap["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated" and b["address"] not in allocs
    }
    blocks.update({a: (n + 511) // 512 * 512 for a, n in frees.items()})
    pending: set[int] = set()
    last_time = -1
    for e in trace:
        assert e["time_us"] >= last_time
        last_time = e["time_us"]
        a, n = e["addr"], e["size"]
        if e["action"] == "segment_alloc":
            assert a not in segs
            segs[a] = n
        elif e["action"] == "segment_free":
            assert segs.pop(a) == n and not any(a <= b < a + n for b in blocks)
        elif e["action"] == "alloc":
            assert any(s <= a and a + n <= s + size for s, size in segs.items())
            assert not any(b < a + n and a < b + size for b, size in blocks.items())
            blocks[a] = (n + 511) // 512 * 512
        elif e["action"] == "free_requested":
            assert a in blocks and a not in pending
            pending.add(a)
        elif e["action"] == "free_completed":
            pending.remove(a)
            del blocks[a]
    assert not pending
    assert segs == {s["address"]: s["total_size"] for s in snap["segments"]}
    final = {b["address"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"}
    assert set(blocks) == final
    cats = {e["category"] for e in trace if "category" in e}
    assert "unknown" in cats  # without it MemoryViz.js's annotate_snapshot throws
    assert {str(c) for c in Category} >= cats - {"unknown"}


def test_frames_are_the_python_stack_with_the_op(snap: dict, rank0_json: Path) -> None:
    rows = csv_blocks(rank0_json.with_suffix(".csv"))
    row = next(r for r in rows if r["python_stack"] and r["node_name"] == "_log_softmax")  # node_name: the op
    (trace,) = [t for t in snap["device_traces"] if t]
    entry = next(e for e in trace if e["action"] == "alloc" and e["addr"] == int(row["device_addr"]))
    first = row["python_stack"].split("|")[0]
    file, line, func = (kv.split(":", 1)[1] for kv in first.split(";", 2))
    assert entry["frames"][0]["name"] == "at::_ops::_log_softmax::call"
    assert entry["frames"][1] == {"filename": file, "line": int(line), "name": func}
    assert entry["category"] == row["type"] == "Activation"


def test_hyperdryrun_reads_the_snapshot_back_with_the_same_peak(
    snapshot_path: Path, rank0_json: Path
) -> None:
    report = json.loads(rank0_json.read_text())
    back = load_any(snapshot_path)
    assert back.peak == report["summary"]["peak_bytes"]
    assert back.current == report["summary"]["current_bytes"]


def _trace(blocks: list[Block], num_tasks: int) -> StepTrace:
    return StepTrace(
        blocks=blocks,
        num_tasks=num_tasks,
        task_phase=[Phase.FORWARD] * num_tasks,
        task_op=["mm"] * num_tasks,
        peak=0,
        peak_task=0,
        current=0,
        phase_peak={},
        modules={},
        stacks=StackTable(),
        initial=0,
    )


def _block(i: int, addr: int, size: int, start: int, end: int = PERSISTENT_END) -> Block:
    return Block(
        id=i, size=size, requested=size - 100, start=start, op="mm", phase=Phase.FORWARD, module="w",
        stack_id=0, addr=addr, end=end, category=Category.ACTIVATION,
    )  # fmt: skip


def test_segments_of_an_allocator_model_hold_their_blocks_with_free_gaps() -> None:
    """A 2 MiB segment serving three 512 KiB / 256 KiB blocks, two freed before the end: cudaMalloc'd once, its
    final state one active block between two inactive gaps."""
    base, kib = 0x7F0000000000, 1024
    a = _block(0, base, 512 * kib, 0, 4)
    b = _block(1, base + 512 * kib, 512 * kib, 1, 3)
    c = _block(2, base + 1024 * kib, 256 * kib, 2)
    seg = Segment(base, 2048 * kib, 0, [a, b, c], 0)
    snap = build_snapshot(_trace([a, b, c], 5), [seg])
    (only,) = snap["segments"]
    assert only["total_size"] == 2048 * kib and only["allocated_size"] == 256 * kib
    assert only["requested_size"] == 256 * kib - 100
    assert [(x["address"] - base, x["size"], x["state"]) for x in only["blocks"]] == [
        (0, 1024 * kib, "inactive"),
        (1024 * kib, 256 * kib, "active_allocated"),
        (1280 * kib, 768 * kib, "inactive"),
    ]
    actions = [(e["action"], e["time_us"], e["addr"] - base) for e in snap["device_traces"][0]]
    assert actions == [
        ("segment_alloc", 0, 0),
        ("alloc", 0, 0),
        ("alloc", 1, 512 * kib),
        ("alloc", 2, 1024 * kib),
        ("free_requested", 3, 512 * kib),
        ("free_completed", 3, 512 * kib),
        ("free_requested", 4, 0),
        ("free_completed", 4, 0),
        ("snapshot", 5, -base),
    ]
    assert snap["device_traces"][0][1]["size"] == 512 * kib - 100  # torch records the requested size


def test_a_block_outside_its_segment_is_a_one_line_error() -> None:
    a = _block(0, 0x1000, 4096, 0)
    with pytest.raises(
        SnapshotError, match=r"^block 0 at 0x1000 \(4096 B\) lies outside its segment at 0x2000"
    ):
        build_snapshot(_trace([a], 1), [Segment(0x2000, 8192, 0, [a])])
    with pytest.raises(SnapshotError, match=r"^block 0 is in no segment"):
        build_snapshot(_trace([a], 1), [])


def test_clashing_addresses_are_laid_out_afresh_without_an_allocator_model() -> None:
    """Ingested traces may lack addresses: blocks then get fresh ones, and still never overlap."""
    a, b = _block(0, 0, 1024, 0, 2), _block(1, 0, 2048, 1)
    snap = build_snapshot(_trace([a, b], 3))
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert allocs[0]["addr"] > 0 and allocs[1]["addr"] >= allocs[0]["addr"] + 1024


def test_device_is_the_ranks_local_rank(run_dir: Path, tmp_path: Path) -> None:
    side = load_side(run_dir / "rank_1" / "rank_1_memory.json")
    assert side.report["metadata"]["local_rank"] == 1
    out = tmp_path / "r1.pickle"
    assert main(["snapshot", side.source, "-o", str(out)]) == 0
    snap = pickle.loads(out.read_bytes())
    assert [len(t) > 0 for t in snap["device_traces"]] == [False, True]
    assert {s["device"] for s in snap["segments"]} == {1}


def test_a_report_without_its_csv_is_a_one_line_error(rank0_json: Path, tmp_path: Path, capsys) -> None:
    lone = tmp_path / "lone.json"
    lone.write_text(rank0_json.read_text())
    assert main(["snapshot", str(lone), "-o", str(tmp_path / "x.pickle")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{lone}: no memory-block CSV beside it (lone.csv)" in err
    assert not (tmp_path / "x.pickle").exists()


def test_a_cuda_reports_reserved_line_peaks_at_its_reserved_peak(tmp_path):
    """The page's reserved line is the report's own allocator replay, rebuilt from the JSON and its CSV (streams
    included): its highest point is the report's peak_reserved_bytes, and device adds what lies outside it."""
    from hyperdryrun.cli import main
    from hyperdryrun.viz.data import load_side

    out = tmp_path / "out"
    assert main(["run", "--model", "llama-tiny", "--world-size", "2", "--seq-len", "64", "--quiet",
                 "--output-dir", str(out)]) == 0  # fmt: skip
    side = load_side(out / "rank_0" / "rank_0_memory.json")
    summary = side.report["summary"]
    assert max(side.series["reserved"]) == summary["peak_reserved_bytes"]
    assert max(side.series["device"]) == summary["peak_device_bytes"]
    assert len(side.series["reserved"]) == side.trace.num_tasks


def test_a_report_and_its_own_snapshot_compare_equal(snapshot_path: Path, rank0_json: Path, capsys) -> None:
    """Issue 23: the snapshot's record begins after the model was built, as a measured one does, so both sides have
    the same baseline (the model) and the same peak: exit 0, judged on the whole peak, not on the step alone."""
    capsys.readouterr()
    assert main(["compare", str(rank0_json), str(snapshot_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    report = json.loads(rank0_json.read_text())
    assert result["peak"]["diff"] == 0 and result["within_tolerance"]
    assert result["judged_on"] != "step_only"
    assert (
        result["b"]["initial_bytes"] == result["a"]["initial_bytes"] == report["summary"]["initial_bytes"] > 0
    )


def test_a_snapshot_written_from_a_report_has_no_reserved_figures_to_compare(
    snapshot_path: Path, rank0_json: Path, capsys
) -> None:
    """Its segments are made to hold the report's tensors, not the caching allocator's: comparing their 'reserved'
    with the report's showed -97% on a report and its own snapshot. The comparison leaves reserved out and says
    why; the report's own reserved figure is still there."""
    capsys.readouterr()
    assert main(["compare", str(rank0_json), str(snapshot_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["reserved"] is None
    assert (result["a"]["tensors_only"], result["b"]["tensors_only"]) == (False, True)
    assert "peak_reserved_bytes" in json.loads(rank0_json.read_text())["summary"]
    assert main(["compare", str(rank0_json), str(snapshot_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no caching-allocator comparison: B is a snapshot HyperDryRun wrote from a report" in out
    assert "caching allocator (reserved)" not in out
